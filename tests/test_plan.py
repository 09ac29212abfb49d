import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from shmseq.engine.trainer.plan import BatchStream, EpochPlan, SamplerPlan, as_index_array


def plan(n=10, size=4, **options):
    options = {"shuffle": False, "seed": 0, **options}
    return EpochPlan(np.arange(n), size, **options)


def listed(batches):
    return [b.tolist() for b in batches]


def test_index_array_from_int_and_array():
    assert as_index_array(5).tolist() == [0, 1, 2, 3, 4]
    assert as_index_array(np.array([7, 3, 9], np.int32)).dtype == np.int64


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (np.zeros((2, 2), int), ValueError),
                                        (np.array([0.5]), TypeError), ("abc", TypeError),
                                        (10.0, TypeError), (2**70, ValueError)])
def test_index_array_rejects(bad, error):
    with pytest.raises(error, match="dset_size"):
        as_index_array(bad)


def test_last_batch_keep_discard_rollover_as_mxnet():
    assert listed(plan().batches(0)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert listed(plan(last_batch="discard").batches(0)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    rollover = plan(last_batch="rollover")
    assert listed(rollover.batches(0)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert listed(rollover.batches(1)) == [[8, 9, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]
    assert listed(rollover.batches(2)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [rollover.length(e) for e in range(4)] == [2, 3, 2, 3]
    assert [rollover.start(e) for e in range(4)] == [0, 2, 5, 7]


def test_rollover_with_fewer_samples_than_a_batch():
    small = plan(n=3, size=4, last_batch="rollover")
    assert [small.length(e) for e in range(5)] == [0, 1, 1, 1, 0]
    assert listed(small.batches(1)) == [[0, 1, 2, 0]] and listed(small.batches(2)) == [[1, 2, 0, 1]]
    assert listed(small.batches(3)) == [[2, 0, 1, 2]]


def test_shuffle_is_seeded_per_epoch():
    shuffled = plan(100, 10, shuffle=True, seed=3)
    again = plan(100, 10, shuffle=True, seed=3)
    assert np.array_equal(shuffled.order(0), again.order(0))
    assert not np.array_equal(shuffled.order(0), shuffled.order(1))
    assert sorted(shuffled.order(1).tolist()) == list(range(100))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), size=st.integers(1, 9), ranks=st.integers(1, 4),
       policy=st.sampled_from(["keep", "discard", "rollover"]), epoch=st.integers(0, 5))
def test_ranks_share_an_epoch_disjointly_and_equally(n, size, ranks, policy, epoch):
    plans = [plan(n, size, shuffle=True, seed=9, last_batch=policy, rank=r, world_size=ranks)
             for r in range(ranks)]
    orders = [p.order(epoch) for p in plans]
    assert len({len(o) for o in orders}) == 1 and len({p.length(epoch) for p in plans}) == 1
    dealt = np.concatenate(orders)
    if policy == "discard":
        assert len(set(dealt.tolist())) == len(dealt) == n // ranks * ranks
    else:
        assert set(dealt.tolist()) == set(range(n)) and len(dealt) == -(-n // ranks) * ranks


def test_stream_runs_ahead_across_epochs_and_finds_what_it_planned():
    stream = BatchStream(plan(6, 4))
    taken = [stream.next() for _ in range(3)]
    assert [(seq, idx.tolist(), at) for seq, idx, at in taken] == [
        (0, [0, 1, 2, 3], 0), (1, [4, 5], 1), (2, [0, 1, 2, 3], 0)]
    assert stream.state() == {"epoch": 1, "position": 1}
    assert stream.open(1, 0) == 2  # already dispatched: it arrives as seq 2
    assert stream.open(0, 1) == 3  # back to a batch gone by: fresh seqs from there
    assert [(seq, idx.tolist()) for seq, idx, _ in (stream.next(), stream.next())] == [
        (3, [4, 5]), (4, [0, 1, 2, 3])]


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 30), size=st.integers(1, 7), policy=st.sampled_from(["keep", "rollover"]),
       moves=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 8), st.integers(0, 6)),
                      min_size=1, max_size=12))
def test_whatever_the_consumer_opens_arrives_as_the_seqs_it_expects(n, size, policy, moves):
    """The dispatcher runs ahead by any amount; the consumer opens any (epoch, position) and
    reads on: each seq it expects carries the batch the plan has there."""
    p = plan(n, size, shuffle=True, seed=1, last_batch=policy)
    stream = BatchStream(p)
    dispatched = {}
    for epoch, position, ahead in moves:
        for _ in range(ahead):
            seq, indices, _ = stream.next()
            assert seq not in dispatched
            dispatched[seq] = indices.tolist()
        position = min(position, p.length(epoch))
        first = stream.open(epoch, position)
        for offset, expected in enumerate(p.batches(epoch)[position:]):
            while first + offset not in dispatched:
                seq, indices, _ = stream.next()
                dispatched[seq] = indices.tolist()
            assert dispatched[first + offset] == expected.tolist()


def test_a_sampler_is_drawn_when_its_epoch_opens_and_never_ahead():
    draws = []

    class Sampler:
        def __iter__(self):
            draws.append(1)
            return iter([[0, 1], [[2, 3], [4, 5]]])

        def __len__(self):
            return 2

    sampler_plan = SamplerPlan(Sampler())
    stream = BatchStream(sampler_plan)
    assert stream.next() is None and sampler_plan.length(0) == 2 and draws == []
    assert stream.open(0, 0) == 0 and len(draws) == 1
    first, shards = stream.next()[1], stream.next()[1]
    assert first.tolist() == [0, 1] and [s.tolist() for s in shards] == [[2, 3], [4, 5]]
    assert stream.next() is None and len(draws) == 1  # the next epoch waits for the consumer
    assert stream.open(1, 0) == 2 and len(draws) == 2 and stream.next()[0] == 2


def test_a_sampler_is_drawn_as_batches_are_needed_and_forgotten_once_delivered():
    drawn = []

    def endless():
        for k in itertools.count():
            drawn.append(k)
            yield [k]

    sampler_plan = SamplerPlan(endless())
    sampler_plan.open(0)
    assert sampler_plan.batch(0, 2).tolist() == [2] and drawn == [0, 1, 2]
    sampler_plan.release(0, 2)
    assert sampler_plan.batch(0, 2).tolist() == [2] and drawn == [0, 1, 2]
    with pytest.raises(ValueError, match="already delivered"):
        sampler_plan.batch(0, 1)


def test_a_pass_given_to_the_plan_replaces_the_samplers():
    sampler_plan = SamplerPlan([[0, 1], [2]])
    sampler_plan.open(0, iter([[7], [8], [9]]))
    assert [sampler_plan.batch(0, k).tolist() for k in range(3)] == [[7], [8], [9]]
    assert sampler_plan.batch(0, 3) is None and sampler_plan.length(0) == 3


def test_each_pass_is_made_by_passes_when_given():
    made = []

    def passes(epoch):
        made.append(epoch)
        return iter([[epoch]])

    sampler_plan = SamplerPlan([[0, 1]], passes=passes)
    sampler_plan.open(3)
    assert sampler_plan.batch(3, 0).tolist() == [3] and made == [3]
    sampler_plan.open(4, iter([[9]]))  # a pass given to the plan replaces both
    assert sampler_plan.batch(4, 0).tolist() == [9] and made == [3]


def test_a_sampler_without_len_says_so():
    with pytest.raises(TypeError, match="has no len"):
        SamplerPlan(iter([[0]])).length(0)
