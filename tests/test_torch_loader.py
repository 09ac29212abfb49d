"""shmseq.torch.DataLoader beyond what torch's loader shows (its agreement with torch's is
tests/test_torch_compat.py): batches come through the ring and are views of it, the extras
(slot_bytes, worker_restarts, stats, close), the lifecycle of workers and rings; and the
MXNet-style loader's own plan, dealt to ranks read when an epoch starts."""
import gc
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DistributedSampler  # noqa: E402
from torch.utils.data import DataLoader as TorchLoader  # noqa: E402

import shmseq  # noqa: E402
import shmseq.engine.trainer.plan  # noqa: E402
import torch_datasets as data  # noqa: E402
from shmseq.torch import DataLoader  # noqa: E402
from leaks import live_children, mapped_rings  # noqa: E402

TESTS = Path(__file__).parent


def labels(loader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


# -- shmseq.torch: the ring behind torch's loader ------------------------------------------------
@pytest.mark.parametrize("slot_bytes", [None, 1 << 16])
def test_columns_are_views_of_the_ring_and_counted_in_stats(slot_bytes):
    loader = DataLoader(data.Fields(40), batch_size=4, num_workers=2, slot_bytes=slot_bytes)
    for batch in loader:
        for key in ("image", "tensor", "label", "weight"):
            assert batch[key].numpy().base is not None, f"{key} was copied out of the slot"
        assert len(mapped_rings()) == 1
        del batch
    assert loader.stats.batches == 10 and loader.stats.bytes > 0
    assert loader.stats.overflow_count == 0


def test_whatever_the_collate_fn_returns_keeps_its_tensors_in_the_ring():
    loader = DataLoader(data.Counting(8), batch_size=4, num_workers=1, collate_fn=data.to_record)
    batch = next(iter(loader))
    rings = mapped_rings()
    assert isinstance(batch, data.Record) and batch.source == "batch-0"
    assert batch.inputs.numpy().base is not None and len(rings) == 1
    del batch


def test_an_iterable_datasets_batches_are_views_of_the_ring():
    streamed = DataLoader(data.PerWorkerStream([5, 2]), batch_size=2, num_workers=2)
    batches = iter(streamed)
    batch = next(batches)
    assert batch.numpy().base is not None and len(mapped_rings()) == 1
    del batch
    assert labels(batches) == [[0, 1], [2, 3], [4]]
    assert streamed.stats.batches == 4 and not live_children()


def test_more_workers_than_cores_are_warned_of_once(monkeypatch):
    """torch's constructor warns that num_workers exceeds the cores; the iterator does not
    say it again from shmseq's code (a copy that a filter on torch's module, or Python's
    once-per-place warnings, would not catch)."""
    monkeypatch.setattr(torch._utils, "cpu_count", lambda: 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = DataLoader(data.Counting(8), batch_size=2, num_workers=2)
        assert len(labels(loader)) == 4
    shown = [w for w in caught if "worker processes in total" in str(w.message)]
    assert [w.filename for w in shown] == [torch.utils.data.dataloader.__file__]


def test_without_workers_the_iterator_is_torchs_own():
    inline = DataLoader(data.Counting(6), batch_size=2)
    assert labels(inline) == [[0, 1], [2, 3], [4, 5]] and inline.stats.batches == 0


def test_a_stream_refuses_worker_restarts_saying_why():
    loader = DataLoader(data.CountingStream(4), num_workers=1, worker_restarts=1)
    with pytest.raises(ValueError, match="worker_restarts=1 needs a map-style dataset: a "
                                         "replacement worker cannot resume the stream"):
        iter(loader)


@pytest.mark.parametrize("arguments, match", [
    ({"slot_bytes": 0}, "slot_bytes must be an integer >= 1 or None, got 0"),
    ({"worker_restarts": -1}, "worker_restarts must be an integer >= 0, got -1"),
])
def test_the_extra_arguments_are_checked(arguments, match):
    with pytest.raises(ValueError, match=match):
        DataLoader(data.Counting(4), **arguments)


def test_a_dead_worker_is_replaced_with_worker_restarts(tmp_path):
    loader = DataLoader(data.KillsOnce(40, at=9, marks=str(tmp_path)), batch_size=4,
                        num_workers=2, worker_restarts=1)
    with pytest.warns(RuntimeWarning, match="a new worker takes its place"):
        got = labels(loader)
    assert got == labels(TorchLoader(data.Counting(40), batch_size=4))
    assert loader.stats.restarts == 1


def test_workers_stop_after_each_epoch_unless_persistent():
    transient = DataLoader(data.Counting(12), batch_size=4, num_workers=2)
    persistent = DataLoader(data.Counting(12), batch_size=4, num_workers=2, persistent_workers=True)
    for _ in range(2):
        assert labels(transient) == labels(persistent)
        assert len(live_children()) == 2, "only the persistent loader's workers are left"
    persistent.close()
    assert not live_children()


def test_a_pass_left_early_releases_its_workers_and_ring_without_the_collector():
    gc.disable()
    try:
        loader = DataLoader(data.Counting(40), batch_size=4, num_workers=2)
        iterator = iter(loader)
        batches = [next(iterator) for _ in range(3)]
        assert live_children() and mapped_rings()
        del iterator  # what leaving a for-loop early does
        assert not live_children() and len(mapped_rings()) == 1, "the batches held keep the ring"
        del batches
    finally:
        gc.enable()
    assert not live_children() and not mapped_rings()


def test_loaders_rebuilt_every_epoch_neither_pile_up_workers_nor_complain(capfd):
    gc.disable()
    try:
        for _ in range(3):
            loader = DataLoader(data.Counting(12), batch_size=4, num_workers=2,
                                persistent_workers=True)
            assert len(labels(loader)) == 3
            assert len(live_children()) <= 2
        del loader
        assert not live_children()
    finally:
        gc.enable()
    assert "Exception ignored" not in capfd.readouterr().err


def test_a_loop_that_keeps_every_batch_is_told_what_to_do():
    with DataLoader(data.Counting(40), batch_size=2, num_workers=1, prefetch_factor=1,
                    persistent_workers=True) as loader:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kept = list(loader)
    assert [batch.tolist() for batch in kept] == [[i, i + 1] for i in range(0, 40, 2)]
    message = " ".join(str(w.message) for w in caught)
    assert "clone()" in message and "raise buffer" in message and "Keeping batches" in message


# -- the MXNet-style loader: its own plan, dealt to ranks ----------------------------------------
class FakeDistributed:
    """torch.distributed as a plan sees it, with ranks the test sets; the broadcast hands every
    rank the seed rank 0 sent first."""

    def __init__(self, world_size: int):
        self.rank, self.world_size, self.sent = 0, world_size, None

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.world_size

    def broadcast_object_list(self, objects: list, src: int) -> None:
        if self.rank == src and self.sent is None:
            self.sent = objects[0]
        objects[0] = self.sent


@pytest.fixture
def distributed(monkeypatch):
    """Call it with a world size: torch.distributed is up from then on."""
    fake = FakeDistributed(1)

    def start(world_size: int) -> FakeDistributed:
        fake.world_size = world_size
        monkeypatch.setattr(shmseq.engine.trainer.plan, "process_group", lambda: fake)
        return fake
    return start


def epoch_on(fake: FakeDistributed, rank: int, loader) -> list[int]:
    fake.rank = rank
    return [i for batch in loader for i in batch.tolist()]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_are_read_when_an_epoch_starts_not_when_the_loader_is_built(distributed, num_workers):
    first = shmseq.DataLoader(data.Counting(40), batch_size=5, shuffle=True, seed=7,
                              num_workers=num_workers)
    second = shmseq.DataLoader(data.Counting(40), batch_size=5, shuffle=True, seed=7,
                               num_workers=num_workers)
    assert len(first) == 8
    fake = distributed(2)  # the process group comes up after the loaders were built
    assert len(first) == 4
    shares = [epoch_on(fake, 0, first), epoch_on(fake, 1, second)]
    first.close()
    second.close()
    assert len(shares[0]) == len(shares[1]) == 20
    assert not set(shares[0]) & set(shares[1]) and set(shares[0]) | set(shares[1]) == set(range(40))


def test_a_world_size_that_changed_is_followed(distributed):
    loader = shmseq.DataLoader(data.Counting(24), batch_size=3, shuffle=True, seed=2)
    fake = distributed(2)
    assert len(epoch_on(fake, 1, loader)) == 12
    fake.world_size = 4
    assert len(loader) == 2 and len(epoch_on(fake, 3, loader)) == 6


def test_a_shuffle_dealt_to_ranks_without_torch_distributed_needs_a_seed():
    loader = shmseq.DataLoader(data.Counting(8), batch_size=2, shuffle=True, rank=0, world_size=2)
    with pytest.raises(ValueError, match="seed must be given"):
        list(loader)


def test_a_bare_iter_of_the_mxnet_style_loader_takes_no_epoch():
    loader = shmseq.DataLoader(data.Counting(12), batch_size=4, shuffle=True, num_workers=1, seed=5)
    reference = shmseq.DataLoader(data.Counting(12), batch_size=4, shuffle=True, seed=5)
    iter(loader)
    assert labels(loader) == labels(reference)
    loader.close()


def test_any_ranks_state_resumes_every_rank():
    saved = shmseq.DataLoader(data.Counting(16), batch_size=2, shuffle=True, seed=4, rank=0,
                              world_size=2)
    next(iter(saved))
    other = shmseq.DataLoader(data.Counting(16), batch_size=2, shuffle=True, seed=4, rank=1,
                              world_size=2)
    other.load_state_dict(saved.state_dict())  # trainers save rank 0's state, load it everywhere
    expected = labels(shmseq.DataLoader(data.Counting(16), batch_size=2, shuffle=True, seed=4,
                                        rank=1, world_size=2))
    assert labels(other) == expected[1:]


def test_set_epoch_reaches_the_sampler_given_to_the_mxnet_style_loader():
    dataset = data.Counting(24)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=3)
    loader = shmseq.DataLoader(dataset, batch_size=4, sampler=sampler)
    loader.set_epoch(2)
    assert sampler.epoch == 2
    reference = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=3)
    reference.set_epoch(2)
    assert [i for batch in labels(loader) for i in batch] == list(reference)



