import numpy as np
import pytest

from shmseq.plan import BatchStream, EpochPlan, as_index_array


def test_index_array_from_int_and_array():
    assert as_index_array(5).tolist() == [0, 1, 2, 3, 4]
    assert as_index_array(np.array([7, 3, 9], np.int32)).dtype == np.int64


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (np.zeros((2, 2), int), ValueError),
                                        (np.array([0.5]), TypeError), ("abc", ValueError)])
def test_index_array_rejects(bad, error):
    with pytest.raises(error, match="dset_size"):
        as_index_array(bad)


def test_keep_and_discard():
    indices = np.arange(10)
    keep = EpochPlan(indices, 4, shuffle=False, seed=0)
    assert [b.tolist() for b in keep.batches(0)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    discard = EpochPlan(indices, 4, shuffle=False, seed=0, last_batch="discard")
    assert len(discard) == 2 and [b.tolist() for b in discard.batches(0)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_shuffle_is_seeded_per_epoch():
    plan = EpochPlan(np.arange(100), 10, shuffle=True, seed=3)
    again = EpochPlan(np.arange(100), 10, shuffle=True, seed=3)
    assert np.array_equal(plan.order(0), again.order(0))
    assert not np.array_equal(plan.order(0), plan.order(1))
    assert sorted(plan.order(1).tolist()) == list(range(100))


def test_stream_crosses_epochs_and_seeks():
    stream = BatchStream(EpochPlan(np.arange(6), 4, shuffle=False, seed=0))
    taken = [stream.take() for _ in range(3)]
    assert [(seq, idx.tolist()) for seq, idx in taken] == [(0, [0, 1, 2, 3]), (1, [4, 5]),
                                                           (2, [0, 1, 2, 3])]
    stream.seek(5)
    assert stream.take()[0] == 5
    stream.seek(1)  # never backwards
    assert stream.take()[0] == 6
    assert stream.indices_of(3).tolist() == [4, 5]
