import collections
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from shmseq.engine.common.errors import UnsupportedBatch
from shmseq.engine.common.layout import (ALIGN, SlotAllocator, SlotOverflow, encode_batch, read_batch,
                           write_batch)

ROOT = Path(__file__).resolve().parent.parent


def roundtrip(batch, size=1 << 16):
    region = np.zeros(size, np.uint8)
    write_batch(batch, region)
    return read_batch(region), region


def test_nested_structure_dtypes_and_extras_survive():
    batch = {"x": np.arange(12, dtype=np.float16).reshape(3, 4),
             "pair": (np.array([True, False]), [np.zeros((0, 5), np.int32), "file.jpg"]),
             "n": 7, "f": 0.5, "name": "a", "raw": b"\x00", "none": None, "scalar": np.float32(2)}
    out, _ = roundtrip(batch)
    assert out.keys() == batch.keys()
    assert out["x"].dtype == np.float16 and np.array_equal(out["x"], batch["x"])
    assert isinstance(out["pair"], tuple) and isinstance(out["pair"][1], list)
    assert out["pair"][1][0].shape == (0, 5) and out["pair"][1][0].dtype == np.int32
    assert out["pair"][1][1] == "file.jpg" and out["n"] == 7 and out["none"] is None
    assert out["scalar"] == np.float32(2)


def test_views_are_aligned_and_share_the_region():
    out, region = roundtrip((np.ones(3, np.uint8), np.arange(5, dtype=np.int64)))
    base = region.__array_interface__["data"][0]
    for array in out:
        assert np.shares_memory(array, region)
        assert (array.__array_interface__["data"][0] - base) % ALIGN == 0


def test_non_contiguous_and_structured_inputs():
    source = np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2]
    record = np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")])
    out, _ = roundtrip([source, record])
    assert np.array_equal(out[0], source) and out[0].flags.c_contiguous
    assert out[1].dtype == record.dtype and out[1][0]["b"] == 2.0


def test_torch_tensors_travel_as_arrays():
    torch = pytest.importorskip("torch")
    out, _ = roundtrip(torch.arange(6, dtype=torch.int16))
    assert out.dtype == np.int16 and out.tolist() == list(range(6))


def test_overflow_reports_the_bytes_needed():
    with pytest.raises(SlotOverflow) as info:
        write_batch(np.zeros(10_000, np.uint8), np.zeros(4096, np.uint8))
    assert info.value.needed > 10_000
    encoded = encode_batch(np.arange(10_000, dtype=np.uint8))
    assert len(encoded) == info.value.needed
    assert np.array_equal(read_batch(encoded), np.arange(10_000, dtype=np.uint8))


class Holder:
    """An object the skeleton has no node for, holding an array."""

    def __init__(self, array):
        self.array = array


@pytest.mark.parametrize("batch", [None, np.array([object(), 3]), {"a": {1, 2}},
                                   np.ma.masked_array([1, 2, 3], mask=[0, 1, 0]),
                                   collections.OrderedDict(x=np.arange(3))],
                         ids=["None", "object array", "set", "masked array", "dict subclass"])
def test_objects_without_a_node_travel_pickled_with_their_type(batch):
    got = read_batch(encode_batch(batch))
    assert type(got) is type(batch)
    if isinstance(batch, np.ma.MaskedArray):
        assert got.mask.tolist() == batch.mask.tolist() and got.data.tolist() == [1, 2, 3]
    elif isinstance(batch, dict):
        assert list(got) == list(batch) and all(np.array_equal(got[k], batch[k]) for k in batch)
    elif isinstance(batch, np.ndarray):
        assert got[1] == 3 and got.dtype == object
    else:
        assert got == batch


def test_arrays_inside_a_pickled_object_are_views_of_the_slot():
    region = np.zeros(1 << 16, np.uint8)
    write_batch({"holder": Holder(np.arange(5, dtype=np.int32))}, region)
    got = read_batch(region)["holder"].array
    assert got.tolist() == [0, 1, 2, 3, 4] and np.shares_memory(got, region)


