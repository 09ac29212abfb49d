"""Ragged leaves (shmseq.engine.common.ragged): variable-size items as one values array plus int64 offsets.

Property tests explore: batches of up to 8 leaves, a leaf alone or nested at any depth in
pairs (tuples), lists of up to 4 and dicts of up to 4 keys; ragged leaves of every numpy
numeric dtype (bool, signed and unsigned ints of 8 to 64 bits, float16/32/64, complex64/128),
0 to 3 trailing dimensions of 0 to 3, 0 to 6 items of 0 to 5 rows each (so empty items, and
empty leaves of no item at all); ragged leaves of 0 to 5 ``bytes`` items of 0 to 9 bytes;
dense leaves of the same dtypes, 0 to 3 dimensions of 0 to 4; with torch output, also ragged
leaves of torch bfloat16 items. Each batch is written into a slot and read back as numpy (a
``Ragged``) and as torch (jagged tensors, ``devices.torch_wrap``): values (dtype, shape,
bytes) and offsets exactly, dense leaves exactly, values views of the slot."""
import importlib.util
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shmseq import Ragged, ShmSequence, UnsupportedBatch
from shmseq.engine.common.layout import read_batch, write_batch
from shmseq.testing import FakeDevice, planned_batches, ring_of

DTYPES = [np.dtype(code) for code in "?bhilBHILefdFD"]
NO_TORCH = importlib.util.find_spec("torch") is None


def items_of(sample: int) -> list:
    """Sample ``sample``'s variable-length rows: ``sample % 5`` rows of 3 int32 values."""
    return np.arange(sample % 5 * 3, dtype=np.int32).reshape(-1, 3) + sample


class RaggedWorker:
    def __getitem__(self, indices):
        return {"rows": Ragged.from_items([items_of(i) for i in indices]),
                "raw": Ragged.from_items([bytes([i % 256]) * (i % 7) for i in indices]),
                "label": indices.astype(np.int64)}


def in_region(array, region) -> bool:
    return np.shares_memory(np.asarray(array), region)


def roundtrip(batch, wrap=None, size=1 << 18):
    region = np.zeros(size, np.uint8)
    write_batch(batch, region)
    return read_batch(region, wrap), region


# -- the type ---------------------------------------------------------------------------------
def test_items_lengths_and_iteration():
    ragged = Ragged(np.arange(10), np.array([0, 3, 3, 10]))
    assert len(ragged) == 3 and ragged.lengths.tolist() == [3, 0, 7]
    assert ragged[0].tolist() == [0, 1, 2] and ragged[1].size == 0 and ragged[-1][0] == 3
    assert all(np.shares_memory(item, ragged.values) for item in (ragged[0], ragged[-1]))
    assert [item.tolist() for item in ragged] == [[0, 1, 2], [], [3, 4, 5, 6, 7, 8, 9]]
    with pytest.raises(IndexError):
        ragged[3]
    assert "3 items of int64" in repr(ragged)


def test_from_items_keeps_the_items_until_values_are_asked_for():
    torch = pytest.importorskip("torch")
    ragged = Ragged.from_items([b"ab", b"", b"cde"])
    assert ragged.offsets.tolist() == [0, 2, 2, 5] and ragged.items is not None
    assert bytes(ragged.values) == b"abcde" and bytes(ragged[2]) == b"cde"
    arrays = [np.ones((2, 3), np.float32), np.zeros((0, 3), np.float32)]
    from_arrays = Ragged.from_items(arrays)
    assert from_arrays[0] is arrays[0] and from_arrays.values.shape == (2, 3)
    assert "2 items of float32, trailing shape (3,), 2 rows" in repr(from_arrays)
    tensors = Ragged.from_items([torch.ones(2, 2), torch.zeros(1, 2)])
    assert isinstance(tensors.values, torch.Tensor) and tensors.values.shape == (3, 2)


@pytest.mark.parametrize("items, message", [
    ([np.zeros(2, np.int32), np.zeros(2, np.int64)], "dtype"),
    ([np.zeros((2, 3)), np.zeros((2, 4))], "trailing shape"),
    ([np.zeros(2), np.float64(1.0)], "scalar"),
])
def test_items_that_do_not_match_are_refused(items, message):
    with pytest.raises(ValueError, match=message):
        Ragged.from_items(items)


@pytest.mark.parametrize("offsets", [[1, 2, 4], [0, 3, 2, 4], [0, 2, 3]])
def test_offsets_that_do_not_fit_the_values_are_refused_naming_the_leaf(offsets):
    with pytest.raises(UnsupportedBatch, match=r"batch\['boxes'\]"):
        write_batch({"boxes": Ragged(np.zeros(4), np.array(offsets))}, np.zeros(4096, np.uint8))


