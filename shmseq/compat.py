"""Drop-in names for code written for MDNC's ``mdnc.data.sequence``.

Differences from MDNC, on purpose: batches keep the worker's dtypes (MDNC casts
``'cpu'``/``'cuda'`` output to float32), arrive exactly in order, and there are no
converter processes or threads (``num_converters`` is the number of CUDA copy streams;
``start(compat=...)`` is accepted and ignored).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .sequence import ShmSequence

if TYPE_CHECKING:
    from numpy.typing import ArrayLike


class MSequence(ShmSequence):
    """MDNC's ``MSequence(worker, dset_size, num_workers, num_converters, batch_size, buffer,
    shuffle, thread_type, out_type, seed)``, running on shmseq's ring."""

    def __init__(self, worker: object, dset_size: ArrayLike, num_workers: int = 4,
                 num_converters: int | None = None, batch_size: int = 32, buffer: int = 10,
                 shuffle: bool = True, thread_type: str = "proc", out_type: str = "cuda",
                 seed: int | None = None, **options: Any) -> None:
        super().__init__(worker, dset_size, batch_size=batch_size, buffer=buffer,
                         num_workers=num_workers, num_converters=num_converters, shuffle=shuffle,
                         seed=seed, thread_type=thread_type, out_type=out_type, **options)


class MPSequence(MSequence):
    """MDNC's ``MPSequence``: workers are processes."""

    def __init__(self, worker: object, dset_size: ArrayLike, num_workers: int = 4,
                 num_converters: int | None = None, batch_size: int = 32, buffer: int = 10,
                 shuffle: bool = True, out_type: str = "cuda", seed: int | None = None,
                 **options: Any) -> None:
        super().__init__(worker, dset_size, num_workers, num_converters, batch_size, buffer,
                         shuffle, "proc", out_type, seed, **options)


class MTSequence(MSequence):
    """MDNC's ``MTSequence``: workers are threads."""

    def __init__(self, worker: object, dset_size: ArrayLike, num_workers: int = 4,
                 num_converters: int | None = None, batch_size: int = 32, buffer: int = 10,
                 shuffle: bool = True, out_type: str = "cuda", seed: int | None = None,
                 **options: Any) -> None:
        super().__init__(worker, dset_size, num_workers, num_converters, batch_size, buffer,
                         shuffle, "thread", out_type, seed, **options)
