"""shmseq.vision: image files (JPEG, PNG, ...) decoded, cropped and flipped straight into the
slot's rows."""
import os
import sys
import warnings

import numpy as np
import pytest

simplejpeg = pytest.importorskip("simplejpeg")
Image = pytest.importorskip("PIL.Image")

from shmseq import ShmSequence, SlotAllocator  # noqa: E402
from shmseq.demo.data import make_jpeg_folder  # noqa: E402
from shmseq.testing import ring_of  # noqa: E402
from shmseq.vision import (ImageArrayWorker, ImageDecodeError, ImageFolder,  # noqa: E402
                           ImageFolderWorker, SkippedFilesWarning, normalize)

from bombs import jpeg_claiming, png_claiming  # noqa: E402

SIZE = 24


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_jpeg_folder(tmp_path_factory.mktemp("images") / "set", images=30, classes=3)


def write_jpeg(path, image, quality=95):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(simplejpeg.encode_jpeg(image, quality=quality))


def write_pillow(path, image, mode=None):
    """An image file written by Pillow, in the format its extension names."""
    path.parent.mkdir(parents=True, exist_ok=True)
    picture = Image.fromarray(image)
    (picture.convert(mode) if mode else picture).save(path)


def solid(colour, height=40, width=50):
    return np.full((height, width, 3), colour, np.uint8)


def make(worker, **options):
    options = {"batch_size": 8, "num_workers": 2, "shuffle": True, "seed": 3, "out_type": "null",
               "timeout": 30, **options}
    return ShmSequence(worker, len(worker), **options)


def test_labels_come_from_sorted_class_folders(tmp_path):
    grey = np.full((40, 50, 3), 128, np.uint8)
    for name in ("zebra/b.jpg", "zebra/a.JPG", "apple/x.jpeg", "mango/y.jpg"):
        write_jpeg(tmp_path / name, grey)
    (tmp_path / "apple" / "notes.txt").write_text("not an image")
    with pytest.warns(SkippedFilesWarning):
        folder = ImageFolder.scan(tmp_path)
    assert folder.classes == ("apple", "mango", "zebra")
    assert [p.split("/")[-2:] for p in folder.files] == [
        ["apple", "x.jpeg"], ["mango", "y.jpg"], ["zebra", "a.JPG"], ["zebra", "b.jpg"]]
    assert folder.labels.tolist() == [0, 1, 2, 2]
    assert folder.labels.dtype == np.int64


def test_missing_or_empty_folders_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageFolder.scan(tmp_path / "nowhere")
    (tmp_path / "empty_class").mkdir()
    with pytest.raises(ValueError, match="no image files .*expected root/<class>/<image>"):
        ImageFolder.scan(tmp_path)


def test_batch_is_decoded_into_the_slot(root):
    worker = ImageFolderWorker(root, SIZE, seed=1)
    region = np.zeros(1 << 20, np.uint8)
    indices = np.array([0, 11, 29, 5], np.int64)
    images, labels = worker.fill_batch(indices, SlotAllocator(region))
    assert images.shape == (4, SIZE, SIZE, 3) and images.dtype == np.uint8
    assert labels.dtype == np.int64 and labels.tolist() == worker.folder.labels[indices].tolist()
    assert np.shares_memory(images, region) and np.shares_memory(labels, region)
    assert all(row.std() > 0 for row in images)  # every row was written


