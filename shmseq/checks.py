"""Argument checks shared by the front ends: each error names the argument, the value given,
and what would do instead."""
from __future__ import annotations

import math
import numbers

from .devices import OUT_TYPES

MAX_TIMEOUT = 2_147_483  # seconds: the most select() takes (a 32-bit count of milliseconds)


def check_int(name: str, value, minimum: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}"
                         f"{' or None' if optional else ''}, got {value!r}")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_out_type(out_type) -> None:
    if not isinstance(out_type, str) or not (
            out_type in OUT_TYPES or (out_type.startswith("cuda:") and out_type[5:].isdigit())):
        raise ValueError(f"out_type must be 'null' (numpy), 'cpu' (torch), 'cuda' or 'cuda:N', "
                         f"got {out_type!r}")


def check_timeout(timeout) -> float | None:
    """Seconds to wait for a batch; None (given as None or inf): as long as it takes."""
    if timeout is None or (isinstance(timeout, numbers.Real) and timeout == math.inf):
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not (
            0 < timeout <= MAX_TIMEOUT):
        raise ValueError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT:,}], or None "
                         f"(or inf) to wait as long as it takes, got {timeout!r}")
    return float(timeout)


def check_worker(worker) -> None:
    if not (hasattr(worker, "__getitem__") or hasattr(worker, "fill_batch")):
        raise TypeError(f"worker must be a class or an object with __getitem__(indices) "
                        f"(or fill_batch(indices, out)), got {worker!r}")
