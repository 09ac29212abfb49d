"""The decode stage (shmseq.decode): encoded JPEGs through the ring, decoded in the trainer.

Images are flat colours drawn from their sample id, so whatever crop a batch gets, each row's
colour tells which sample it was: a slot rewritten before the stage had read it shows up as a
row of the wrong colour (a torn batch)."""
import os
import struct
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
simplejpeg = pytest.importorskip("simplejpeg")

from shmseq import ShmSequence, SkippedSamplesWarning  # noqa: E402
from shmseq.decode import (CudaDecoder, DecodeStage, EncodedImageWorker,  # noqa: E402
                           as_stored, decoded_rows, encoded_sample, exif_orientation,
                           failure_reason, nvjpeg_decoder, transform)
from shmseq.engine.common.layout import read_batch, write_batch  # noqa: E402
from shmseq.engine.common.ragged import Ragged  # noqa: E402
from shmseq.shards import ShardSequence, image_folder_samples, write_shards  # noqa: E402
from shmseq.testing import FakeGpuDecoder, planned_batches  # noqa: E402
from shmseq.vision import IMAGENET_MEAN, IMAGENET_STD, ImageDecodeError  # noqa: E402

from bombs import jpeg_claiming, peak_memory  # noqa: E402

SIZE = 24
COUNT = 60


def colour(sample_id: int) -> np.ndarray:
    return np.array([(sample_id * 53) % 200 + 28, (sample_id * 97) % 200 + 28,
                     (sample_id * 31) % 200 + 28], np.float64)


def write_folder(root, count: int = COUNT) -> None:
    """Flat images of 40-90 px a side, their colour a function of their place in the folder's
    sorted order (class folders c0, c1, c2; names sorted within)."""
    rng = np.random.default_rng(1)
    for number in range(count):
        folder = os.path.join(root, f"c{number * 3 // count}")
        os.makedirs(folder, exist_ok=True)
        height, width = rng.integers(40, 90, 2)
        image = np.broadcast_to(colour(number).astype(np.uint8), (height, width, 3))
        with open(os.path.join(folder, f"{number:04d}.jpg"), "wb") as file:
            file.write(simplejpeg.encode_jpeg(np.ascontiguousarray(image), quality=95))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegs")
    write_folder(str(root))
    return str(root)


def pixels(images) -> np.ndarray:
    """Normalized images back to 0-255 levels, as (N, H, W, 3) float64."""
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return ((images.float() * std + mean) * 255).permute(0, 2, 3, 1).double().numpy()


def assert_rows_are(images, ids) -> None:
    means = pixels(images).mean(axis=(1, 2))
    expected = np.stack([colour(int(sample_id)) for sample_id in ids])
    assert np.abs(means - expected).max() < 3, "a row holds another sample's image (torn batch)"


def decoded_epochs(worker, stage, epochs: int = 2, **options):
    options = {"batch_size": 8, "num_workers": 2, "out_type": "cpu", "seed": 3, **options}
    seq = ShmSequence(worker, len(worker), device=stage, **options)
    with seq.start():
        for epoch in range(epochs):
            for (images, labels), ids in zip(seq, planned_batches(seq, epoch), strict=True):
                yield images, labels, ids


def test_the_encoded_worker_reads_bytes_only(folder):
    worker = EncodedImageWorker(folder)
    encoded, labels, ids = worker[np.array([5, 0, 59])]
    assert isinstance(encoded, Ragged) and ids.tolist() == [5, 0, 59]
    assert [bytes(item) for item in encoded] == [open(worker.name_of(i), "rb").read() for i in ids]
    assert labels.tolist() == [0, 0, 2] and labels.dtype == np.int64


def test_every_batch_decoded_in_order_and_intact_through_worker_processes(folder):
    worker = EncodedImageWorker(folder)
    stage = DecodeStage(SIZE, device="cpu", names=worker.name_of, threads=2)
    for images, labels, ids in decoded_epochs(worker, stage):
        assert images.shape == (len(ids), 3, SIZE, SIZE) and images.dtype == torch.float32
        assert labels.tolist() == worker.labels[ids].tolist()
        assert_rows_are(images, ids)


