"""shmseq.vision: JPEG files decoded, cropped and flipped straight into the slot's rows."""
import numpy as np
import pytest

simplejpeg = pytest.importorskip("simplejpeg")

from shmseq import ShmSequence, SlotAllocator  # noqa: E402
from shmseq.demo.data import make_jpeg_folder  # noqa: E402
from shmseq.vision import ImageDecodeError, ImageFolder, ImageFolderWorker  # noqa: E402

SIZE = 24


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_jpeg_folder(tmp_path_factory.mktemp("images") / "set", images=30, classes=3)


def write_jpeg(path, image, quality=95):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(simplejpeg.encode_jpeg(image, quality=quality))


def make(worker, **options):
    options = {"batch_size": 8, "num_workers": 2, "shuffle": True, "seed": 3, "out_type": "null",
               "timeout": 30, **options}
    return ShmSequence(worker, len(worker), **options)


def test_labels_come_from_sorted_class_folders(tmp_path):
    grey = np.full((40, 50, 3), 128, np.uint8)
    for name in ("zebra/b.jpg", "zebra/a.JPG", "apple/x.jpeg", "mango/y.jpg"):
        write_jpeg(tmp_path / name, grey)
    (tmp_path / "apple" / "notes.txt").write_text("not an image")
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
    with pytest.raises(ValueError, match="no .jpg"):
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
            assert seq._runtime.ring.contains(images)
            assert seq._runtime.ring.contains(labels)
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
