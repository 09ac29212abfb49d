"""shmseq.torch.DataLoader: torch's DataLoader's arguments, attributes and batches, ranks read
when an epoch starts, and the lifecycle a trainer drives (bare iter, set_epoch, rebuilt
loaders, restored state)."""
import collections
import gc
import inspect
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import (BatchSampler, DistributedSampler, IterableDataset,  # noqa: E402
                              RandomSampler, get_worker_info)
from torch.utils.data import DataLoader as TorchLoader  # noqa: E402

import shmseq  # noqa: E402
import shmseq.plan  # noqa: E402
from shmseq.torch import DataLoader  # noqa: E402
from leaks import live_children  # noqa: E402

Pair = collections.namedtuple("Pair", "left right")


class Samples:
    """Every kind of field torch's default collation knows."""

    def __init__(self, n: int = 22):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return {"image": np.full((2, 3), i, np.uint8), "tensor": torch.tensor([i, i + 0.5]),
                "label": i, "weight": i / 4, "flag": i % 2 == 0, "name": f"sample-{i}",
                "scalar": np.float32(i), "pair": (i, [i, -i]), "named": Pair(i, np.int16(i))}


class Indices:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class WhoBuilds(Indices):
    def __getitem__(self, i: int):
        info = get_worker_info()
        return i, -1 if info is None else info.id, -1 if info is None else info.num_workers


def assert_same(ours, theirs, path="batch"):
    assert type(ours) is type(theirs), f"{path}: {type(ours)} against {type(theirs)}"
    if isinstance(ours, torch.Tensor):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), path
    elif isinstance(ours, dict):
        assert ours.keys() == theirs.keys(), path
        for key in ours:
            assert_same(ours[key], theirs[key], f"{path}[{key!r}]")
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), path
        for k, (mine, other) in enumerate(zip(ours, theirs)):
            assert_same(mine, other, f"{path}[{k}]")
    else:
        assert ours == theirs, path