# -- through a slot ---------------------------------------------------------------------------
@st.composite
def ragged_leaves(draw):
    dtype = draw(st.sampled_from(DTYPES))
    trailing = draw(st.lists(st.integers(0, 3), max_size=3))
    lengths = draw(st.lists(st.integers(0, 5), max_size=6))
    return Ragged.from_items([draw(hnp.arrays(dtype, (length, *trailing))) for length in lengths])


def dense_leaves():
    return hnp.arrays(st.sampled_from(DTYPES), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0,
                                                                 max_side=4))


@st.composite
def bfloat16_leaves(draw):
    """Ragged leaves of torch bfloat16 items (a dtype numpy lacks), rounded from drawn floats."""
    import torch
    trailing = draw(st.integers(0, 3))
    lengths = draw(st.lists(st.integers(0, 5), max_size=6))
    return Ragged.from_items([torch.from_numpy(draw(hnp.arrays(np.float32, (length, trailing))))
                              .to(torch.bfloat16) for length in lengths])


def batches(with_torch: bool = False):
    leaves = st.one_of(ragged_leaves(), dense_leaves(),
                       st.lists(st.binary(max_size=9), max_size=5).map(Ragged.from_items),
                       *([bfloat16_leaves()] if with_torch else []))
    return st.recursive(leaves, lambda children: st.one_of(
        st.tuples(children, children), st.lists(children, max_size=4),
        st.dictionaries(st.sampled_from("abcd"), children, max_size=4)), max_leaves=8)


def as_numpy(array) -> np.ndarray:
    """An array, or a CPU tensor as numpy without a copy (bfloat16 as its int16 bits)."""
    if isinstance(array, np.ndarray):
        return array
    import torch
    return (array.view(torch.int16) if array.dtype == torch.bfloat16 else array).numpy()


def parts_of(leaf) -> tuple:
    """A delivered ragged leaf's values and offsets, a ``Ragged``'s or a jagged tensor's."""
    return (leaf.values, leaf.offsets) if isinstance(leaf, Ragged) else \
        (leaf.values(), leaf.offsets())


def assert_same_array(sent: np.ndarray, got: np.ndarray, region) -> None:
    assert got.dtype == sent.dtype and got.shape == sent.shape and got.tobytes() == sent.tobytes()
    assert got.size == 0 or in_region(got, region)


def assert_same(sent, got, region, torch_output: bool) -> None:
    """``got`` is ``sent`` read back from ``region``, exactly, its arrays views of it."""
    if isinstance(sent, Ragged):
        assert isinstance(got, Ragged) is not torch_output  # jagged for every dtype here
        values, offsets = parts_of(got)
        if not isinstance(sent.values, np.ndarray):
            assert values.dtype == sent.values.dtype
        assert_same_array(as_numpy(sent.values), as_numpy(values), region)
        assert as_numpy(offsets).dtype == np.int64
        assert as_numpy(offsets).tolist() == sent.offsets.tolist()
    elif isinstance(sent, dict):
        assert list(got) == list(sent)
        for key in sent:
            assert_same(sent[key], got[key], region, torch_output)
    elif isinstance(sent, (tuple, list)):
        assert type(got) is type(sent) and len(got) == len(sent)
        for part, back in zip(sent, got):
            assert_same(part, back, region, torch_output)
    else:
        assert_same_array(sent, as_numpy(got), region)


@settings(max_examples=80, deadline=None)
@given(batches())
def test_any_nesting_of_ragged_and_dense_leaves_survives_the_slot_as_numpy(batch):
    got, region = roundtrip(batch)
    assert_same(batch, got, region, torch_output=False)


@pytest.mark.skipif(NO_TORCH, reason="needs torch")
@settings(max_examples=60, deadline=None)
@given(batches(with_torch=True))
def test_any_nesting_survives_the_slot_as_torch_jagged_tensors(batch):
    from shmseq.engine.trainer.devices import torch_wrap
    got, region = roundtrip(batch, torch_wrap)
    assert_same(batch, got, region, torch_output=True)


def test_bfloat16_items_come_back_as_a_jagged_tensor_of_their_dtype():
    torch = pytest.importorskip("torch")
    from shmseq.engine.trainer.devices import torch_wrap
    items = [torch.randn(3, 2).to(torch.bfloat16), torch.randn(1, 2).to(torch.bfloat16)]
    got, _ = roundtrip(Ragged.from_items(items), torch_wrap)
    assert got.dtype == torch.bfloat16 and torch.equal(got.values(), torch.cat(items))


def test_a_torch_jagged_tensor_from_a_worker_travels_as_one():
    torch = pytest.importorskip("torch")
    from shmseq.engine.trainer.devices import torch_wrap
    sent = torch.nested.nested_tensor_from_jagged(torch.arange(7.0), torch.tensor([0, 2, 7]))
    got, region = roundtrip(sent, torch_wrap)
    assert got.is_nested and torch.equal(got.values(), sent.values())
    assert in_region(got.values().numpy(), region)