def test_the_cpu_decoders_time_and_the_consumers_wait_for_it_are_counted(folder):
    worker = EncodedImageWorker(folder)
    decoder = DecodeStage(SIZE, device="cpu", threads=2)()
    images, _ = decoder.hand_over(*decoder.convert(worker[np.arange(16)]))
    counts = decoder.pop_counts()
    assert images.shape[0] == 16 and counts["decode_s"] > 0 and counts["consumer_wait_s"] >= 0
    assert decoder.pop_counts() == {"decode_s": 0.0, "consumer_wait_s": 0.0}
    decoder.close()


def test_a_slot_is_not_reused_before_late_reads_by_address_are_done(folder):
    """The CUDA decoder's protocol through a fake GPU: the encoded bytes are read from the slot
    late, by address (no view keeps the slot), on a ring of two slots."""
    worker = EncodedImageWorker(folder)
    stage = DecodeStage(SIZE, device="cpu", threads=2)
    for images, _, ids in decoded_epochs(worker, lambda: FakeGpuDecoder(stage, max_delay=0.01),
                                         epochs=3, buffer=3, batch_size=4):
        assert_rows_are(images, ids)
        time.sleep(0.01)  # replies pile up meanwhile, and are converted together


def test_boxes_depend_on_the_seed_and_the_ids_only(folder):
    stage = DecodeStage(SIZE, device="cpu", seed=5)
    sizes = [(375, 500), (500, 333), (300, 300)]
    ids = np.array([9, 4, 7])
    boxes = stage.boxes(sizes, ids)
    assert np.array_equal(boxes, DecodeStage(SIZE, device="cpu", seed=5).boxes(sizes, ids))
    assert not np.array_equal(boxes, DecodeStage(SIZE, seed=6, device="cpu").boxes(sizes, ids))
    failed_middle = stage.boxes([sizes[0], None, sizes[2]], ids)
    assert np.array_equal(failed_middle[[0, 2]], boxes[[0, 2]])  # a failure moves no other box
    for (height, width), (top, left, crop_h, crop_w, flipped) in zip(sizes, boxes):
        assert 0 <= top and top + crop_h <= height and 0 <= left and left + crop_w <= width
        assert flipped in (0, 1)
    centre = DecodeStage(SIZE, device="cpu", augment=False).boxes([(300, 400)], ids[:1])
    assert centre.tolist() == [[18, 68, 262, 262, 0]]


