"""The running pipeline (engine/trainer/pipeline.py) as a front end drives it: made from a
``PipelineSpec`` and a plan (its workers started and its ring sized by then), then for each
epoch ``open`` and ``take`` (or ``receive`` and ``hand_over``) from the consumer's thread, and
``close`` from any thread, any number of times.

Real worker processes (fork), a real ring and plan; the copying device is the engine's fake
(``shmseq.testing.FakeDevice``).
"""
from __future__ import annotations

import dataclasses
import gc
import pathlib
import re
import threading
import time

import numpy as np
import pytest

from shmseq.engine.common.errors import BatchTimeout, PipelineClosed, ShmSeqError
from shmseq.engine.common.hooks import FrontEndHooks
from shmseq.engine.common.layout import packed_size
from shmseq.engine.common.protocol import Delivery
from shmseq.engine.trainer.pipeline import Inline, Pipeline, PipelineSpec, closing_finalizer
from shmseq.engine.trainer.plan import EpochPlan, as_index_array
from shmseq.engine.trainer.ring import FREE, LEASED
from shmseq.testing import FakeDevice
from workers import Hang, ImageWorker, IndexWorker, TypeErrorAt

SAMPLES, BATCH = 24, 4  # 6 batches an epoch


class WaitsForFile:
    """Builds a batch once ``path`` exists: a batch that comes exactly when the test says."""

    def __init__(self, path):
        self.path = str(path)

    def __getitem__(self, indices):
        import os
        import time
        while not os.path.exists(self.path):
            time.sleep(0.005)
        return indices


def plan(shuffle=True) -> EpochPlan:
    return EpochPlan(as_index_array(SAMPLES), BATCH, shuffle=shuffle, seed=3)


def spec(worker=IndexWorker, **options) -> PipelineSpec:
    options = {"num_workers": 2, "buffer": 4, "start_method": "fork", "out_type": "null",
               "timeout": 30, **options}
    return PipelineSpec(worker, **options)


@pytest.fixture
def running():
    """Makes pipelines, each closed at the end of the test."""
    made = []

    def make(worker=IndexWorker, the_plan=None, **options):
        pipeline = Pipeline(spec(worker, **options), plan() if the_plan is None else the_plan)
        made.append(pipeline)
        return pipeline
    yield make
    for pipeline in made:
        pipeline.close()


def runners_alive(pipeline: Pipeline) -> list:
    assert pipeline.pool is not None
    return [handle for handle in pipeline.pool.handles if handle.runner.is_alive()]


# -- made ---------------------------------------------------------------------------------------------
def test_once_made_every_worker_started_and_the_first_batches_sized_the_ring(running):
    pipeline = running()
    pool = pipeline.pool
    assert pool is not None and pool.started(mapped=False) and pool.size == 2
    ring = pipeline.ring
    assert ring is not None and ring.spec.n_slots == 4
    first = packed_size(pipeline.plan.batch(0, 0))
    assert first <= ring.spec.slot_bytes < 4 * first + 4096  # sized by it, with headroom only
    assert len(runners_alive(pipeline)) == 2


def test_a_ring_given_its_slot_size_is_made_up_front_in_that_size(running):
    pipeline = running(slot_bytes=1 << 20, buffer=3)
    ring = pipeline.ring
    assert ring is not None and (ring.spec.n_slots, ring.spec.slot_bytes) == (3, 1 << 20)
    assert pipeline.pool is not None and pipeline.pool.started(mapped=True)


def test_started_lazily_it_is_made_at_once_and_sized_at_the_first_take(running):
    pipeline = running(hooks=FrontEndHooks(start_lazily=True))
    assert pipeline.ring is None  # nothing was built yet: the ring waits for a first batch
    got = [batch.tolist() for batch in pipeline.batches(0)]
    assert got == [pipeline.plan.batch(0, p).tolist() for p in range(6)]
    assert pipeline.ring is not None