def test_record_items_keep_their_fields():
    record = np.dtype([("x", np.int32), ("score", np.float32)])
    items = [np.array([(1, 0.5), (2, 1.5)], record), np.array([(3, 2.5)], record)]
    got, region = roundtrip({"boxes": Ragged.from_items(items)})
    assert got["boxes"].values.dtype == record and in_region(got["boxes"].values, region)
    assert got["boxes"][1]["score"].tolist() == [2.5] and got["boxes"].offsets.tolist() == [0, 2, 3]


def test_items_of_python_objects_travel_pickled_not_as_pointers():
    items = [np.array([{"id": 1}, "a"], object), np.array([None], object)]
    got, _ = roundtrip((Ragged.from_items(items), Ragged(np.array([[1], "b"], object),
                                                         np.array([0, 0, 2]))))
    assert isinstance(got[0], Ragged) and [item.tolist() for item in got[0]] == [[{"id": 1}, "a"],
                                                                                 [None]]
    assert [item.tolist() for item in got[1]] == [[], [[1], "b"]]
    assert got[0][0][0] is not items[0][0]  # a copy by pickle, not the object's address


def test_strings_torch_cannot_hold_stay_a_ragged_of_numpy_views():
    pytest.importorskip("torch")
    from shmseq.engine.trainer.devices import torch_wrap
    got, region = roundtrip(Ragged(np.array(["ab", "c", "def"]), np.array([0, 1, 3])), torch_wrap)
    assert isinstance(got, Ragged) and got[1].tolist() == ["c", "def"]


# -- end to end -------------------------------------------------------------------------------
def expected_batch(indices) -> tuple[list, list]:
    return [items_of(i) for i in indices], [bytes([i % 256]) * (i % 7) for i in indices]


@pytest.mark.parametrize("thread_type", ["proc", "thread"])
@pytest.mark.parametrize("out_type", ["null", "cpu"])
def test_every_item_arrives_in_order_as_views_of_the_ring(thread_type, out_type):
    if out_type == "cpu":
        pytest.importorskip("torch")
    seq = ShmSequence(RaggedWorker, 50, batch_size=6, num_workers=2, thread_type=thread_type,
                      out_type=out_type, seed=1)
    with seq.start():
        for batch, indices in zip(seq, planned_batches(seq, 0), strict=True):
            rows, raw = expected_batch(indices)
            got_rows = batch["rows"] if out_type == "null" else batch["rows"].unbind()
            got_raw = batch["raw"] if out_type == "null" else batch["raw"].unbind()
            assert [np.asarray(item).tolist() for item in got_rows] == [r.tolist() for r in rows]
            assert [bytes(np.asarray(item)) for item in got_raw] == raw
            values = batch["rows"].values if out_type == "null" else batch["rows"].values().numpy()
            assert ring_of(seq).contains(values)


def test_keeping_every_batch_copies_out_and_stays_correct():
    seq = ShmSequence(RaggedWorker, 60, batch_size=4, num_workers=2, buffer=3, out_type="null",
                      seed=2)
    with seq.start(), pytest.warns(RuntimeWarning, match="copied out"):
        kept = list(seq)
    for batch, indices in zip(kept, planned_batches(seq, 0), strict=True):
        rows, raw = expected_batch(indices)
        assert [item.tolist() for item in batch["rows"]] == [r.tolist() for r in rows]
        assert [bytes(item) for item in batch["raw"]] == raw
    assert seq.stats.copy_out_count > 0


def test_a_late_copying_device_delivers_ragged_batches_intact():
    seq = ShmSequence(RaggedWorker, 60, batch_size=4, num_workers=2, buffer=2, out_type="null",
                      seed=3, device=lambda: FakeDevice(max_delay=0.005))
    with seq.start():
        for batch, indices in zip(seq, planned_batches(seq, 0), strict=True):
            rows, raw = expected_batch(indices)
            assert [item.tolist() for item in batch["rows"]] == [r.tolist() for r in rows]
            assert [bytes(item) for item in batch["raw"]] == raw
            assert batch["label"].tolist() == indices.tolist()