def test_the_gpu_paths_transform_agrees_with_the_cpu_stage_within_one_level(tmp_path):
    """The CUDA decoder's resize code, run here on CPU tensors decoded by simplejpeg, against
    the CPU stage: they differ by the CPU stage's rounding to uint8, at most one level."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:120, 0:160]
    texture = np.stack([x * 255 // 160, y * 255 // 120, (x * y) % 256], -1) + \
        rng.normal(0, 10, (120, 160, 3))
    data = simplejpeg.encode_jpeg(np.clip(texture, 0, 255).astype(np.uint8), quality=90)
    encoded, ids = Ragged.from_items([data, data, data]), np.array([1, 2, 3])
    region = np.zeros(1 << 20, np.uint8)
    write_batch((encoded, np.zeros(3, np.int64), ids), region)
    stage = DecodeStage(48, device="cpu", seed=1)
    device = stage()
    try:
        images, _ = device.hand_over(*device.convert(read_batch(region)))
    finally:
        device.close()
    decoded = torch.from_numpy(simplejpeg.decode_jpeg(data, colorspace="RGB")).permute(2, 0, 1)
    reference = stage.empty_images(3, "cpu")
    transform([decoded] * 3, stage.boxes([(120, 160)] * 3, ids), reference, 48)
    scale, shift = stage.normalizer("cpu")
    reference.mul_(scale).sub_(shift)
    assert np.abs(pixels(images) - pixels(reference)).max() <= 1.0 + 1e-3


def test_dtype_and_channels_last(folder):
    worker = EncodedImageWorker(folder)
    stage = DecodeStage(SIZE, device="cpu", dtype="bfloat16", channels_last=True)
    images, _, ids = next(decoded_epochs(worker, stage, epochs=1, num_workers=0))
    assert images.dtype == torch.bfloat16
    assert images.is_contiguous(memory_format=torch.channels_last)
    means = pixels(images).mean(axis=(1, 2))
    assert np.abs(means - np.stack([colour(int(i)) for i in ids])).max() < 4


def test_start_test_decodes_in_the_calling_thread(folder):
    worker = EncodedImageWorker(folder)
    seq = ShmSequence(worker, len(worker), batch_size=16, out_type="cpu", seed=3,
                      device=DecodeStage(SIZE, device="cpu"))
    with seq.start_test():
        for (images, _), ids in zip(seq, planned_batches(seq, 0), strict=True):
            assert_rows_are(images, ids)


@pytest.fixture
def damaged(tmp_path):
    root = str(tmp_path / "damaged")
    write_folder(root, 12)
    texture = np.random.default_rng(0).integers(0, 256, (80, 90, 3), np.uint8)
    data = simplejpeg.encode_jpeg(texture, quality=90)
    with open(os.path.join(root, "c1", "0005.jpg"), "wb") as file:
        file.write(data[:len(data) * 2 // 3])  # the header survives, the image does not
    with open(os.path.join(root, "c2", "0010.jpg"), "wb") as file:
        file.write(b"not a jpeg at all")
    return root


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_image_that_does_not_decode_is_named_with_its_batch(damaged, num_workers):
    worker = EncodedImageWorker(damaged)
    seq = ShmSequence(worker, len(worker), batch_size=4, num_workers=num_workers, out_type="cpu",
                      shuffle=False, slot_bytes=1 << 16,
                      device=DecodeStage(SIZE, device="cpu", names=worker.name_of))
    with seq.start(), pytest.raises(ImageDecodeError) as info:
        for _ in seq:
            pass
    assert "0005.jpg" in str(info.value) and "sample 5" in str(info.value)
    assert any("batch 1 of epoch 0" in note for note in info.value.__notes__)


def test_skipped_images_leave_smaller_batches_with_a_warning(damaged):
    worker = EncodedImageWorker(damaged)
    stage = DecodeStage(SIZE, device="cpu", names=worker.name_of, on_error="skip")
    seq = ShmSequence(worker, len(worker), batch_size=4, num_workers=2, out_type="cpu",
                      shuffle=False, slot_bytes=1 << 16, device=stage)
    with seq.start(), pytest.warns(SkippedSamplesWarning) as caught:
        sizes = [len(labels) for _, labels in seq]
    assert sizes == [4, 3, 3] and seq.stats.skipped_samples == 2
    assert ["0005.jpg" in str(w.message) for w in caught] == [True, False]  # batch 1, then 2


BOMB = "24000 x 16000"  # what the bomb's header claims, width x height: 1.15 GB as RGB


@pytest.fixture
def bombed(tmp_path):
    """Twelve images, the sixth a JPEG of 628 bytes whose header claims 24000 x 16000 pixels."""
    root = str(tmp_path / "bombed")
    write_folder(root, 12)
    with open(os.path.join(root, "c1", "0005.jpg"), "wb") as file:
        file.write(jpeg_claiming(24000, 16000))
    return root


def bombed_sequence(root, decoder: str = "cpu", **options) -> ShmSequence:
    """The folder through a CPU stage, the fake GPU decoder (the CUDA decoder's protocol: the
    slot read late by address) or a CUDA stage."""
    worker = EncodedImageWorker(root)
    where = "cuda" if decoder == "cuda" else "cpu"
    stage = DecodeStage(SIZE, device=where, names=worker.name_of, **options)
    device = (lambda: FakeGpuDecoder(stage)) if decoder == "fake gpu" else stage
    return ShmSequence(worker, len(worker), batch_size=4, num_workers=2, out_type=where,
                       shuffle=False, slot_bytes=1 << 16, device=device)


def test_an_image_over_the_pixel_limit_is_named_with_its_claimed_size_and_batch(bombed):
    seq = bombed_sequence(bombed)
    with peak_memory() as grown, seq.start(), pytest.raises(ImageDecodeError) as info:
        for _ in seq:
            pass
    message = str(info.value)
    assert "0005.jpg" in message and "sample 5" in message and BOMB in message, message
    assert "max_pixels=89,478,485" in message, message
    assert any("batch 1 of epoch 0" in note for note in info.value.__notes__)
    assert grown[0] < 200 << 20, f"decoding took {grown[0] >> 20} MiB: the bomb was decoded"


@pytest.mark.parametrize("decoder", ["cpu", "fake gpu"])
def test_with_skip_an_image_over_the_pixel_limit_is_left_out_counted_and_warned(bombed, decoder):
    seq = bombed_sequence(bombed, decoder, on_error="skip")
    with peak_memory() as grown, seq.start(), pytest.warns(SkippedSamplesWarning) as caught:
        sizes = [len(labels) for _, labels in seq]
    assert sizes == [4, 3, 4] and seq.stats.skipped_samples == 1
    assert len(caught) == 1 and BOMB in str(caught[0].message)
    assert "0005.jpg" in str(caught[0].message) and "batch 1 of epoch 0" in str(caught[0].message)
    assert grown[0] < 200 << 20, f"decoding took {grown[0] >> 20} MiB: the bomb was decoded"


def test_the_pixel_limit_is_max_pixels():
    data = simplejpeg.encode_jpeg(np.full((120, 160, 3), 90, np.uint8), quality=90)
    region = np.zeros(1 << 16, np.uint8)
    write_batch((Ragged.from_items([data]), np.zeros(1, np.int64), np.array([7])), region)
    for limit, refused in ((160 * 120, False), (160 * 120 - 1, True)):
        device = DecodeStage(SIZE, device="cpu", max_pixels=limit)()
        try:
            if refused:
                with pytest.raises(ImageDecodeError, match=f"160 x 120 .*max_pixels={limit:,}"):
                    device.hand_over(*device.convert(read_batch(region)))
            else:
                images, _ = device.hand_over(*device.convert(read_batch(region)))
                assert images.shape == (1, 3, SIZE, SIZE)
        finally:
            device.close()


def test_shards_of_encoded_images_decode_in_the_trainer(folder, tmp_path):
    index = write_shards(image_folder_samples(folder), str(tmp_path / "s-%03d.tar"),
                         samples_per_shard=25)
    seq = ShardSequence(index, encoded_sample(), batch_size=8, num_workers=2, out_type="cpu",
                        shuffle=False, device=DecodeStage(SIZE, device="cpu"))
    with seq.start():
        seen = [(images, labels) for images, labels in seq]
    ids = np.arange(COUNT)
    assert np.concatenate([labels.numpy() for _, labels in seen]).tolist() == \
        [number * 3 // COUNT for number in ids]
    assert_rows_are(torch.cat([images for images, _ in seen]), ids)
    named = DecodeStage(SIZE, device="cpu", names=index.name_of).describe(26)
    assert named == f"shard {tmp_path / 's-001.tar'}, sample at byte {index.shards[1].span(1)[0]} " \
        "(sample 26)"


def test_a_worker_of_another_shape_is_told_what_the_stage_takes(folder):
    class Dense:
        def __getitem__(self, indices):
            return np.zeros((len(indices), 4), np.uint8), indices

    seq = ShmSequence(Dense(), 8, batch_size=4, num_workers=0, out_type="cpu",
                      device=DecodeStage(SIZE, device="cpu"))
    with seq.start(), pytest.raises(TypeError, match="EncodedImageWorker"):
        next(iter(seq))


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="dtype"):
        DecodeStage(dtype="int8")
    with pytest.raises(ValueError, match="on_error"):
        DecodeStage(on_error="ignore")
    with pytest.raises(ValueError, match="device"):
        DecodeStage(device="tpu")
    with pytest.raises(ValueError, match="max_pixels must be an integer >= 1, got 0"):
        DecodeStage(max_pixels=0)


def test_a_folder_with_other_formats_is_refused(tmp_path):
    root = tmp_path / "mixed" / "a"
    root.mkdir(parents=True)
    (root / "x.png").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match="ImageFolderWorker"):
        EncodedImageWorker(str(tmp_path / "mixed"))


def test_the_decode_threads_end_with_the_sequence(folder):
    worker = EncodedImageWorker(folder)
    list(decoded_epochs(worker, DecodeStage(SIZE, device="cpu", threads=2), epochs=1))
    assert not [thread for thread in threading.enumerate() if "shmseq-decode" in thread.name]


def with_orientation(data: bytes, orientation: int, order: str = "<") -> bytes:
    """``data`` with an Exif segment after its SOI whose first IFD gives ``orientation``, in
    little-endian (``<``, "II") or big-endian (``>``, "MM") TIFF."""
    entry = struct.pack(order + "HHIHH", 0x0112, 3, 1, orientation, 0)
    tiff = (b"II" if order == "<" else b"MM") + struct.pack(order + "HIH", 0x2A, 8, 1) + entry
    segment = b"Exif\0\0" + tiff + bytes(4)  # no next IFD
    return data[:2] + b"\xff\xe1" + struct.pack(">H", len(segment) + 2) + segment + data[2:]


def textured(height: int, width: int, seed: int = 0) -> bytes:
    """A smooth JPEG (gradients, 4:4:4) whose every turn and flip shows in its pixels."""
    y, x = np.mgrid[0:height, 0:width]
    image = np.stack([x * 255 // width, y * 255 // height, (x + 2 * y + seed) % 256], -1)
    return simplejpeg.encode_jpeg(image.astype(np.uint8), quality=95, colorsubsampling="444")


def test_exif_orientation_is_read_as_torchcodec_reads_it():
    data = textured(24, 40)
    assert exif_orientation(np.frombuffer(data, np.uint8)) == 1
    for orientation in range(1, 9):
        for order in "<>":
            turned = np.frombuffer(with_orientation(data, orientation, order), np.uint8)
            assert exif_orientation(turned) == orientation
    xmp = b"\xff\xe1" + struct.pack(">H", 12) + b"http://ns\0"  # another APP1 first
    assert exif_orientation(np.frombuffer(with_orientation(data, 6)[:2] + xmp
                                          + with_orientation(data, 6)[2:], np.uint8)) == 6
    assert exif_orientation(np.frombuffer(with_orientation(data, 9), np.uint8)) == 1
    cut = with_orientation(data, 6)
    cut = cut[:4] + struct.pack(">H", 8 + 8) + cut[6:]  # the segment ends inside its IFD
    assert exif_orientation(np.frombuffer(cut, np.uint8)) == 1


def turned_as_torchcodec(image, orientation: int):
    """torchcodec's EXIF turn (Exif.h, exif_orientation_transform), written out."""
    transposed = image.transpose(-1, -2)
    return {2: lambda: image.flip(-1), 3: lambda: image.flip((-2, -1)),
            4: lambda: image.flip(-2), 5: lambda: transposed,
            6: lambda: transposed.flip(-1), 7: lambda: transposed.flip((-2, -1)),
            8: lambda: transposed.flip(-2)}.get(orientation, lambda: image)()


