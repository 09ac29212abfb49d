import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from shmseq.plan import BatchStream, EpochPlan, SamplerPlan, as_index_array


def plan(n=10, size=4, **options):
    options = {"shuffle": False, "seed": 0, **options}
    return EpochPlan(np.arange(n), size, **options)


def listed(batches):
    return [b.tolist() for b in batches]


def test_index_array_from_int_and_array():
    assert as_index_array(5).tolist() == [0, 1, 2, 3, 4]
    assert as_index_array(np.array([7, 3, 9], np.int32)).dtype == np.int64


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (np.zeros((2, 2), int), ValueError),
                                        (np.array([0.5]), TypeError), ("abc", ValueError)])
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


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), size=st.integers(1, 9), seq=st.integers(0, 200),
       policy=st.sampled_from(["keep", "rollover"]))
def test_locate_inverts_start(n, size, seq, policy):
    p = plan(n, size, last_batch=policy)
    epoch, position = p.locate(seq)
    assert p.start(epoch) + position == seq and 0 <= position < p.length(epoch)


def test_stream_crosses_epochs_and_seeks():
    stream = BatchStream(plan(6, 4))
    taken = [stream.take() for _ in range(3)]
    assert [(seq, idx.tolist()) for seq, idx in taken] == [(0, [0, 1, 2, 3]), (1, [4, 5]),
                                                           (2, [0, 1, 2, 3])]
    stream.seek(5)
    assert stream.take()[0] == 5
    stream.seek(1)  # never backwards
    assert stream.take()[0] == 6
    assert stream.indices_of(3).tolist() == [4, 5]


def test_sampler_plan_draws_each_epoch_once_and_keeps_multi_shard_batches():
    draws = []

    class Sampler:
        def __iter__(self):
            draws.append(1)
            return iter([[0, 1], [[2, 3], [4, 5]]])

    sampler_plan = SamplerPlan(Sampler())
    assert sampler_plan.start(1) == 2 and sampler_plan.length(1) == 2 and len(draws) == 2
    first, shards = sampler_plan.batches(0)
    assert first.tolist() == [0, 1] and [s.tolist() for s in shards] == [[2, 3], [4, 5]]
    assert sampler_plan.locate(3) == (1, 1) and len(draws) == 2
