"""Checkpoints through shmseq.torch.DataLoader, as torchdata's StatefulDataLoader has them: a
state taken between any two batches, loaded into a loader built the same way, gives the batches
the uninterrupted loader gave, with any number of workers; the state is plain JSON."""
from __future__ import annotations

import base64
import itertools
import json
import time

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import Dataset, IterableDataset, RandomSampler, Sampler  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from shmseq.torch import DataLoader, StatefulDataLoader  # noqa: E402

SAMPLES = 40


class Numbers(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> int:
        return index


class SlowFirstSample(Numbers):
    def __getitem__(self, index: int) -> int:
        if index == 0:
            time.sleep(1.0)  # the others are handed over meanwhile, even on a loaded machine
        return index


class Stream(IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, me = (1, 0) if info is None else (info.num_workers, info.id)
        return iter(range(me, SAMPLES, workers))


def _saved(generator_state: torch.Tensor) -> str:
    return base64.b64encode(generator_state.numpy().tobytes()).decode("ascii")


def _loaded(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


class Draws:
    """A worker's share of a stream, drawn with its worker's torch generator; it saves and
    loads where it is, and the generator (torchdata's ``Stateful``)."""

    def __init__(self, samples: list[int]) -> None:
        self.samples, self.drawn = samples, 0

    def __iter__(self) -> "Draws":
        return self

    def __next__(self) -> int:
        if self.drawn == len(self.samples):
            raise StopIteration
        self.drawn += 1
        return self.samples[int(torch.randint(len(self.samples), (1,)))]

    def state_dict(self) -> dict:
        return {"drawn": self.drawn, "generator": _saved(torch.get_rng_state())}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]
        torch.set_rng_state(_loaded(state["generator"]))


class UnevenStreams(IterableDataset):
    """Worker ``k`` streams ``SIZES[k]`` samples (the first none), through a ``Draws``."""
    SIZES = (0, 23, 11)

    def __iter__(self) -> Draws:
        info = torch.utils.data.get_worker_info()
        me = 0 if info is None else info.id
        first = sum(self.SIZES[:me])
        return Draws(list(range(first, first + self.SIZES[me])))


class CountedPasses(IterableDataset):
    """A dataset whose state (the passes it finished) changes what it streams: it carries over
    from pass to pass in a persistent worker."""

    def __init__(self) -> None:
        self.passes = 0

    def __iter__(self):
        yield from (self.passes * 100 + sample for sample in range(6))
        self.passes += 1

    def state_dict(self) -> dict:
        return {"passes": self.passes}

    def load_state_dict(self, state: dict) -> None:
        self.passes = state["passes"]


class NoisyNumbers(Numbers):
    """Each sample drawn with its worker's torch generator, which the dataset's state holds."""

    def __getitem__(self, index: int) -> int:
        return index * 1000 + int(torch.randint(1000, (1,)))

    def state_dict(self) -> dict:
        return {"generator": _saved(torch.get_rng_state())}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(_loaded(state["generator"]))


def listed(batches) -> list[list[int]]:
    return [batch.tolist() for batch in batches]


def interrupted(make, stop_at: int, epochs: int = 1) -> tuple[list, dict, torch.Tensor, list]:
    """Run ``make()``'s loader for ``epochs``, its state (and torch's generator) taken after
    batch ``stop_at`` of the last epoch; what it gave up to that point, and after it."""
    torch.manual_seed(7)
    loader = make()
    before, after, state, rng = [], [], None, None
    for epoch in range(epochs):
        for step, batch in enumerate(loader):
            (after if state is not None else before).append(batch.tolist())
            torch.rand(3)  # the training loop draws too (dropout, augmentation)
            if epoch == epochs - 1 and step == stop_at:
                state, rng = json.loads(json.dumps(loader.state_dict())), torch.get_rng_state()
    if state is None:  # taken after the last batch, before the end was seen
        state, rng = json.loads(json.dumps(loader.state_dict())), torch.get_rng_state()
    return before, state, rng, after


def next_pass_both_ways(make, loop_draws: bool = False) -> tuple[list, list]:
    """A pass of ``make()``'s loader, its state taken then (through JSON), and its next pass;
    and that state loaded into a new loader (after the loop drew on, with ``loop_draws``, its
    generator not restored), the pass it gives."""
    loader = make()
    listed(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    second = listed(loader)
    if loop_draws:
        torch.rand(5)
    again = make()
    again.load_state_dict(state)
    return second, listed(again)


def resumed(make, state: dict, rng: torch.Tensor) -> list[list[int]]:
    torch.manual_seed(12345)  # another run: its generator is the checkpoint's once restored
    loader = make()
    loader.load_state_dict(state)
    torch.set_rng_state(rng)
    batches = iter(loader)
    assert torch.equal(torch.get_rng_state(), rng)  # the pass drawn again: not from the loop's
    return listed(batches)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_at", [0, 3, 9])
def test_a_pass_resumes_where_its_state_was_taken(workers, stop_at):
    def make():
        return DataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=workers)
    before, state, rng, after = interrupted(make, stop_at)
    assert resumed(make, state, rng) == after
    assert sorted(sum(before + after, [])) == list(range(SAMPLES))


def test_a_state_taken_at_the_last_batch_resumes_to_an_empty_rest_then_the_next_pass():
    def make():
        return DataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=2)
    torch.manual_seed(7)
    loader = make()
    first = listed(loader)
    state = loader.state_dict()  # after the pass's end was seen
    rng = torch.get_rng_state()
    second = listed(loader)
    again = make()
    again.load_state_dict(state)
    torch.set_rng_state(rng)
    assert listed(again) == second
    assert first != second


def test_a_resume_goes_on_with_another_number_of_workers():
    before, state, rng, after = interrupted(
        lambda: DataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=2), 4)
    for workers in (0, 3):
        assert resumed(lambda: DataLoader(Numbers(), batch_size=4, shuffle=True,
                                          num_workers=workers), state, rng) == after