def test_as_stored_undoes_torchcodecs_exif_turn():
    image = torch.arange(3 * 4 * 5, dtype=torch.uint8).view(3, 4, 5)
    for orientation in range(1, 9):
        assert torch.equal(as_stored(turned_as_torchcodec(image, orientation), orientation), image)


def in_a_slot(items: list) -> Ragged:
    """``items`` as a decode stage reads them: a ragged leaf of a batch read back from a slot."""
    region = np.zeros(1 << 20, np.uint8)
    write_batch((Ragged.from_items(items), np.zeros(len(items), np.int64),
                 np.arange(len(items))), region)
    return read_batch(region)[0]


class StandIn:
    """A CPU stand-in for torchcodec's batched decode: simplejpeg on each image, a
    RuntimeError (as a C++ check's) if any fails; the calls' sizes are kept."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, items: list, device) -> list:
        self.calls.append(len(items))
        try:
            return [torch.from_numpy(simplejpeg.decode_jpeg(item.numpy(), colorspace="RGB"))
                    .permute(2, 0, 1) for item in items]
        except ValueError as exc:
            raise RuntimeError(f"decode_jpegs_cuda, /src/DecodeJpegCuda.cpp:1, {exc}\nmore")


def test_the_gpu_path_decodes_its_rows_together_then_one_by_one_to_name_a_failure():
    good = [textured(16, 24, seed) for seed in range(3)]
    broken = good[0][:len(good[0]) // 2]
    encoded = in_a_slot([good[0], b"refused by its header", good[1], broken, good[2]])
    failed = [None, "claims 24000 x 16000", None, None, None]
    decode = StandIn()
    decoded = decoded_rows(decode, encoded, failed, "cpu")
    assert decode.calls == [4, 1, 1, 1, 1]  # never the row whose header failed
    assert [image is None for image in decoded] == [False, True, False, True, False]
    assert failed[:2] == [None, "claims 24000 x 16000"] and failed[4] is None
    assert failed[3] and "DecodeJpegCuda.cpp" not in failed[3] and "\n" not in failed[3]
    for image, data in zip([decoded[0], decoded[2], decoded[4]], good):
        assert np.array_equal(image.permute(1, 2, 0).numpy(),
                              simplejpeg.decode_jpeg(data, colorspace="RGB"))
    decode = StandIn()
    assert len(decoded_rows(decode, in_a_slot(good), [None] * 3, "cpu")) == 3
    assert decode.calls == [3]
    assert decoded_rows(decode, in_a_slot(good[:1]), ["bad"], "cpu") == [None]
    assert decode.calls == [3]  # no call for an empty batch


def test_a_decoders_failure_is_its_first_line_without_the_cpp_source_place():
    message = ("decode_rows, /__w/torchcodec/src/torchcodec/_core/DecodeJpeg.cpp:287, Image is "
               "incomplete or truncated.\nException raised from decode_rows")
    assert failure_reason(RuntimeError(message)) == "Image is incomplete or truncated."
    assert failure_reason(RuntimeError("Failed to decode batch: 7")) == "Failed to decode batch: 7"
    assert failure_reason(RuntimeError()) == "RuntimeError"


def torchcodec_or_skip():
    """torchcodec's decode, or a skip where it does not import (not installed, or a build of it
    for another torch: PyPI's CUDA 13 build next to a CPU torch)."""
    try:
        return nvjpeg_decoder()
    except ImportError as exc:
        pytest.skip(str(exc).splitlines()[0])


