"""The cursor: a pass read in order or as its batches come, its numbers and its end, as its
docstring states them; over a real pipeline (forked workers, a real ring, a real plan)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from shmseq.engine import Cursor, EpochPlan, Pipeline, PipelineSpec, as_index_array
from workers import IndexWorker

SAMPLES, BATCH = 24, 4  # 6 batches an epoch


class SlowFirst:
    """Batch 0 (the one with sample 0) takes a while: the others are ready before it."""

    def __getitem__(self, indices: np.ndarray) -> np.ndarray:
        if 0 in indices:
            time.sleep(0.5)
        return indices


@pytest.fixture
def pipeline_of():
    made = []

    def make(worker: object = IndexWorker, shuffle: bool = True) -> Pipeline:
        plan = EpochPlan(as_index_array(SAMPLES), BATCH, shuffle=shuffle, seed=3)
        spec = PipelineSpec(worker, 2, 8, start_method="fork", out_type="null", timeout=30)
        pipeline = Pipeline(spec, plan)
        made.append(pipeline)
        return pipeline
    yield make
    for pipeline in made:
        pipeline.close()


def expected(pipeline: Pipeline, epoch: int, positions: range) -> list[list[int]]:
    return [pipeline.plan.batch(epoch, position).tolist() for position in positions]


def test_in_order_a_pass_gives_the_plans_batches_then_ends_and_stays_ended(pipeline_of):
    pipeline = pipeline_of()
    cursor = Cursor(pipeline, 0)
    assert [batch.tolist() for batch in cursor] == expected(pipeline, 0, range(6))
    assert cursor.position == 6
    with pytest.raises(StopIteration):
        next(cursor)


def test_a_pass_opened_at_a_position_starts_there_and_the_next_pass_follows(pipeline_of):
    pipeline = pipeline_of()
    assert [b.tolist() for b in Cursor(pipeline, 0, 4)] == expected(pipeline, 0, range(4, 6))
    assert [b.tolist() for b in Cursor(pipeline, 1)] == expected(pipeline, 1, range(6))


def test_a_pass_left_early_leaves_nothing_behind_for_the_next(pipeline_of):
    pipeline = pipeline_of()
    first = Cursor(pipeline, 0)
    assert next(first).tolist() == expected(pipeline, 0, range(1))[0]
    assert [b.tolist() for b in Cursor(pipeline, 1)] == expected(pipeline, 1, range(6))


def test_as_they_come_every_batch_of_the_pass_once_the_late_one_later(pipeline_of):
    pipeline = pipeline_of(SlowFirst(), shuffle=False)
    cursor = Cursor(pipeline, 0)
    got = []
    while True:
        try:
            number, delivery = cursor.next_delivery(in_order=False)
        except StopIteration:
            break
        got.append(cursor.hand_over(number, delivery).tolist())
    assert sorted(got) == expected(pipeline, 0, range(6))  # the pass's only: not the next's
    assert got.index([0, 1, 2, 3]) > 0  # the slow one, after some that were ready before it
    assert cursor.position == 6  # past those handed over ahead of their turn too


def test_in_order_deliveries_are_numbered_from_the_pass_and_handed_over_as_batches(pipeline_of):
    pipeline = pipeline_of()
    cursor = Cursor(pipeline, 0, 2)
    numbers = []
    for position in range(2, 6):
        number, delivery = cursor.next_delivery()
        numbers.append(number)
        assert cursor.hand_over(number, delivery).tolist() == expected(
            pipeline, 0, range(position, position + 1))[0]
    assert numbers == list(range(numbers[0], numbers[0] + 4))  # one number a batch, in turn
    with pytest.raises(StopIteration):
        cursor.next_delivery()