def test_a_samplers_own_generator_is_saved_across_passes():
    def make():
        generator = torch.Generator().manual_seed(3)
        return DataLoader(Numbers(), batch_size=5, num_workers=2,
                          sampler=RandomSampler(Numbers(), generator=generator))
    torch.manual_seed(0)
    second, resumed_to = next_pass_both_ways(make)
    assert resumed_to == second  # not the first pass's order again


def test_the_second_epoch_of_persistent_workers_resumes_mid_pass():
    def make():
        return DataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=2,
                          persistent_workers=True)
    before, state, rng, after = interrupted(make, 5, epochs=2)
    assert resumed(make, state, rng) == after


def test_batches_handed_over_as_they_came_are_not_given_again():
    def make():
        return DataLoader(SlowFirstSample(), batch_size=4, num_workers=2, in_order=False)
    before, state, rng, after = interrupted(make, 3)
    assert state["ahead"]  # the slow first batch was not handed over yet
    got = resumed(make, state, rng)
    assert sorted(sum(before + got, [])) == list(range(SAMPLES))


def test_an_iterable_datasets_stream_is_fast_forwarded():
    def make():
        return DataLoader(Stream(), batch_size=3, num_workers=2)
    before, state, rng, after = interrupted(make, 4)
    assert resumed(make, state, rng) == after


def test_torchdatas_name_and_arguments_are_taken():
    loader = StatefulDataLoader(Numbers(), batch_size=4, num_workers=0, snapshot_every_n_steps=10)
    assert loader.state_dict()["num_yielded"] == 0
    loader.load_state_dict({})  # torchdata's "nothing to load"
    assert len(listed(loader)) == 10
    with pytest.raises(ValueError, match="snapshot_every_n_steps"):
        StatefulDataLoader(Numbers(), snapshot_every_n_steps=-1)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loop_left_with_break_is_still_where_the_state_says(workers):
    """The loop drops its iterator at ``break``: the loader still knows where that pass stood."""
    def make():
        return DataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=workers)
    torch.manual_seed(1)
    loader = make()
    got = []
    for step, batch in enumerate(loader):
        got.append(batch.tolist())
        if step == 4:
            break
    state = loader.state_dict()
    assert state["num_yielded"] == 5
    torch.manual_seed(1)
    whole = listed(make())
    resumed = make()
    resumed.load_state_dict(state)
    assert got + listed(resumed) == whole


