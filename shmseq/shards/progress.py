"""Progress bars on stderr for the long steps of making shards (writing, scanning): tqdm's,
where stderr is a terminal and tqdm is installed, unless asked for or against.
"""
from __future__ import annotations

from ..remote import is_remote

import collections
import collections.abc
import contextlib
import importlib.util
import posixpath
import sys
import time
from typing import Callable, Iterator, Protocol



POSTFIX_S = 0.1        # how often a scan's bar shows the samples found in a remote shard


def length_of(samples: object) -> int | None:
    return len(samples) if isinstance(samples, collections.abc.Sized) else None


class Bar(Protocol):
    """A progress bar, as tqdm's: ``update(count)`` more done, and a word beside it."""

    def update(self, count: int, /) -> object:
        """``count`` more done."""

    def set_postfix_str(self, text: str, /) -> object:
        """``text`` shown after the bar, at once."""


class NoBar:
    def update(self, count: int) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


def samples_found(bar: Bar, url: str) -> Callable[[int], None] | None:
    """What shows the samples found so far in a remote shard beside the bar, at most every
    ``POSTFIX_S``: its headers are a request each, so a shard can take minutes, which a bar
    counting whole shards would show as nothing. None where that is not wanted (local shards
    are scanned in a blink; no bar)."""
    if isinstance(bar, NoBar) or not is_remote(url):
        return None
    name, shown = posixpath.basename(url), [0.0]

    def found(count: int) -> None:
        if time.monotonic() - shown[0] >= POSTFIX_S:
            bar.set_postfix_str(f"{name}: {count} samples")
            shown[0] = time.monotonic()
    return found


@contextlib.contextmanager
def progress_bar(wanted: bool | None, total: int | None, unit: str, label: str) -> Iterator[Bar]:
    """A tqdm bar on stderr, ``label`` before it (``wanted`` None: where stderr is a terminal
    and tqdm is there)."""
    if wanted is None:
        wanted = sys.stderr.isatty() and importlib.util.find_spec("tqdm") is not None
    if not wanted:
        yield NoBar()
        return
    try:
        from tqdm import tqdm
    except ImportError:
        raise ImportError("progress=True shows a bar with tqdm: pip install tqdm, or pass "
                          "progress=False") from None
    with tqdm(total=total, unit=unit, desc=label, file=sys.stderr, dynamic_ncols=True) as bar:
        yield bar