def test_a_first_batch_that_never_comes_fails_the_making_and_names_its_holder():
    """The ring is sized by the first batch: making the pipeline waits ``timeout`` for it, then
    says who has it (or, on a machine so busy that the worker had not even started, that)."""
    with pytest.raises(ShmSeqError) as raised:
        Pipeline(spec(Hang(at=0), num_workers=1, timeout=1.0), plan(shuffle=False))
    started = (r"each started, but none has built its first batch yet, which the ring is sized "
               r"by; the first, batch 0 of epoch 0, is with worker 0 \(pid \d+\): a first batch "
               r"that takes longer needs a longer timeout=")
    assert re.fullmatch(rf"the workers did not start within timeout=1.0 s: ({started}|"
                        r"worker 0 \(pid \d+\))", str(raised.value)), str(raised.value)


# -- running --------------------------------------------------------------------------------------------
def test_an_epochs_batches_come_in_order_as_views_of_the_ring(running):
    pipeline = running()
    got = []
    for position, batch in enumerate(pipeline.batches(0)):
        assert pipeline.ring.contains(batch)  # zero-copy: a view of its slot
        assert batch.tolist() == pipeline.plan.batch(0, position).tolist()
        got.append(batch.tolist())
        del batch
    assert len(got) == 6 and pipeline.stats.batches == 6
    assert sorted(sum(got, [])) == list(range(SAMPLES))  # shuffled, every sample once


def test_a_batch_taken_holds_its_slot_until_its_last_view_dies(running):
    pipeline = running()
    number = pipeline.open(0)
    delivery = pipeline.receive(number, 0, 0)
    slot = delivery.slot
    batch = pipeline.hand_over(number, delivery)
    del delivery
    ring = pipeline.ring
    ring.collect()
    assert ring.state(slot) is LEASED
    view = batch[1:]
    del batch
    ring.collect()
    assert ring.state(slot) is LEASED  # a view of it still reads the slot
    del view
    ring.collect()
    assert ring.state(slot) is FREE


def test_open_numbers_batches_in_dispatch_order_and_going_back_takes_fresh_numbers(running):
    pipeline = running()
    plan_ = pipeline.plan
    assert pipeline.open(0) == 0
    for position in range(6):
        assert pipeline.take(position, 0, position).tolist() == plan_.batch(0, position).tolist()
    ahead = pipeline.open(1)
    assert ahead >= 6
    assert pipeline.take(ahead, 1, 0).tolist() == plan_.batch(1, 0).tolist()
    back = pipeline.open(0, 2)  # a consumer going back (set_epoch, a restored state)
    assert back > ahead
    assert pipeline.take(back, 0, 2).tolist() == plan_.batch(0, 2).tolist()
    assert pipeline.take(back + 1, 0, 3).tolist() == plan_.batch(0, 3).tolist()


def test_receive_then_hand_over_is_a_take_and_receive_any_gives_a_ready_one(running):
    pipeline = running()
    number = pipeline.open(0)
    delivery = pipeline.receive(number, 0, 0)
    assert type(delivery) is Delivery and delivery.slot is not None and delivery.error is None
    assert delivery.nbytes == BATCH * 8 and not delivery.ended
    assert pipeline.hand_over(number, delivery).tolist() == pipeline.plan.batch(0, 0).tolist()
    found, delivery = pipeline.receive_any(number + 1, 0, 1)
    assert number + 1 <= found < number + 6
    batch = pipeline.hand_over(found, delivery)
    assert batch.tolist() == pipeline.plan.batch(0, 1 + found - (number + 1)).tolist()
    assert pipeline.stats.batches == 2


def test_a_copying_devices_batches_are_copies_and_every_slot_comes_free(running):
    pipeline = running(device=FakeDevice)
    got = [(pipeline.ring.contains(batch), batch.tolist()) for batch in pipeline.batches(0)]
    assert got == [(False, pipeline.plan.batch(0, p).tolist()) for p in range(6)]
    pipeline.ring.finish_copies()
    pipeline.ring.collect()
    assert pipeline.ring.count(LEASED) == 0