def test_a_state_another_loader_made_is_refused_saying_so():
    loader = DataLoader(Numbers(), batch_size=4)
    with pytest.raises(ValueError, match="torchdata StatefulDataLoader's state does not load"):
        loader.load_state_dict({"_snapshot": {}, "_steps_since_snapshot": 0})


@pytest.mark.parametrize("workers, every", [(0, 1), (3, 1), (3, 4), (3, 0)])
@pytest.mark.parametrize("stop_at", [0, 4, 9])
def test_a_streams_own_state_is_loaded_in_its_worker_and_nothing_handed_is_built_again(
        workers, every, stop_at):
    """Each worker's stream saves its own state (every ``snapshot_every_n_steps`` batches; 0:
    never, fast-forwarded from its start); resumed, the workers load theirs, fast-forward
    the batches handed over since without building them, and deal on from the worker that
    was next: worker 0's stream is empty, worker 2's ends before worker 1's."""
    def make():
        return StatefulDataLoader(UnevenStreams(), batch_size=2, num_workers=workers,
                                  snapshot_every_n_steps=every)
    before, state, rng, after = interrupted(make, stop_at)
    loader = make()
    loader.load_state_dict(state)
    torch.set_rng_state(rng)
    assert listed(loader) == after
    if workers:
        assert loader.stats.batches == len(after)  # none of those handed over before


def test_a_streams_state_is_where_torchdata_keeps_its_workers_snapshots():
    loader = StatefulDataLoader(UnevenStreams(), batch_size=2, num_workers=3)
    batches = iter(loader)
    for _ in range(4):
        next(batches)
    snapshots = json.loads(json.dumps(loader.state_dict()))["_snapshot"]["_worker_snapshots"]
    assert sorted(snapshots) == ["worker_0", "worker_1", "worker_2"]
    assert snapshots["worker_1"]["fetcher_state"]["dataset_iter_state"]["drawn"] == 4
    assert snapshots["worker_0"]["fetcher_state"]["fetcher_ended"]


@pytest.mark.parametrize("stop_at", [2, 6])
def test_a_map_style_datasets_state_is_loaded_in_the_worker_that_saved_it(stop_at):
    def make(workers=2):
        return DataLoader(NoisyNumbers(), batch_size=4, num_workers=workers)
    before, state, rng, after = interrupted(make, stop_at)
    assert resumed(make, state, rng) == after
    with pytest.raises(ValueError, match="num_workers=2, this loader has num_workers=3"):
        make(3).load_state_dict(state)


def test_a_persistent_workers_dataset_state_carries_over_to_the_next_pass():
    def make():
        return DataLoader(CountedPasses(), batch_size=3, num_workers=1, persistent_workers=True)
    loader = make()
    assert listed(loader) == [[0, 1, 2], [3, 4, 5]]
    state = loader.state_dict()  # between passes: the dataset has finished one
    again = make()
    again.load_state_dict(state)
    assert listed(again) == listed(loader) == [[100, 101, 102], [103, 104, 105]]


class Count(Dataset):
    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        return index


def on_rank(world: int, rank: int, workers: int = 0) -> DataLoader:
    """Rank ``rank`` of ``world``'s loader over 42 samples, epoch 1 of a DistributedSampler."""
    sampler = DistributedSampler(Count(42), num_replicas=world, rank=rank, shuffle=True, seed=5)
    sampler.set_epoch(1)
    return DataLoader(Count(42), batch_size=4, sampler=sampler, num_workers=workers)


