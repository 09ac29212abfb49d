"""The consumer's rules, without workers: deliveries taken strictly in order, batches copied
out of the ring only when keeping one more in place would leave the workers no slot, and
tasks packed on one worker only while the consumer is the slower side."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from shmseq.engine.trainer.convert import Converter, Delivery, OrderedOutput
from shmseq.engine.trainer.devices import HostDevice
from shmseq.engine.common.errors import PipelineClosed
from shmseq.engine.common.layout import write_batch
from shmseq.engine.trainer.pool import PACK_BELOW_S, Pace, Reply
from shmseq.engine.trainer.ring import FREE, Ring
from shmseq.engine.trainer.stats import LoaderStats


# -- the ordered output -------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.permutations(range(12)), st.integers(0, 12))
def test_deliveries_come_out_in_seq_order_whatever_order_they_arrive_in(replies, floor):
    output = OrderedOutput()
    output.drop_below(floor)
    taken = []
    for seq in replies:
        output.put(seq, Delivery(seq))
        while (delivery := output.pop(len(taken) + floor)) is not None:
            taken.append(delivery.batch)
    assert taken == list(range(floor, 12)) and output.waiting == 0


def test_deliveries_below_the_floor_are_dropped_and_first_ready_skips_the_gaps():
    output = OrderedOutput()
    for seq in (5, 2, 7):
        output.put(seq, Delivery(seq))
    assert output.waiting == 3
    output.drop_below(3)  # an epoch left early
    assert output.waiting == 2
    output.put(1, Delivery(1))  # stale: never kept
    assert output.pop(1) is None and output.pop_first(3, 5) is None  # 5: the next pass's
    assert output.pop_first(3, math.inf)[0] == 5
    assert output.pop_first(6, math.inf)[0] == 7 and output.pop_first(0, math.inf) is None


def test_a_closed_output_refuses_every_pop_with_its_reason():
    output = OrderedOutput()
    output.put(0, Delivery(0))
    output.close("finished elsewhere")
    output.close("a second reason does not replace the first")
    with pytest.raises(PipelineClosed, match="finished elsewhere"):
        output.pop(0)


# -- the copy-out rule --------------------------------------------------------------------------
@pytest.fixture
def converter():
    ring = Ring.create(3, 1 << 16, wake=lambda: None)
    converter = Converter(HostDevice(to_torch=False), ring, OrderedOutput(), LoaderStats(),
                          lambda seq: f"batch {seq}")
    yield converter
    converter.output.clear()
    ring.close()


def _deliver(converter, seq: int) -> None:
    """Batch ``seq`` written into a slot by a worker, then arrived."""
    ring = converter.ring
    slot = ring.acquire()
    write_batch({"x": np.full(1000, seq, np.int32)}, ring.region(slot))
    ring.written(slot)
    converter.arrive(Reply(seq, slot))


def test_a_batch_stays_a_view_until_keeping_it_would_leave_the_workers_no_slot(converter):
    ring = converter.ring
    kept = []
    with pytest.warns(RuntimeWarning, match="holds 2 earlier batches of a ring of 3 slots"):
        for seq in range(3):
            _deliver(converter, seq)
            kept.append(converter.hand_over(seq, converter.output.pop(seq)))
    assert [ring.contains(batch["x"]) for batch in kept] == [True, True, False]
    assert [int(batch["x"][0]) for batch in kept] == [0, 1, 2]
    assert converter.stats.copy_out_count == 1
    del kept[0]
    _deliver(converter, 3)  # the slot the first batch held is free again
    assert ring.contains(converter.hand_over(3, converter.output.pop(3))["x"])


def test_batches_waiting_for_the_consumer_do_not_count_as_held(converter):
    for seq in range(3):
        _deliver(converter, seq)  # the whole ring waits in the output
    first = converter.hand_over(0, converter.output.pop(0))
    assert converter.ring.contains(first["x"]) and converter.stats.copy_out_count == 0


def test_a_copied_out_batch_frees_its_slot_at_once(converter):
    held = []
    with pytest.warns(RuntimeWarning, match="copied out of the ring"):
        for seq in range(3):
            _deliver(converter, seq)
            held.append(converter.hand_over(seq, converter.output.pop(seq)))
    converter.ring.collect()
    assert [converter.ring.state(slot) is FREE for slot in range(3)].count(True) == 1


# -- the packing rule ---------------------------------------------------------------------------
def test_tasks_are_packed_once_half_the_ring_waits_until_the_consumer_waits_again():
    pace = Pace(n_slots=8)
    pace.follow(waiting=3, waited=False)
    assert not pace.consumer_is_slower
    pace.follow(waiting=4, waited=False)  # half the ring ready and not taken: consumer is slower
    assert pace.consumer_is_slower
    pace.follow(waiting=1, waited=False)  # still ahead of it
    assert pace.consumer_is_slower
    pace.follow(waiting=0, waited=True)  # it had to wait: the workers are slower again
    assert not pace.consumer_is_slower


def test_tasks_are_packed_only_while_batches_are_cheaper_than_a_wake_up():
    pace = Pace(n_slots=8)
    pace.follow(waiting=4, waited=False)
    assert pace.packs(busy_s=100 * PACK_BELOW_S / 2, batches=100)
    assert not pace.packs(busy_s=100 * PACK_BELOW_S * 2, batches=100)  # spread: slow batches
    assert not pace.packs(busy_s=0.0, batches=0)  # nothing built yet
    pace.follow(waiting=0, waited=True)
    assert not pace.packs(busy_s=0.0, batches=100)