def test_torchcodecs_decode_as_stored_is_simplejpegs():
    """The GPU path's decode call and orientation undone, on torchcodec's CPU decoder (which
    turns by the EXIF orientation as its CUDA one does)."""
    decode = torchcodec_or_skip()
    data = [with_orientation(textured(16, 24, seed), seed % 8 + 1) for seed in range(8)]
    decoded = decoded_rows(decode, in_a_slot(data), [None] * 8, torch.device("cpu"))
    for image, item in zip(decoded, data):
        stored = as_stored(image, exif_orientation(np.frombuffer(item, np.uint8)))
        assert np.array_equal(stored.permute(1, 2, 0).numpy(),
                              simplejpeg.decode_jpeg(item, colorspace="RGB"))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_gpu_decode_agrees_with_the_cpu_stage(folder):
    torchcodec_or_skip()
    worker = EncodedImageWorker(folder)
    cpu = [(images, ids) for images, _, ids in
           decoded_epochs(worker, DecodeStage(SIZE, device="cpu"), epochs=1)]
    gpu = decoded_epochs(worker, DecodeStage(SIZE, device="cuda", streams=2), epochs=1,
                         out_type="cuda")
    for (reference, ids), (images, labels, gpu_ids) in zip(cpu, gpu, strict=True):
        assert images.is_cuda and labels.is_cuda and np.array_equal(ids, gpu_ids)
        assert np.abs(pixels(images.cpu()) - pixels(reference)).max() <= 4  # two decoders' IDCTs
        assert_rows_are(images.cpu(), ids)