def test_accelerate_prepare_rebuilds_the_loader_as_torchs_and_on_ring_puts_it_back():
    accelerate = pytest.importorskip("accelerate")
    from shmseq.torch import on_ring
    accelerator = accelerate.Accelerator(cpu=True)
    loader = DataLoader(data.Counting(20), batch_size=4, shuffle=True, num_workers=1,
                        slot_bytes=1 << 16)
    prepared = accelerator.prepare(loader)
    torch.manual_seed(0)
    as_prepared = labels(prepared)
    assert loader.stats.batches == 0 and not hasattr(prepared.base_dataloader, "stats")
    on_ring(prepared, like=loader)
    torch.manual_seed(0)
    assert labels(prepared) == as_prepared and prepared.stats.batches == 5
    assert prepared.base_dataloader.slot_bytes == 1 << 16 and on_ring(prepared) is prepared
    skipped = on_ring(accelerator.skip_first_batches(prepared, 2), like=loader)
    assert len(labels(skipped)) == 3 and skipped.stats.batches == 3
    accelerator.free_memory()


@pytest.mark.parametrize("prefetch_factor", [None, 3])
def test_on_ring_keeps_a_tuned_loaders_bounds(prefetch_factor):
    """torch's attributes of an 'auto' loader say num_workers=2 and prefetch_factor=2: rebuilt
    from them alone, the loader would no longer tune its workers (and a memory_budget beside
    an integer num_workers is refused)."""
    accelerate = pytest.importorskip("accelerate")
    from shmseq.torch import on_ring
    accelerator = accelerate.Accelerator(cpu=True)
    budget = None if prefetch_factor else 1 << 24
    loader = DataLoader(data.Counting(20), batch_size=4, num_workers="auto", max_workers=3,
                        cpu_budget=1.5, memory_budget=budget, prefetch_factor=prefetch_factor)
    prepared = on_ring(accelerator.prepare(loader), like=loader)
    rebuilt = prepared.base_dataloader
    assert (rebuilt.max_workers, rebuilt.cpu_budget, rebuilt.memory_budget) == (3, 1.5, budget)
    assert rebuilt.tuned_arguments() == loader.tuned_arguments()
    assert sorted(i for batch in labels(prepared) for i in batch) == list(range(20))
    assert rebuilt.stats.batches == 5
    accelerator.free_memory()