def test_crop_and_flip_keep_the_picture(tmp_path):
    """A whole-image crop of a dark-left, bright-right picture: either way round, never mixed."""
    image = np.zeros((64, 64, 3), np.uint8)
    image[:, 32:] = 255
    write_jpeg(tmp_path / "only" / "halves.jpg", image)
    worker = ImageFolderWorker(tmp_path, 16, seed=0, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    images, _ = worker.fill_batch(np.zeros(32, np.int64), SlotAllocator(None))
    left, right = images[:, :, :6].mean(axis=(1, 2, 3)), images[:, :, -6:].mean(axis=(1, 2, 3))
    flipped = left > right
    assert np.all(np.abs(left - right) > 200)
    assert 0 < flipped.sum() < len(flipped)


def test_augmentation_is_reproducible_for_a_seed(root):
    indices = np.arange(8, dtype=np.int64)

    def batch(seed):
        return ImageFolderWorker(root, SIZE, seed=seed).fill_batch(indices, SlotAllocator(None))[0]

    assert np.array_equal(batch(7), batch(7))
    assert not np.array_equal(batch(7), batch(8))


@pytest.mark.parametrize("thread_type", ["proc", "thread"])
def test_pipeline_delivers_views_of_the_ring_with_reproducible_batches(root, thread_type):
    worker = ImageFolderWorker(root, SIZE, seed=5)
    seq = make(worker, thread_type=thread_type)
    with seq.start():
        delivered = []
        for images, labels in seq:
            assert ring_of(seq).contains(images)
            assert ring_of(seq).contains(labels)
            delivered.append((images.copy(), labels.copy()))
    reference = make(worker, thread_type=thread_type)
    with reference.start_test("numpy"):  # the same plan and seed, built in this thread
        expected = list(reference)
    assert len(delivered) == len(expected) == 4
    for (images, labels), (want_images, want_labels) in zip(delivered, expected):
        assert np.array_equal(images, want_images) and np.array_equal(labels, want_labels)


def test_corrupt_jpeg_is_named(tmp_path):
    write_jpeg(tmp_path / "cats" / "good.jpg", np.full((32, 32, 3), 90, np.uint8))
    good = (tmp_path / "cats" / "good.jpg").read_bytes()
    (tmp_path / "cats" / "truncated.jpg").write_bytes(good[:len(good) // 2])
    (tmp_path / "dogs").mkdir()
    (tmp_path / "dogs" / "text.jpg").write_bytes(b"this is no image")
    worker = ImageFolderWorker(tmp_path, 8)
    for index, name in ((1, "truncated.jpg"), (2, "text.jpg")):
        with pytest.raises(ImageDecodeError, match=name):
            worker.load_into(index, np.empty((8, 8, 3), np.uint8), np.random.default_rng(0))
    seq = make(worker, batch_size=1, num_workers=1, shuffle=False)
    with seq.start(), pytest.raises(ImageDecodeError, match="cats/truncated.jpg"):
        list(seq)


def test_a_jpeg_over_the_pixel_limit_is_named_with_its_claimed_size_and_batch(tmp_path):
    write_jpeg(tmp_path / "cats" / "a.jpg", solid((90, 90, 90)))
    (tmp_path / "cats" / "bomb.jpg").write_bytes(jpeg_claiming(24000, 16000))
    worker = ImageFolderWorker(tmp_path, 8)
    with pytest.raises(ImageDecodeError, match=r"cats/bomb.jpg .*24000 x 16000 .*max_pixels"):
        worker.load_into(1, np.empty((8, 8, 3), np.uint8), np.random.default_rng(0))
    seq = make(worker, batch_size=1, num_workers=1, shuffle=False)
    with seq.start(), pytest.raises(ImageDecodeError, match="24000 x 16000") as info:
        list(seq)
    assert any("batch 1 of epoch 0" in note for note in info.value.__notes__)


def test_a_file_over_pillows_own_limit_is_named(tmp_path):
    """Pillow refuses a file over twice its ``Image.MAX_IMAGE_PIXELS`` as it opens it, before
    the worker's own limit is asked."""
    (tmp_path / "cats" / "bomb.png").parent.mkdir()
    (tmp_path / "cats" / "bomb.png").write_bytes(png_claiming(30000, 20000))
    worker = ImageFolderWorker(tmp_path, 8, max_pixels=10 ** 9)
    with pytest.raises(ImageDecodeError, match=r"cats/bomb.png .*600000000 pixels.*MAX_IMAGE_PIXELS"):
        worker.load_into(0, np.empty((8, 8, 3), np.uint8), np.random.default_rng(0))


def test_max_pixels_is_the_limit_for_every_format(tmp_path):
    write_jpeg(tmp_path / "a" / "one.jpg", solid((200, 30, 30)))  # 50 x 40
    write_pillow(tmp_path / "a" / "two.png", solid((30, 200, 30)))
    row = np.empty((8, 8, 3), np.uint8)
    for index, name in enumerate(("one.jpg", "two.png")):
        ImageFolderWorker(tmp_path, 8, max_pixels=50 * 40).load_into(index, row,
                                                                     np.random.default_rng(0))
        with pytest.raises(ImageDecodeError, match=f"{name} .*50 x 40 .*max_pixels=1,999"):
            ImageFolderWorker(tmp_path, 8, max_pixels=1999).load_into(index, row,
                                                                      np.random.default_rng(0))
    with pytest.raises(ValueError, match="max_pixels must be an integer >= 1, got 0"):
        ImageFolderWorker(tmp_path, 8, max_pixels=0)


COLOURS = {"a/one.jpg": (200, 30, 30), "a/two.png": (30, 200, 30), "b/three.png": (30, 30, 200),
           "b/four.jpeg": (200, 200, 30), "b/deeper/five.png": (30, 200, 200),
           "c/grey.png": (90, 90, 90), "c/alpha.png": (180, 60, 120), "c/six.bmp": (60, 120, 180),
           "c/seven.webp": (120, 180, 60), "c/eight.tif": (250, 250, 250)}


@pytest.fixture
def mixed(tmp_path):
    """JPEG, PNG (RGB, grey, RGBA), BMP, WebP and TIFF files in three classes, one nested."""
    for name, colour in COLOURS.items():
        path = tmp_path / name
        if name.endswith((".jpg", ".jpeg")):
            write_jpeg(path, solid(colour))
        else:
            mode = {"c/grey.png": "L", "c/alpha.png": "RGBA"}.get(name)
            write_pillow(path, solid(colour), mode)
    return tmp_path


def test_png_and_jpeg_files_are_all_read_with_their_labels(mixed):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left out, so nothing to warn about
        worker = ImageFolderWorker(mixed, 16, augment=False)
    names = [os.path.relpath(path, mixed) for path in worker.folder.files]
    assert names == ["a/one.jpg", "a/two.png", "b/four.jpeg", "b/three.png", "b/deeper/five.png",
                     "c/alpha.png", "c/eight.tif", "c/grey.png", "c/seven.webp", "c/six.bmp"]
    assert len(worker) == len(COLOURS)
    assert worker.classes == ("a", "b", "c")
    assert worker.class_to_idx == {"a": 0, "b": 1, "c": 2}
    assert worker.labels.tolist() == [worker.class_to_idx[name.split("/")[0]] for name in names]
    images, labels = worker.fill_batch(np.arange(len(worker)), SlotAllocator(None))
    assert labels.tolist() == worker.labels.tolist()
    for name, image in zip(names, images):
        assert np.abs(image.astype(int) - COLOURS[name]).max() <= 4, name  # JPEG is lossy


def test_mixed_folder_through_the_pipeline(mixed):
    worker = ImageFolderWorker(mixed, 16, seed=2)
    seq = make(worker, batch_size=3, shuffle=False)
    with seq.start():
        delivered = [(images.copy(), labels.copy()) for images, labels in seq]
    assert np.concatenate([labels for _, labels in delivered]).tolist() == worker.labels.tolist()
    assert sum(len(images) for images, _ in delivered) == len(COLOURS)


def test_content_decides_the_decoder(tmp_path):
    """A PNG named .jpg and a JPEG named .png are both read; a broken PNG is named."""
    write_pillow(tmp_path / "x" / "png.jpg", solid((10, 200, 10)))
    write_jpeg(tmp_path / "x" / "jpeg.png", solid((200, 10, 10)))
    (tmp_path / "x" / "zbroken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)
    worker = ImageFolderWorker(tmp_path, 8, augment=False)
    row = np.empty((8, 8, 3), np.uint8)
    for index, colour in ((0, (200, 10, 10)), (1, (10, 200, 10))):
        worker.load_into(index, row, np.random.default_rng(0))
        assert np.abs(row.astype(int) - colour).max() <= 4
    with pytest.raises(ImageDecodeError, match="x/zbroken.png"):
        worker.load_into(2, row, np.random.default_rng(0))


def test_files_that_are_not_images_are_named_in_a_warning(tmp_path):
    write_pillow(tmp_path / "cats" / "a.png", solid((1, 2, 3)))
    for name in ("cats/notes.txt", "cats/labels.csv", "dogs/README", "dogs/x.npy", "dogs/y.mp4",
                 "dogs/z.json", "dogs/more/w.xml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("not an image")
    (tmp_path / "cats" / ".DS_Store").write_text("hidden: ignored")
    (tmp_path / "dogs" / ".ipynb_checkpoints").mkdir()
    (tmp_path / "dogs" / ".ipynb_checkpoints" / "b.png").write_text("hidden: ignored")
    with pytest.warns(SkippedFilesWarning, match=r"7 file\(s\) .* not images .*"
                      r"cats/labels.csv, cats/notes.txt, dogs/README, dogs/x.npy, dogs/y.mp4 "
                      r"and 2 more") as caught:
        worker = ImageFolderWorker(tmp_path, 8)
    assert caught[0].filename == __file__  # the warning points at the user's line
    assert len(worker) == 1 and worker.classes == ("cats", "dogs")
    assert [os.path.relpath(path, tmp_path) for path in worker.folder.skipped] == [
        "cats/labels.csv", "cats/notes.txt", "dogs/README", "dogs/x.npy", "dogs/y.mp4",
        "dogs/z.json", "dogs/more/w.xml"]  # torchvision's order: a folder's files, then deeper


def test_evaluation_mode_is_the_centre_crop_and_deterministic(tmp_path):
    """A picture whose pixels encode their own coordinates: the centre crop, exactly."""
    ys, xs = np.mgrid[:64, :96]
    picture = np.stack([ys * 3, xs * 2, np.full_like(ys, 7)], axis=-1).astype(np.uint8)
    write_pillow(tmp_path / "only" / "coords.png", picture)
    indices = np.zeros(6, np.int64)

    def batch(**options):
        worker = ImageFolderWorker(tmp_path, 32, augment=False, **options)
        return worker.fill_batch(indices, SlotAllocator(None))[0]

    half = batch(crop_fraction=0.5, seed=1)
    # the central 32 x 32 square of a 64 x 96 picture: rows 16..47, columns 32..63, unflipped
    assert all(np.array_equal(image, picture[16:48, 32:64]) for image in half)
    assert np.array_equal(half, batch(crop_fraction=0.5, seed=2))
    whole = batch(crop_fraction=1.0)  # the central 64 x 64 square, the pixel at each centre
    assert np.array_equal(whole[0], picture[1:64:2, 17:80:2])
    default = batch()  # 0.875 of the shorter side: 56 pixels, centred at (32, 48)
    centre = default[0][:, :, 1].astype(int) // 2, default[0][:, :, 0].astype(int) // 3
    assert abs(centre[1].mean() - 31.5) < 1 and abs(centre[0].mean() - 47.5) < 1
    with pytest.raises(ValueError, match="crop_fraction"):
        ImageFolderWorker(tmp_path, 32, augment=False, crop_fraction=0)


def test_evaluation_mode_never_flips_a_jpeg(tmp_path):
    image = np.zeros((64, 64, 3), np.uint8)
    image[:, 32:] = 255
    write_jpeg(tmp_path / "only" / "halves.jpg", image)
    worker = ImageFolderWorker(tmp_path, 16, seed=0, augment=False, crop_fraction=1.0)
    images, _ = worker.fill_batch(np.zeros(32, np.int64), SlotAllocator(None))
    assert np.all(images[:, :, :6].mean(axis=(1, 2, 3)) < 30)
    assert np.all(images[:, :, -6:].mean(axis=(1, 2, 3)) > 225)
    assert np.all(images == images[:1])


def test_images_other_than_jpeg_without_pillow_say_what_to_install(tmp_path, monkeypatch):
    write_pillow(tmp_path / "cats" / "a.png", solid((1, 2, 3)))
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ImportError, match=r"Pillow .*a.png.*pip install 'shmseq\[vision\]'"):
        ImageFolderWorker(tmp_path, 8)


def test_array_store_evaluation_mode_is_the_centre_crop(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (3, 10, 12, 3), dtype=np.uint8)
    np.save(tmp_path / "images.npy", images)
    np.save(tmp_path / "labels.npy", np.arange(3))
    worker = ImageArrayWorker(tmp_path, 6, augment=False)
    batch, labels = worker.fill_batch(np.arange(3), SlotAllocator(None))
    assert np.array_equal(batch, images[:, 2:8, 3:9]) and labels.tolist() == [0, 1, 2]


def test_normalize_gives_float_nchw_off_the_slot():
    torch = pytest.importorskip("torch")
    images = np.random.default_rng(0).integers(0, 256, (2, 5, 4, 3), dtype=np.uint8)
    tensor = torch.from_numpy(images)
    inputs = normalize(tensor, device="cpu")
    assert inputs.shape == (2, 3, 5, 4) and inputs.dtype == torch.float32
    assert inputs.data_ptr() != tensor.data_ptr() and np.array_equal(tensor.numpy(), images)
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    expected = (images.transpose(0, 3, 1, 2) / 255 - mean[:, None, None]) / std[:, None, None]
    assert np.allclose(inputs.numpy(), expected, atol=1e-5)
    unit = normalize(images, mean=(0,) * 3, std=(1,) * 3)  # numpy in, [0, 1] out
    assert np.allclose(unit.contiguous().numpy(), images.transpose(0, 3, 1, 2) / 255)
    assert normalize(tensor, dtype=torch.float64).dtype == torch.float64
    with pytest.raises(ValueError, match="uint8 images"):
        normalize(tensor.float())