# -- failures --------------------------------------------------------------------------------------------
def test_a_workers_error_is_raised_at_its_batchs_turn_and_the_other_batches_still_come(running):
    pipeline = running(TypeErrorAt(at=5), the_plan=plan(shuffle=False))
    number = pipeline.open(0)
    assert pipeline.take(number, 0, 0).tolist() == [0, 1, 2, 3]
    with pytest.raises(TypeError, match="sample 5 is bad") as raised:
        pipeline.take(number + 1, 0, 1)
    assert any("batch 1 of epoch 0" in note for note in raised.value.__notes__)
    assert [pipeline.take(number + p, 0, p).tolist()[0] for p in (2, 3)] == [8, 12]


def test_a_batch_that_does_not_come_in_time_is_a_batch_timeout_naming_its_holder(running):
    """Batch 1 never comes. The spec's timeout is cut short once the worker started and built
    batch 0 (a spec is otherwise fixed when the pipeline starts): a start slowed down by a busy
    machine is not what is timed here."""
    pipeline = running(Hang(at=4), the_plan=plan(shuffle=False), num_workers=1,
                       slot_bytes=1 << 16)
    number = pipeline.open(0)
    assert pipeline.take(number, 0, 0).tolist() == [0, 1, 2, 3]
    pipeline.spec = dataclasses.replace(pipeline.spec, timeout=0.3)
    (handle,) = pipeline.pool.handles
    with pytest.raises(BatchTimeout, match=(
            rf"batch 1 of epoch 0 \(sample indices \[4, 5, 6, 7\]\) did not arrive within "
            rf"timeout=0.3 s; it is with worker 0 \(pid {handle.pid}\)")):
        pipeline.take(number + 1, 0, 1)


# -- closing ---------------------------------------------------------------------------------------------
def test_close_ends_the_workers_refuses_what_comes_after_and_may_be_called_again(running):
    pipeline = running()
    number = pipeline.open(0)
    pipeline.take(number, 0, 0)
    handles = pipeline.pool.handles
    pipeline.close()
    assert not any(handle.runner.is_alive() for handle in handles)
    with pytest.raises(PipelineClosed):
        pipeline.take(number + 1, 0, 1)
    with pytest.raises(PipelineClosed):
        pipeline.open(1)
    pipeline.close()


def test_close_from_another_thread_ends_the_consumers_wait(running, tmp_path):
    """The consumer waits for a batch that comes only once the test says; another thread closes
    the pipeline meanwhile: the consumer's wait ends with ``PipelineClosed``, and the close
    completes once the worker has finished the batch in hand."""
    go = tmp_path / "go"
    pipeline = running(WaitsForFile(go), num_workers=1, slot_bytes=1 << 16)
    number = pipeline.open(0)

    def close_once_waiting():
        while not pipeline.waker.waiting:
            time.sleep(0.001)
        pipeline.close()
    closer = threading.Thread(target=close_once_waiting)
    closer.start()
    try:
        with pytest.raises(PipelineClosed, match="finished or restarted while iterating"):
            pipeline.take(number, 0, 0)
    finally:
        pathlib.Path(go).touch()
        closer.join()
    assert runners_alive(pipeline) == []


def test_a_front_end_nobody_references_closes_its_pipeline_without_the_collector(running):
    class FrontEnd:
        pass

    pipeline = running()
    front_end = FrontEnd()
    closing_finalizer(front_end, pipeline)
    gc.disable()
    try:
        del front_end
        assert runners_alive(pipeline) == []
        with pytest.raises(PipelineClosed):
            pipeline.open(0)
    finally:
        gc.enable()


# -- everything in the calling thread ------------------------------------------------------------------
def test_inline_delivers_what_a_pipeline_does_in_the_calling_thread(running):
    worker = ImageWorker(6)
    inline = Inline(spec(worker), plan())
    try:
        threads = threading.active_count()
        expected = list(inline.batches(1))
        assert threading.active_count() == threads  # no worker, no thread of its own
    finally:
        inline.close()
    got = [{key: np.copy(value) if isinstance(value, np.ndarray) else value
            for key, value in batch.items()} for batch in running(worker).batches(1)]
    assert len(got) == len(expected) == 6
    for mine, theirs in zip(got, expected):
        assert mine.keys() == theirs.keys() and mine["names"] == theirs["names"]
        for key in ("image", "label"):
            assert mine[key].dtype == theirs[key].dtype and np.array_equal(mine[key], theirs[key])