@needs_cuda
def test_gpu_decode_keeps_slots_until_the_decode_has_read_them(folder):
    torchcodec_or_skip()
    worker = EncodedImageWorker(folder)
    stage = DecodeStage(SIZE, device="cuda")
    assert isinstance(stage(), CudaDecoder)
    for images, _, ids in decoded_epochs(worker, stage, epochs=3, buffer=2, batch_size=4,
                                         out_type="cuda"):
        torch.cuda._sleep(2_000_000)  # the consumer's stream is busy: hand-overs wait
        assert_rows_are(images.cpu(), ids)


@needs_cuda
def test_gpu_decode_never_hands_an_image_over_the_pixel_limit_to_nvjpeg(bombed):
    torchcodec_or_skip()
    seq = bombed_sequence(bombed, "cuda", on_error="skip")
    torch.cuda.reset_peak_memory_stats()
    with seq.start(), pytest.warns(SkippedSamplesWarning) as caught:
        sizes = [len(labels) for _, labels in seq]
    assert sizes == [4, 3, 4] and seq.stats.skipped_samples == 1
    assert len(caught) == 1 and BOMB in str(caught[0].message)
    assert torch.cuda.max_memory_allocated() < 200 << 20


def same_size_batch(ids) -> tuple:
    """A batch of 64 x 64 images of ``ids``' colours: one batch's decoded images fit exactly in
    the memory another's leave."""
    images = [simplejpeg.encode_jpeg(np.ascontiguousarray(np.broadcast_to(
        colour(i).astype(np.uint8), (64, 64, 3))), quality=95) for i in ids]
    return Ragged.from_items(images), np.zeros(len(ids), np.int64), np.asarray(ids, np.int64)