def errors_of_two_passes(loader) -> list[str]:
    """What each of two passes over ``loader`` raised (a pass that ends well says nothing)."""
    messages = []
    for _ in range(2):
        try:
            list(loader)
        except RuntimeError as exc:
            messages.append(str(exc))
    return messages


def test_persistent_workers_are_not_replaced_after_one_died():
    """As torch's: the pass goes on without the dead worker, and every later ``iter()`` says
    why it cannot start another pass and what to do; ``close()`` stops the worker left."""
    loader = DataLoader(data.KillsItself(12, at=5), batch_size=2, num_workers=2,
                        persistent_workers=True)
    messages = errors_of_two_passes(loader)
    assert "is killed by signal: Killed" in messages[0] and "the pass goes on" in messages[0]
    assert "persistent workers are not replaced" in messages[1]
    assert "make a new DataLoader, or pass worker_restarts=1" in messages[1]
    assert len(live_children()) == 1
    loader.close()
    assert not live_children()


def test_a_worker_dying_while_starting_is_not_answered_with_restarts():
    """A replacement would die the same way (worker_restarts replaces no worker of the first
    start that dies while starting): neither the death nor the next pass suggests it."""
    loader = DataLoader(data.Counting(12), batch_size=2, num_workers=1, persistent_workers=True,
                        worker_init_fn=data.exit_init)
    messages = errors_of_two_passes(loader)
    loader.close()
    assert "exited with code 4 while starting" in messages[0]
    assert "persistent workers are not replaced" in messages[1]
    assert not any("worker_restarts" in message for message in messages), messages


@pytest.mark.timeout(60)
def test_a_script_without_the_main_guard_is_told_to_add_it_not_to_restart(tmp_path):
    """Under spawn each worker imports the script, which starts the workers again: the
    WorkerDied says to add the guard, and not to pass worker_restarts, whose replacement would
    import the script again."""
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        from shmseq.torch import DataLoader
        import torch_datasets as data
        loader = DataLoader(data.Counting(16), batch_size=4, num_workers=2,
                            multiprocessing_context="spawn")
        print(sum(len(batch) for batch in loader))
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    script = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    last = script.stderr.strip().splitlines()[-1]
    assert script.returncode == 1 and last.startswith("shmseq.engine.common.errors.WorkerDied")
    assert 'put that code under if __name__ == "__main__":' in last, script.stderr
    assert "worker_restarts" not in last, last