@pytest.mark.parametrize("bad, where", [
    ({"a": [np.zeros(2), lambda: 0]}, r"batch\['a'\]\[1\] is a builtins.function"),
    ((np.zeros(2), Holder(lambda: 0)), r"batch\[1\] is a test_layout.Holder"),
])
def test_parts_that_cannot_be_pickled_are_named_by_their_path(bad, where):
    with pytest.raises(UnsupportedBatch, match=where + ".*cannot be"):
        encode_batch(bad)


def test_in_place_arrays_are_not_copied():
    region = np.zeros(1 << 16, np.uint8)
    out = SlotAllocator(region)
    images = out.empty((2, 3), np.uint8)
    labels = out.zeros(2, np.int64)
    images[:] = 9
    labels[:] = [4, 5]
    extra = np.arange(3)  # not allocated in the slot: copied after the in-place arrays
    write_batch((images, labels, extra), region, out)
    got = read_batch(region)
    assert got[0].__array_interface__["data"][0] == images.__array_interface__["data"][0]
    assert got[1].tolist() == [4, 5] and got[2].tolist() == [0, 1, 2]


def test_allocator_spills_to_heap_when_the_slot_is_full():
    region = np.zeros(256, np.uint8)
    out = SlotAllocator(region)
    big = out.empty(1000, np.uint8)
    assert not np.shares_memory(big, region)
    with pytest.raises(SlotOverflow):
        write_batch(big, region, out)


def _batches():
    from hypothesis import strategies as st
    from hypothesis.extra import numpy as hnp
    dtypes = st.sampled_from([np.uint8, np.int16, np.int64, np.float32, np.float64, np.bool_,
                              np.complex64, "U3", "S2", [("a", "i4"), ("b", "f2")]])
    arrays = dtypes.flatmap(lambda dtype: hnp.arrays(
        np.dtype(dtype), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)))
    extras = st.one_of(st.none(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                       st.text(max_size=8), st.binary(max_size=8))
    leaves = st.one_of(arrays, extras)
    return st.recursive(leaves, lambda children: st.one_of(
        st.lists(children, max_size=3), st.tuples(children, children),
        st.dictionaries(st.text(max_size=4), children, max_size=3)),
        max_leaves=8).filter(lambda batch: batch is not None)  # a None batch is refused


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b and type(a) is type(b)


def test_any_batch_survives_the_slot_exactly():
    from hypothesis import given, settings

    @settings(max_examples=200, deadline=None)
    @given(batch=_batches())
    def check(batch):
        encoded = encode_batch(batch)
        assert _same(batch, read_batch(encoded))
        region = np.zeros(len(encoded) + 128, np.uint8)
        write_batch(batch, region)
        assert _same(batch, read_batch(region))
        with pytest.raises(SlotOverflow):
            write_batch(batch, np.zeros(len(encoded) - 1, np.uint8))

    check()


def test_an_array_built_outside_a_slot_is_given_back_to_the_system_when_it_dies():
    """In a worker, whose heap keeps what it frees (worker.loop.keep_large_buffers): the first
    batch, built before there is a ring, would otherwise stay in every worker for good."""
    script = textwrap.dedent("""
        import numpy as np
        from shmseq.engine.common.layout import SlotAllocator
        from shmseq.engine.worker.loop import keep_large_buffers

        def anonymous_kib():
            with open("/proc/self/smaps_rollup") as rollup:
                return next(int(line.split()[1]) for line in rollup if line.startswith("Anonymous:"))

        keep_large_buffers()
        before = anonymous_kib()
        images = SlotAllocator(None).empty((64, 224, 224, 3), np.uint8)
        images.fill(1)
        del images
        print(anonymous_kib() - before)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) < 1024, f"{done.stdout.strip()} KiB kept of a 9,408 KiB batch"
