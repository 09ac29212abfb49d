"""Real-GPU tests: skipped where CUDA is not available."""
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from shmseq import ShmSequence  # noqa: E402
from shmseq.testing import planned_batches, ring_of
from workers import ImageWorker  # noqa: E402


def batches(out_type, **options):
    seq = ShmSequence(ImageWorker(64), 256, batch_size=8, num_workers=2, shuffle=True, seed=4,
                      out_type=out_type, timeout=60, **options)
    with seq.start():
        for batch in seq:
            yield batch


def test_cuda_output_equals_the_cpu_path_while_the_default_stream_is_busy():
    busy = torch.randn(4096, 4096, device="cuda")
    cpu = [{k: v.clone() for k, v in b.items() if k != "names"} for b in batches("cpu")]
    for reference, batch in zip(cpu, batches("cuda", num_converters=2)):
        busy = busy @ busy  # keeps the consumer's stream busy while copies run on theirs
        busy /= busy.norm()
        assert batch["image"].is_cuda and batch["image"].dtype == torch.uint8
        assert torch.equal(batch["image"].cpu(), reference["image"])
        assert torch.equal(batch["label"].cpu(), reference["label"])


def test_cpu_output_is_page_locked_in_place():
    for batch in batches("cpu"):
        assert batch["image"].is_pinned()


def test_a_pinned_slot_outlives_a_non_blocking_copy_delayed_behind_a_busy_stream():
    """The usual ``x = x.cuda(non_blocking=True)`` drops the pinned view at once; the copy runs
    later, behind a kernel: the slot must not be rewritten before it has."""
    seq = ShmSequence(ImageWorker(64), 256, batch_size=8, num_workers=2, buffer=2, shuffle=True,
                      seed=4, out_type="cpu", timeout=60)
    copies = []
    with seq.start():
        for batch in seq:
            torch.cuda._sleep(5_000_000)  # the current stream is busy: the copies wait
            copies.append((batch["label"].cuda(non_blocking=True),
                           batch["image"].cuda(non_blocking=True)))
            del batch
    torch.cuda.synchronize()
    for (labels, images), indices in zip(copies, planned_batches(seq, 0), strict=True):
        marker = torch.from_numpy(indices % 251).to(torch.uint8)[:, None, None, None]
        assert labels.cpu().tolist() == indices.tolist() and (images.cpu() == marker).all()


def test_registered_memory_is_released_after_finish():
    seq = ShmSequence(ImageWorker(64), 64, batch_size=8, num_workers=1, out_type="cuda")
    with seq.start():
        address = ring_of(seq).address
        assert next(iter(seq))["image"].is_cuda
    assert int(torch.cuda.cudart().cudaHostUnregister(address)) != 0  # no longer registered