def labels(loader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


# -- torch's batches, arguments and attributes -------------------------------------------------
@pytest.mark.filterwarnings("ignore:the consumer holds")  # list() keeps every batch
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size, drop_last", [(4, False), (4, True), (None, False)])
def test_batches_are_torchs_batches(num_workers, batch_size, drop_last):
    ours = DataLoader(Samples(), batch_size=batch_size, drop_last=drop_last, num_workers=num_workers)
    theirs = TorchLoader(Samples(), batch_size=batch_size, drop_last=drop_last)
    got, expected = list(ours), list(theirs)
    ours.close()
    assert len(got) == len(expected) == len(theirs)
    for k, (mine, other) in enumerate(zip(got, expected)):
        assert_same(mine, other, f"batch {k}")


def test_stackable_columns_are_views_of_the_slot():
    with DataLoader(Samples(), batch_size=4, num_workers=1) as loader:
        batch = next(iter(loader))
        for key in ("image", "tensor", "label", "weight"):
            assert batch[key].numpy().base is not None, f"{key} was copied out of the slot"
        del batch


def test_every_argument_of_torchs_dataloader_is_taken_with_its_default():
    theirs = inspect.signature(TorchLoader).parameters
    ours = inspect.signature(DataLoader).parameters
    for name, parameter in theirs.items():
        if name == "self":
            continue
        assert name in ours, f"{name} is missing"
        assert ours[name].default == parameter.default, name
        assert ours[name].kind == parameter.kind, name


def test_torchs_keywords_are_honoured():
    loader = DataLoader(Indices(20), batch_size=6, shuffle=False, num_workers=2,
                        collate_fn=lambda samples: torch.tensor(samples) * 10, pin_memory=False,
                        drop_last=True, timeout=0, worker_init_fn=lambda wid: None,
                        multiprocessing_context="fork", generator=torch.Generator(),
                        prefetch_factor=3, persistent_workers=True, pin_memory_device="",
                        in_order=False)
    assert labels(loader) == [[0, 10, 20, 30, 40, 50], [60, 70, 80, 90, 100, 110],
                              [120, 130, 140, 150, 160, 170]]
    assert loader.timeout == 0 and loader.prefetch_factor == 3 and loader.buffer == 2 * 3 + 2
    loader.close()


@pytest.mark.parametrize("arguments, error, match", [
    ({"dataset": type("Stream", (IterableDataset,), {"__iter__": lambda self: iter([])})()},
     TypeError, "IterableDataset .* map-style"),
    ({"pin_memory_device": "mps"}, ValueError, "pin_memory_device .* CUDA devices only"),
    ({"prefetch_factor": 2}, ValueError, "prefetch_factor=2 needs worker processes"),
    ({"persistent_workers": True}, ValueError, "persistent_workers=True needs worker processes"),
    ({"shuffle": True, "sampler": range(4)}, ValueError, "shuffle must not be set with sampler"),
    ({"batch_sampler": [[0, 1]], "batch_size": 2}, ValueError, "batch_sampler decides"),
    ({"batch_size": None, "drop_last": True}, ValueError, "batch_size=None .* drop_last"),
    ({"timeout": -1}, ValueError, "timeout must be >= 0"),
    ({"multiprocessing_context": "telepathy", "num_workers": 1}, ValueError,
     "multiprocessing_context must be one of"),
])
def test_arguments_that_cannot_be_honoured_say_why(arguments, error, match):
    arguments = {"dataset": Indices(8), **arguments}
    with pytest.raises(error, match=match):
        DataLoader(**arguments)


def test_attributes_are_torchs():
    dataset = Indices(10)
    loader = DataLoader(dataset, batch_size=3, shuffle=True, num_workers=0, drop_last=True)
    assert loader.dataset is dataset and loader.batch_size == 3 and loader.drop_last
    assert loader.num_workers == 0 and loader.generator is None and len(loader) == 3
    assert len(loader.sampler) == 10 and loader.batch_sampler.sampler is loader.sampler
    assert sorted(loader.sampler) == list(range(10))
    coming = list(loader.batch_sampler)
    assert labels(loader) == coming, "batch_sampler shows the batches of the epoch to come"
    sampler = RandomSampler(dataset)
    own = DataLoader(dataset, batch_size=4, sampler=sampler)
    assert own.sampler is sampler and isinstance(own.batch_sampler, BatchSampler)
    assert len(own) == len(TorchLoader(dataset, batch_size=4, sampler=sampler))


def test_the_shuffle_follows_torchs_global_seed_and_a_generator():
    def epoch(**options):
        return labels(DataLoader(Indices(30), batch_size=5, shuffle=True, **options))
    torch.manual_seed(0)
    first = epoch()
    torch.manual_seed(0)
    assert epoch() == first
    torch.manual_seed(1)
    assert epoch() != first
    assert epoch(generator=torch.Generator().manual_seed(7)) == \
        epoch(generator=torch.Generator().manual_seed(7))


def test_torchs_get_worker_info_answers_inside_workers():
    with DataLoader(WhoBuilds(16), batch_size=2, num_workers=2) as loader:
        seen = [tuple(column.tolist() for column in batch) for batch in loader]
    workers = {wid for _, wids, _ in seen for wid in wids}
    assert workers == {0, 1} and all(n == [2, 2] for _, _, n in seen)


def test_set_epoch_reaches_a_users_distributed_sampler():
    dataset = Indices(24)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    reference = TorchLoader(dataset, batch_size=4, sampler=DistributedSampler(
        dataset, num_replicas=2, rank=1, shuffle=True, seed=3))
    loader.set_epoch(5)
    reference.sampler.set_epoch(5)
    assert sampler.epoch == 5
    assert labels(loader) == labels(reference)


# -- ranks read when an epoch starts -----------------------------------------------------------
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
        monkeypatch.setattr(shmseq.plan, "_distributed", lambda: fake)
        return fake
    return start


def epoch_on(fake: FakeDistributed, rank: int, loader) -> list[int]:
    fake.rank = rank
    return [i for batch in loader for i in batch.tolist()]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_are_read_when_an_epoch_starts_not_when_the_loader_is_built(distributed, num_workers):
    torch.manual_seed(0)
    first = DataLoader(Indices(40), batch_size=5, shuffle=True, num_workers=num_workers)
    torch.manual_seed(1)  # ranks seeded differently: they agree on rank 0's seed
    second = DataLoader(Indices(40), batch_size=5, shuffle=True, num_workers=num_workers)
    assert len(first) == 8
    fake = distributed(2)  # the process group comes up after the loaders were built
    assert len(first) == 4
    shares = [epoch_on(fake, 0, first), epoch_on(fake, 1, second)]
    first.close()
    second.close()
    assert len(shares[0]) == len(shares[1]) == 20
    assert not set(shares[0]) & set(shares[1]) and set(shares[0]) | set(shares[1]) == set(range(40))


def test_a_world_size_that_changed_is_followed(distributed):
    loader = shmseq.DataLoader(Indices(24), batch_size=3, shuffle=True, seed=2)
    fake = distributed(2)
    assert len(epoch_on(fake, 1, loader)) == 12
    fake.world_size = 4
    assert len(loader) == 2 and len(epoch_on(fake, 3, loader)) == 6


def test_a_shuffle_dealt_to_ranks_without_torch_distributed_needs_a_seed():
    loader = shmseq.DataLoader(Indices(8), batch_size=2, shuffle=True, rank=0, world_size=2)
    with pytest.raises(ValueError, match="seed must be given"):
        list(loader)


def test_a_sampler_that_ignores_the_ranks_is_named(distributed):
    distributed(2)
    loader = DataLoader(Indices(8), batch_size=2, sampler=RandomSampler(Indices(8)))
    with pytest.warns(RuntimeWarning, match="every rank reads the whole dataset"):
        list(loader)


# -- what a trainer does -----------------------------------------------------------------------
@pytest.mark.parametrize("front_end", ["torch", "mxnet"])
def test_a_bare_iter_takes_no_epoch(front_end):
    make = DataLoader if front_end == "torch" else shmseq.DataLoader
    loader = make(Indices(12), batch_size=4, shuffle=True, num_workers=1, seed=5)
    reference = make(Indices(12), batch_size=4, shuffle=True, num_workers=0, seed=5)
    iter(loader)  # what Lightning does to check the loader is iterable
    assert labels(loader) == labels(reference)
    loader.close()


def test_set_epoch_of_the_epoch_restored_keeps_its_position():
    reference = labels(DataLoader(Indices(40), batch_size=4, shuffle=True, seed=9))
    loader = DataLoader(Indices(40), batch_size=4, shuffle=True, seed=9, num_workers=2)
    taken = []
    for batch in loader:
        taken.append(batch.tolist())
        if len(taken) == 3:
            break
    state = loader.state_dict()
    loader.close()
    resumed = DataLoader(Indices(40), batch_size=4, shuffle=True, num_workers=2)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(0)  # as a trainer does before every epoch
    assert taken + labels(resumed) == reference
    resumed.close()


def test_workers_stop_after_each_epoch_unless_persistent():
    transient = DataLoader(Indices(12), batch_size=4, num_workers=2)
    persistent = DataLoader(Indices(12), batch_size=4, num_workers=2, persistent_workers=True)
    for _ in range(2):
        assert labels(transient) == labels(persistent)
        assert len(live_children()) == 2, "only the persistent loader's workers are left"
    persistent.close()


def test_loaders_rebuilt_every_epoch_neither_pile_up_workers_nor_complain(capfd):
    gc.disable()
    try:
        for _ in range(3):
            loader = DataLoader(Indices(12), batch_size=4, num_workers=2, persistent_workers=True)
            assert len(labels(loader)) == 3
            assert len(live_children()) <= 2
        del loader
        assert not live_children()
    finally:
        gc.enable()
    assert "Exception ignored" not in capfd.readouterr().err


def test_a_loop_that_keeps_every_batch_is_told_what_to_do():
    with DataLoader(Indices(40), batch_size=2, num_workers=1, prefetch_factor=1,
                    persistent_workers=True) as loader:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kept = list(loader)
    assert [batch.tolist() for batch in kept] == [[i, i + 1] for i in range(0, 40, 2)]
    message = " ".join(str(w.message) for w in caught)
    assert "clone()" in message and "raise buffer" in message and "Keeping batches" in message


def test_len_is_the_whole_epochs_also_when_resumed_mid_epoch():
    loader = DataLoader(Indices(16), batch_size=4, shuffle=True, seed=0)
    next(iter(loader))
    resumed = DataLoader(Indices(16), batch_size=4, shuffle=True, seed=0)
    resumed.load_state_dict(loader.state_dict())
    assert len(resumed) == len(resumed.batch_sampler) == 4, "trainers count the batches taken"
    assert len(labels(resumed)) == 3


def test_any_ranks_state_resumes_every_rank():
    saved = shmseq.DataLoader(Indices(16), batch_size=2, shuffle=True, seed=4, rank=0, world_size=2)
    next(iter(saved))
    other = shmseq.DataLoader(Indices(16), batch_size=2, shuffle=True, seed=4, rank=1, world_size=2)
    other.load_state_dict(saved.state_dict())  # trainers save rank 0's state, load it everywhere
    expected = labels(shmseq.DataLoader(Indices(16), batch_size=2, shuffle=True, seed=4, rank=1,
                                        world_size=2))
    assert labels(other) == expected[1:]


def test_set_epoch_reaches_the_sampler_given_to_the_mxnet_style_loader():
    dataset = Indices(24)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=3)
    loader = shmseq.DataLoader(dataset, batch_size=4, sampler=sampler)
    loader.set_epoch(2)
    assert sampler.epoch == 2
    reference = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=3)
    reference.set_epoch(2)
    assert [i for batch in labels(loader) for i in batch] == list(reference)


def test_a_sampler_without_automatic_batching_gives_torchs_samples():
    def sampler():
        return RandomSampler(Indices(9), generator=torch.Generator().manual_seed(1))
    ours = list(DataLoader(Indices(9), batch_size=None, sampler=sampler(), num_workers=1))
    assert ours == list(TorchLoader(Indices(9), batch_size=None, sampler=sampler()))