# -- shmseq.torch.DataLoader's collate --------------------------------------------------------
class Detections:
    """Dict samples: an image, 0-4 boxes, encoded bytes and a label."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> dict:
        import torch
        boxes = torch.rand(index % 5, 4, generator=torch.Generator().manual_seed(index))
        return {"image": torch.full((3, 4, 4), index, dtype=torch.uint8), "boxes": boxes,
                "jpg": bytes([index % 256]) * (index % 7), "label": index}


def assert_batches_equal(ours, theirs) -> None:
    import torch
    assert len(ours) == len(theirs)
    for mine, reference in zip(ours, theirs):
        assert list(mine) == list(reference)
        for key, value in reference.items():
            assert mine[key].dtype == value.dtype
            if value.is_nested:
                assert mine[key].is_nested
                assert torch.equal(mine[key].values(), value.values())
                assert torch.equal(mine[key].offsets(), value.offsets())
            else:
                assert torch.equal(mine[key], value)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ragged_collate_gives_torchs_loader_and_ours_the_same_batches(num_workers):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader as TorchDataLoader

    from shmseq.torch import DataLoader, RaggedCollate
    options = dict(batch_size=6, shuffle=True, num_workers=num_workers,
                   collate_fn=RaggedCollate("boxes", "jpg"))
    theirs = list(TorchDataLoader(Detections(), generator=torch.Generator().manual_seed(5),
                                  **options))
    ours = [{key: value.clone() for key, value in batch.items()} for batch in
            DataLoader(Detections(), generator=torch.Generator().manual_seed(5), **options)]
    assert_batches_equal(ours, theirs)
    assert theirs[0]["boxes"].is_nested and theirs[0]["image"].shape == (6, 3, 4, 4)
    assert theirs[0]["jpg"].is_nested and theirs[0]["jpg"].dtype == torch.uint8


def test_ragged_collate_delivers_views_of_the_ring():
    pytest.importorskip("torch")
    from shmseq.torch import DataLoader, RaggedCollate
    batches = iter(DataLoader(Detections(), batch_size=8, num_workers=2,
                              collate_fn=RaggedCollate("boxes")))
    for batch in batches:
        assert ring_of(batches).contains(batch["boxes"].values().numpy())
    del batch, batches  # the iterator, its pipeline and the last batch's slot go at once


def test_ragged_collate_by_position_and_its_errors():
    torch = pytest.importorskip("torch")
    from shmseq.torch import RaggedCollate
    samples = [(torch.ones(n), n) for n in (2, 0, 3)]
    tokens, labels = RaggedCollate(0)(samples)
    assert tokens.offsets().tolist() == [0, 2, 2, 5] and labels.tolist() == [2, 0, 3]
    equal_lengths, _ = RaggedCollate(0)([(torch.ones(2), 0), (torch.zeros(2), 1)])
    assert equal_lengths.is_nested  # the field's type does not depend on the batch
    with pytest.raises(ValueError, match="no field 'boxes'"):
        RaggedCollate("boxes")([{"box": torch.ones(1)}])
    with pytest.raises(ValueError, match="field 0"):
        RaggedCollate(0)([(torch.ones(2, 2), 1), (torch.ones(2, 3), 1)])
    with pytest.raises(ValueError, match="fields to keep ragged"):
        RaggedCollate()
    with pytest.raises(TypeError, match=r"not RaggedCollate\(\['boxes', 'jpg'\]\)"):
        RaggedCollate(["boxes", "jpg"])
    assert pickle.loads(pickle.dumps(RaggedCollate("boxes", 1))).fields == ("boxes", 1)


def test_ragged_collate_keeps_strings_torch_cannot_hold_as_a_ragged_of_numpy():
    pytest.importorskip("torch")
    from shmseq.torch import RaggedCollate
    samples = [{"words": np.array(["ab"] * count, "<U2")} for count in (1, 0, 2)]
    words = RaggedCollate("words")(samples)["words"]
    assert isinstance(words, Ragged)
    assert [item.tolist() for item in words] == [["ab"], [], ["ab", "ab"]]


def test_a_clone_of_a_delivered_jagged_tensor_or_a_copy_of_a_ragged_holds_no_slot():
    torch = pytest.importorskip("torch")
    from shmseq.engine.trainer.devices import torch_wrap
    leaf = Ragged.from_items([np.ones(3), np.zeros(2)])
    delivered, region = roundtrip(leaf, torch_wrap)
    clone = delivered.clone()
    assert not in_region(clone.values().numpy(), region)
    assert not in_region(clone.offsets().numpy(), region)
    numpy_leaf, numpy_region = roundtrip(leaf)
    kept = numpy_leaf.copy()
    assert in_region(numpy_leaf.values, numpy_region)
    assert not in_region(kept.values, numpy_region) and not in_region(kept.offsets, numpy_region)


def test_ragged_batches_arrive_as_jagged_cuda_tensors():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    seq = ShmSequence(RaggedWorker, 40, batch_size=4, num_workers=2, buffer=2, out_type="cuda",
                      seed=4)
    with seq.start():
        for batch, indices in zip(seq, planned_batches(seq, 0), strict=True):
            torch.cuda._sleep(1_000_000)  # the consumer's stream is busy while copies run
            assert batch["rows"].is_cuda and batch["rows"].is_nested
            rows, _ = expected_batch(indices)
            assert [item.cpu().tolist() for item in batch["rows"].unbind()] == \
                [r.tolist() for r in rows]
