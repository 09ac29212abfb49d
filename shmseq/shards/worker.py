"""``ShardWorker``: a batch built from sample ids, each sample read from its shard, decoded by the
user's ``decode`` and stacked into the batch (straight into a slot, in a worker).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from ..engine import Ragged
from ..remote import RemotePolicy
from .index import ShardIndex
from .reader import ShardFiles, ShardReader
from .tar import ShardError

if TYPE_CHECKING:
    from ..engine import SlotAllocator


ON_ERROR = ("raise", "skip")


def stack(samples: list, empty: Callable = np.empty) -> object:
    """Decoded samples as one batch: arrays stacked into ``empty(shape, dtype)`` (a slot's
    allocator, in a worker), ``bytes`` gathered into a ``Ragged`` leaf, tuples and dicts field
    by field."""
    first = samples[0]
    if isinstance(first, tuple):
        return tuple(stack([sample[i] for sample in samples], empty) for i in range(len(first)))
    if isinstance(first, dict):
        return {field: stack([sample[field] for sample in samples], empty) for field in first}
    if isinstance(first, bytes):
        return Ragged.from_items(samples)  # encoded images, say: each written once into the slot
    arrays = [np.asarray(sample) for sample in samples]
    if any(array.shape != arrays[0].shape for array in arrays):
        raise ValueError(f"decoded samples of shapes {sorted({a.shape for a in arrays})} cannot be "
                         "stacked into a batch: decode to one shape (crop or pad)")
    return np.stack(arrays, out=empty((len(arrays), *arrays[0].shape), arrays[0].dtype))


class ShardWorker:
    """``worker[ids]``: the samples of ``ids`` read from their shards, decoded by
    ``decode(sample) -> array or tuple/dict of arrays`` and stacked.

    ``on_error='raise'`` (default): a sample that cannot be read or decoded fails its batch
    with a ``ShardError`` naming the shard, the sample and its offset. ``'skip'``: the sample is
    left out of its batch (which is then smaller), and the consumer is told with a warning and
    ``stats.skipped_samples``; a batch left with no sample still fails.

    ``remote``: the timeout and retries of remote reads (``shmseq.remote``); what they did is
    counted and handed to the consumer's ``stats`` by ``pop_counts()``. Samples are decoded in
    the order they can be read: those of a shard still being fetched as their bytes come, while
    the fetch brings the others."""

    def __init__(self, shards: ShardIndex, decode: Callable[[dict], object], *,
                 on_error: str = "raise", storage_options: dict | None = None,
                 remote: RemotePolicy | None = None, cache: ShardFiles | None = None) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {', '.join(map(repr, ON_ERROR))}, "
                             f"got {on_error!r}")
        self.reader = ShardReader(shards, storage_options, policy=remote, cache=cache)
        self.decode = decode
        self.on_error = on_error
        self._skipped: list[str] = []

    def __len__(self) -> int:
        return len(self.reader.index)

    def __getitem__(self, ids: np.ndarray) -> object:
        return self._batch(ids, np.empty)

    def fill_batch(self, ids: np.ndarray, out: SlotAllocator) -> object:
        """The batch stacked straight into the slot (``out``: its ``SlotAllocator``)."""
        return self._batch(ids, out.empty)

    def _batch(self, ids: np.ndarray, empty: Callable) -> object:
        ids = np.asarray(ids, np.int64)
        if self.on_error == "raise":
            decoded: list[object] = [None] * len(ids)
            for position, sample in self.reader.read_as_ready(ids):  # decoded as they come
                decoded[position] = self._decoded(sample)
            return stack(decoded, empty)
        decoded = []
        for sample in self._readable(ids):
            try:
                decoded.append(self._decoded(sample))
            except ShardError as exc:
                self._skipped.append(str(exc))
        if not decoded:
            raise ShardError(f"every sample of the batch was left out: {'; '.join(self._skipped)}")
        return stack(decoded, empty)

    def _readable(self, ids: np.ndarray) -> list[dict]:
        """The samples of ``ids`` that can be read; when some cannot, the others are read one
        by one and each failure is noted as skipped."""
        try:
            return self.reader.read(ids)
        except ShardError:
            samples = []
            for sample_id in ids:
                try:
                    samples += self.reader.read(sample_id[None])
                except ShardError as exc:
                    self._skipped.append(str(exc))
            return samples

    def _decoded(self, sample: dict) -> object:
        try:
            return self.decode(sample)
        except Exception as exc:  # noqa: BLE001 - named with its shard and offset
            fields = ", ".join(field for field in sample if not field.startswith("__"))
            raise ShardError(f"shard {sample['__url__']}: sample {sample['__key__']} at byte "
                             f"{sample['__offset__']} (members: {fields}) does not decode: "
                             f"{type(exc).__name__}: {exc}") from exc

    def pop_skipped(self) -> list[str]:
        """What was left out since the last call (the worker loop reports it with the batch)."""
        skipped, self._skipped = self._skipped, []
        return skipped

    def worker_exit(self) -> None:
        """Stop the whole-shard fetches this worker process started that nobody waits for any
        more: they held its exit until they ended (seconds, a large shard over a slow link)."""
        self.reader.close()

    def pop_counts(self) -> dict:
        """The remote reads and the shard cache's counts since the last call, as ``LoaderStats``
        fields to add to (the worker loop sends them with each batch)."""
        counts = {f"remote_{name}": value for name, value in self.reader.counters.take().items()
                  if value}
        if self.reader.cache is not None:
            counts.update((name, value) for name, value in self.reader.cache.counters.take().items()
                          if value)
        return counts