@needs_cuda
def test_gpu_decode_never_writes_over_images_a_queued_crop_still_reads(monkeypatch):
    """The decode allocates its output on the current stream and nvJPEG's hardware engine
    writes it without waiting for that stream: on the crops' stream, or on a stream of its own
    without the images marked as the crops', batch 2's decode could be handed batch 1's decoded
    images, freed while the crops that read them are still queued (held back here by a sleep on
    that stream), and overwrite them (pytorch/vision#9606 for torchvision's decoder)."""
    torchcodec_or_skip()
    import shmseq.decode as decode
    queued = decode.transform

    def late_transform(*args):
        torch.cuda._sleep(100_000_000)
        queued(*args)

    monkeypatch.setattr(decode, "transform", late_transform)
    decoder = DecodeStage(SIZE, device="cuda", augment=False)()
    batches = [same_size_batch(range(start, start + 8)) for start in (0, 8)]
    converted = [decoder.convert(batch) for batch in batches]
    for batch, pending in zip(batches, converted):
        images, _ = decoder.hand_over(*pending)
        assert_rows_are(images.cpu(), batch[2])
    decoder.close()


@needs_cuda
def test_gpu_decode_crops_images_as_their_jpegs_store_them_whatever_their_exif(tmp_path):
    """torchcodec turns each image by its EXIF orientation, simplejpeg does not: the GPU path
    undoes the turn, so both paths crop the same pixels (a wrong turn is tens of levels off)."""
    torchcodec_or_skip()
    root = tmp_path / "turned" / "c0"
    root.mkdir(parents=True)
    for orientation in range(1, 9):
        (root / f"{orientation}.jpg").write_bytes(with_orientation(textured(60, 100), orientation))
    worker = EncodedImageWorker(str(tmp_path / "turned"))
    batches = {device: next(decoded_epochs(worker, DecodeStage(SIZE, device=device), epochs=1,
                                           batch_size=8, num_workers=0, out_type=device))
               for device in ("cpu", "cuda")}
    (reference, _, ids), (images, _, gpu_ids) = batches["cpu"], batches["cuda"]
    assert np.array_equal(ids, gpu_ids)
    difference = np.abs(pixels(images.cpu()) - pixels(reference)).mean(axis=(1, 2, 3))
    assert difference.max() < 2, difference
