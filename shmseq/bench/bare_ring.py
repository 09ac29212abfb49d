"""The bare ring: the least a shared-memory ring transport can cost, as a reference.

Fork, one preallocated segment mapped before the workers are forked (so they inherit it),
workers writing each batch in place at fixed offsets of a slot with the very ``fill`` the
other systems' workers call, and slot ids through the cheapest channel measured
(``python -m pytest bench -k handoff``: kernel message queues): a queue of free slots to the
workers, a queue of written ``(slot, batch)`` back. No ordering (batches come as they are
done), no leases (a slot goes back when the consumer asks for the next batch), no header (the
layout is fixed), no error handling. Every shmseq figure divided by this one is the price of
shmseq's features.
"""
from __future__ import annotations

import mmap
import os
import secrets
import struct
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import posix_ipc

from shmseq.engine import torch_available

from .workloads import Workload, fill, image_pool, one_operator_thread

_DONE = struct.Struct("<qq")  # slot, batch number
_SLOT = struct.Struct("<q")


def _views(memory: mmap.mmap, workload: Workload, slot: int,
           stride: int) -> tuple[np.ndarray, np.ndarray]:
    """The slot's images and labels, at fixed offsets: fresh views, as a consumer needs."""
    images = np.ndarray((workload.batch_size, *workload.image_shape), np.uint8, memory,
                        slot * stride)
    labels = np.ndarray(workload.batch_size, np.int64, memory,
                        slot * stride + images.nbytes)
    return images, labels


def _worker(workload: Workload, wid: int, workers: int, memory: mmap.mmap, stride: int,
            free_name: str, done_name: str) -> None:
    one_operator_thread()
    free, done = posix_ipc.MessageQueue(free_name), posix_ipc.MessageQueue(done_name)
    pool = image_pool(workload.side)
    k = wid
    while True:
        slot = _SLOT.unpack(free.receive()[0])[0]
        images, labels = _views(memory, workload, slot, stride)
        fill(pool, workload.indices(k), images, labels, workload.augment)
        done.send(_DONE.pack(slot, k))
        k += workers


@contextmanager
def bare_ring(workload: Workload, slots: int, workers: int, start_method: str) -> Iterator:
    """Batches in the order they are done, numpy views (torch tensors where torch is)."""
    import multiprocessing

    stride = -(-workload.batch_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    segment = posix_ipc.SharedMemory(f"/shmseq-bare-{tag}", posix_ipc.O_CREX,
                                     size=stride * slots)
    memory = mmap.mmap(segment.fd, stride * slots, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    segment.close_fd()
    segment.unlink()
    queues = [posix_ipc.MessageQueue(f"/shmseq-bare-{side}-{tag}", posix_ipc.O_CREX,
                                     max_messages=slots, max_message_size=_DONE.size)
              for side in ("free", "done")]
    free, done = queues
    # the type ignored: the stubs give BaseContext no Process, which every start method's has
    processes = [multiprocessing.get_context(start_method).Process(  # type: ignore[attr-defined]
        target=_worker, args=(workload, wid, workers, memory, stride, free.name, done.name),
        daemon=True) for wid in range(workers)]
    for process in processes:
        process.start()
    for slot in range(slots):
        free.send(_SLOT.pack(slot))
    try:
        yield _batches(workload, memory, stride, free, done)
    finally:
        for process in processes:  # no shutdown protocol either
            process.kill()
            process.join()
        for queue in queues:
            queue.close()
            queue.unlink()
        try:
            memory.close()
        except BufferError:
            pass  # the consumer's last batch still views it


def _batches(workload: Workload, memory: mmap.mmap, stride: int, free: posix_ipc.MessageQueue,
             done: posix_ipc.MessageQueue) -> Iterator[tuple]:
    to_torch = None
    if torch_available():
        import torch
        to_torch = torch.from_numpy
    while True:
        slot, _ = _DONE.unpack(done.receive()[0])
        images, labels = _views(memory, workload, slot, stride)
        if to_torch is not None:
            yield to_torch(images), to_torch(labels)
        else:
            yield images, labels
        free.send(_SLOT.pack(slot))  # no lease: the consumer asked for the next batch