def read_on_ranks(world: int, states: list[dict] | None, steps: int | None) -> tuple[list, list]:
    """Each rank's loader, resumed from the saved states (any rank's: they agree on where the
    ranks stand), read for ``steps`` batches (None: to the end); what they read, and their
    states then."""
    read, saved = [], []
    for rank in range(world):
        loader = on_rank(world, rank, workers=2 if rank == 0 else 0)
        if states is not None:
            loader.load_state_dict(states[rank % len(states)])
        batches = listed(itertools.islice(loader, steps))
        read.append(sum(batches, []))
        saved.append(json.loads(json.dumps(loader.state_dict())))
    return read, saved


@pytest.mark.parametrize("new_world", [1, 3])
def test_a_distributed_pass_resumes_on_another_world_size_reading_the_rest_once(new_world):
    """Two ranks read 3 batches each of epoch 1 (24 of 42 samples); resumed on ``new_world``
    ranks, they read the other 18, each once, in equal steps, and then a later checkpoint of
    that pass resumes on two ranks again; the next epoch is the sampler's own."""
    first, states = read_on_ranks(2, None, 3)
    assert {state["distributed"]["consumed"] for state in states} == {24}
    second, states = read_on_ranks(new_world, states, 1)
    third, _ = read_on_ranks(2, states, None)
    read = sum(first + second + third, [])
    assert sorted(read) == list(range(42))
    assert len({len(share) for share in third}) == 1  # as many steps on every rank
    loader = on_rank(new_world, 0)
    loader.load_state_dict(states[0])
    listed(loader)
    loader.sampler.set_epoch(2)
    fresh = on_rank(new_world, 0)
    fresh.sampler.set_epoch(2)
    assert listed(loader) == listed(fresh)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_loaded_between_passes_leaves_the_next_passes_drawn_as_usual(workers):
    """Only a resume mid-pass puts torch's generator back after the iterator's draws: between
    passes they are the draws the uninterrupted run makes there, and each pass draws anew."""
    def make():
        return DataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=workers)
    torch.manual_seed(0)
    uninterrupted = listed(make())
    torch.manual_seed(0)
    loader = make()
    loader.load_state_dict(make().state_dict())
    first = listed(loader)
    assert first == uninterrupted and listed(loader) != first


@pytest.mark.parametrize("persistent", [False, True])
def test_a_state_taken_between_passes_resumes_to_the_next_pass_whatever_the_loop_drew(persistent):
    """The next pass is drawn from torch's generator as it was when the state was taken (and,
    with persistent workers, as their iterator goes on: no new base seed)."""
    def make():
        return DataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=2,
                          persistent_workers=persistent)
    torch.manual_seed(0)
    second, resumed_to = next_pass_both_ways(make, loop_draws=True)
    assert resumed_to == second


class PassCounting(Sampler):
    """A sampler whose order is drawn from its own state: the passes it began."""

    def __init__(self) -> None:
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        generator = torch.Generator().manual_seed(self.passes)
        return iter(torch.randperm(SAMPLES, generator=generator).tolist())

    def __len__(self) -> int:
        return SAMPLES

    def state_dict(self) -> dict:
        return {"passes": self.passes}

    def load_state_dict(self, state: dict) -> None:
        self.passes = state["passes"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_samplers_own_state_taken_between_passes_resumes_to_the_next_pass(workers):
    def make():
        return DataLoader(Numbers(), batch_size=4, sampler=PassCounting(), num_workers=workers)
    second, resumed_to = next_pass_both_ways(make)
    assert resumed_to == second


def test_a_persistent_workers_streams_carry_their_ends_state_into_the_next_pass():
    """Each stream's state at its end (noted past the pass's last batch, the workers' randomness
    in it) is what a resume between passes loads: the next pass is the uninterrupted one's."""
    def make():
        return StatefulDataLoader(UnevenStreams(), batch_size=2, num_workers=3,
                                  persistent_workers=True, snapshot_every_n_steps=10)
    second, resumed_to = next_pass_both_ways(make)
    assert resumed_to == second
