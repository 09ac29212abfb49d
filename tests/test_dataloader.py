import functools
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from shmseq import (BatchSampler, DataLoader, RandomSampler, SequentialSampler, ShmSequence,
                    default_batchify)
from shmseq.testing import ring_of
from sequences import run_checkpointing_at_last_batch
from workers import IndexWorker, InitReporter, PairDataset, SeedReporter, record_init, record_seed

TEN = np.arange(10)


def listed(loader):
    return [np.asarray(b).tolist() for b in loader]


@pytest.mark.parametrize("options, message", [
    ({"batch_size": 2, "shuffle": True, "sampler": SequentialSampler(10)}, "shuffle must not be given"),
    ({"batch_sampler": [[0]], "batch_size": 2}, "must not be given with batch_sampler"),
    ({"batch_sampler": [[0]], "shuffle": True}, "must not be given with batch_sampler"),
    ({"batch_sampler": [[0]], "sampler": SequentialSampler(1)}, "must not be given with batch_sampler"),
    ({"batch_sampler": [[0]], "last_batch": "keep"}, "must not be given with batch_sampler"),
    ({}, "batch_size must be given unless batch_sampler is"),
    ({"batch_size": 2, "last_batch": "sometimes"}, "last_batch must be one of"),
])
def test_mxnet_argument_rules(options, message):
    with pytest.raises(ValueError, match=message):
        DataLoader(TEN, **options)


@pytest.mark.parametrize("options, error, message", [
    ({"batch_size": 0}, ValueError, "batch_size must be an integer >= 1 or None, got 0"),
    ({"batch_size": 0, "sampler": SequentialSampler(10)}, ValueError, "batch_size .* got 0"),
    ({"batch_size": "64"}, TypeError, r"batch_size must be an integer >= 1 or None, got '64' \(str\)"),
    ({"batch_size": 2.0}, TypeError, r"batch_size .* got 2.0 \(float\)"),
    ({"batch_size": 2, "shuffle": "yes"}, TypeError, r"shuffle must be True or False, got 'yes' \(str\)"),
    ({"batch_size": 2, "thread_pool": "no"}, TypeError, "thread_pool must be True or False, got 'no'"),
    ({"batch_size": 2, "pin_memory": 1}, TypeError, "pin_memory must be True or False.*got 1"),
    ({"batch_size": 2, "num_workers": "2"}, TypeError,
     "num_workers must be an integer >= 0 or 'auto' .*, got '2'"),
    ({"batch_size": 2, "prefetch": "4"}, TypeError, "prefetch must be an integer >= 0 or None, got '4'"),
    ({"batch_size": 2, "prefetch": -1}, ValueError, "prefetch must be an integer >= 0 or None, got -1"),
    ({"batch_size": 2, "timeout": "60"}, TypeError, "timeout must be a number of seconds .* got '60'"),
])
def test_arguments_out_of_range_or_of_the_wrong_type_are_refused_by_name(options, error, message):
    with pytest.raises(error, match=message):
        DataLoader(TEN, **options)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_last_batch_policies_as_mxnet(num_workers):
    keep = DataLoader(TEN, batch_size=4, num_workers=num_workers)
    discard = DataLoader(TEN, batch_size=4, last_batch="discard", num_workers=num_workers)
    rollover = DataLoader(TEN, batch_size=4, last_batch="rollover", num_workers=num_workers)
    try:
        assert listed(keep) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        assert listed(discard) == [[0, 1, 2, 3], [4, 5, 6, 7]] and len(discard) == 2
        assert len(rollover) == 2 and listed(rollover) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert len(rollover) == 3
        assert listed(rollover) == [[8, 9, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]
    finally:
        for loader in (keep, discard, rollover):
            loader.close()


def test_shmsequence_takes_the_same_last_batch_policies():
    seq = ShmSequence(IndexWorker, 10, batch_size=4, shuffle=False, last_batch="rollover",
                      num_workers=2, out_type="null")
    with seq.start():
        assert [listed(seq) for _ in range(2)] == [
            [[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]]


def test_samplers():
    assert list(SequentialSampler(3, start=2)) == [2, 3, 4]
    shuffled = RandomSampler(20, seed=1)
    first, second = list(shuffled), list(shuffled)
    assert sorted(first) == list(range(20)) and first != second
    assert first == list(RandomSampler(20, seed=1))
    batches = BatchSampler(SequentialSampler(10), 4, "rollover")
    assert len(batches) == 2 and list(batches) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(batches) == 3 and list(batches)[0] == [8, 9, 0, 1]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sampler_and_a_batch_sampler_drive_the_loader(num_workers):
    with DataLoader(TEN, batch_size=3, sampler=SequentialSampler(5, start=5),
                    num_workers=num_workers) as loader:
        assert listed(loader) == [[5, 6, 7], [8, 9]]
    with DataLoader(TEN, batch_sampler=[[9, 0], [3]], num_workers=num_workers) as loader:
        assert listed(loader) == [[9, 0], [3]] and listed(loader) == [[9, 0], [3]]


def test_samples_are_stacked_straight_into_the_slot():
    with DataLoader(PairDataset(), batch_size=8, num_workers=2, shuffle=True, seed=3) as loader:
        ring_contains = None
        seen = []
        for images, labels, names in loader:
            ring_contains = ring_of(loader).contains
            assert ring_contains(images) and ring_contains(labels)
            assert images.shape[1:] == (4, 4, 3) and images.dtype == np.uint8
            assert labels.dtype == np.asarray(0).dtype
            assert (images[:, 2, 1, 0] == labels).all() and names == [f"img{i}.jpg" for i in labels]
            seen += labels.tolist()
    assert sorted(seen) == list(range(30))


def test_default_batchify_fields_and_errors():
    batch = default_batchify([{"x": np.zeros(2), "y": 1.5}, {"x": np.ones(2), "y": 2.5}])
    assert batch["x"].shape == (2, 2) and batch["y"].tolist() == [1.5, 2.5]
    with pytest.raises(ValueError, match=r"sample 1 of the batch has shape \(3,\).*batchify_fn"):
        default_batchify([np.zeros(2), np.zeros(3)])


def test_a_custom_batchify_fn():
    with DataLoader(TEN, batch_size=5, num_workers=2, batchify_fn=lambda s: np.array(s) * 10) as dl:
        assert listed(dl) == [[0, 10, 20, 30, 40], [50, 60, 70, 80, 90]]


def test_an_unpicklable_batchify_fn_is_named_for_spawn():
    loader = DataLoader(TEN, batch_size=5, num_workers=1, start_method="spawn",
                        batchify_fn=lambda samples: samples)
    with pytest.raises(TypeError, match="batchify_fn .* cannot be pickled.*'spawn'"):
        loader.start()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_multi_shard_batches_give_one_batch_per_shard(num_workers):
    sampler = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    with DataLoader(PairDataset(), batch_sampler=sampler, num_workers=num_workers) as loader:
        batches = [[(shard[1].tolist(), shard[0].shape) for shard in batch] for batch in loader]
    assert batches == [[([0, 1], (2, 4, 4, 3)), ([2, 3], (2, 4, 4, 3))],
                       [([4, 5], (2, 4, 4, 3)), ([6, 7], (2, 4, 4, 3))]]


@pytest.mark.parametrize("policy", ["keep", "discard", "rollover"])
def test_two_ranks_cover_each_epoch_once_with_equal_batch_counts(policy):
    ranks = [DataLoader(np.arange(23), batch_size=4, shuffle=True, seed=5, last_batch=policy,
                        num_workers=1, thread_pool=True, rank=r, world_size=2) for r in (0, 1)]
    try:
        for epoch in range(3):
            got = [listed(loader) for loader in ranks]
            assert len(got[0]) == len(got[1])
            flat = [i for batches in got for batch in batches for i in batch]
            if policy == "keep":  # padded by wrapping: one sample twice
                assert set(flat) == set(range(23)) and len(flat) == 24
            elif policy == "discard":
                assert len(set(flat)) == len(flat) and len(flat) == 16
    finally:
        for loader in ranks:
            loader.close()


def _resume_case(make, stop_after, epochs=3):
    """Batches of an uninterrupted run vs. a run stopped after ``stop_after`` and resumed."""
    with make(seed=7) as reference:
        expected = [b for _ in range(epochs) for b in listed(reference)]
    first = make(seed=7)
    with first:
        delivered = []
        for _ in range(epochs):
            for batch in first:
                delivered.append(np.asarray(batch).tolist())
                if len(delivered) == stop_after:
                    break
            if len(delivered) == stop_after:
                break
        state = first.state_dict()
    resumed = make(seed=None)
    resumed.load_state_dict(state)
    with resumed:
        rest = [b for _ in range(epochs) for b in listed(resumed)]
    return expected, delivered + rest[:len(expected) - len(delivered)]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("stop_after", [3, 9])  # mid-epoch 0, mid-epoch 1 (6 batches an epoch)
@pytest.mark.parametrize("front", ["sequence", "dataloader"])
def test_a_stopped_run_resumes_with_exactly_the_missing_batches(shuffle, stop_after, front):
    def make(seed):
        if front == "sequence":
            return ShmSequence(IndexWorker, 23, batch_size=4, shuffle=shuffle, seed=seed,
                               num_workers=3, out_type="null")
        return DataLoader(np.arange(23), batch_size=4, shuffle=shuffle, seed=seed, num_workers=3)

    expected, got = _resume_case(make, stop_after)
    assert got == expected


def test_rollover_state_resumes_and_records_the_remainder():
    def make(seed):
        return DataLoader(np.arange(10), batch_size=4, last_batch="rollover", shuffle=True,
                          seed=seed, num_workers=2)

    expected, got = _resume_case(make, stop_after=3)
    assert got == expected
    loader = make(1)
    with loader:
        listed(loader)
        state = loader.state_dict()
    assert state["epoch"] == 1 and state["position"] == 0 and len(state["rollover_remainder"]) == 2


def test_a_state_from_another_configuration_is_refused():
    state = ShmSequence(IndexWorker, 10, batch_size=4, out_type="null").state_dict()
    other = ShmSequence(IndexWorker, 10, batch_size=5, out_type="null")
    with pytest.raises(ValueError, match="state batch_size=4 does not match .* batch_size=5"):
        other.load_state_dict(state)


def test_set_epoch_goes_back_and_forth():
    seq = ShmSequence(IndexWorker, 12, batch_size=4, seed=2, num_workers=2, out_type="null")
    with seq.start():
        epochs = [listed(seq) for _ in range(3)]
        seq.set_epoch(1)
        assert listed(seq) == epochs[1] and seq.epoch == 2


@pytest.mark.parametrize("backend", ["proc", "thread"])
def test_each_worker_has_its_own_reproducible_seed(backend, tmp_path):
    """Read where every worker starts: which worker builds which batch depends on the pace."""
    def seeds(run):
        directory = tmp_path / run
        directory.mkdir()
        seq = ShmSequence(SeedReporter, 8, batch_size=1, seed=11, num_workers=2, shuffle=False,
                          thread_type=backend, out_type="null",
                          worker_init_fn=functools.partial(record_seed, str(directory)))
        with seq.start():
            assert sum(1 for _ in seq) == 8
        return {int(p.name): int(p.read_text()) for p in directory.iterdir()}

    first, second = seeds("first"), seeds("second")
    assert first == second and sorted(first) == [0, 1] and len(set(first.values())) == 2


def test_worker_processes_seed_their_global_generators_and_run_the_init_hook():
    seq = ShmSequence(SeedReporter, 8, batch_size=1, seed=11, num_workers=1, shuffle=False,
                      out_type="null")
    with seq.start():
        draws = [int(info[2]) for info, _ in seq]
    with seq.start():  # started at the next epoch: fresh random streams
        assert [int(info[2]) for info, _ in seq] != draws
    seq.set_epoch(0)
    with seq.start():  # at the same epoch again: the same streams
        assert [int(info[2]) for info, _ in seq] == draws
    init = ShmSequence(InitReporter, 40, batch_size=2, num_workers=2, out_type="null",
                       worker_init_fn=record_init)
    with init.start():
        assert all(hook == worker for hook, worker in (b.tolist() for b in init))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 30), size=st.integers(1, 7), stop=st.integers(0, 25),
       policy=st.sampled_from(["keep", "discard", "rollover"]), shuffle=st.booleans())
def test_resuming_anywhere_continues_the_same_stream(n, size, stop, policy, shuffle):
    def make(seed):
        return ShmSequence(IndexWorker, n, batch_size=size, shuffle=shuffle, seed=seed,
                           last_batch=policy, num_workers=0, out_type="null")

    reference = make(4).start_test("numpy")
    expected = [b.tolist() for _ in range(4) for b in reference]
    first = make(4).start_test("numpy")
    delivered = []
    while len(delivered) < min(stop, len(expected)):
        for batch in first:
            delivered.append(batch.tolist())
            if len(delivered) == stop:
                break
    resumed = make(None)
    resumed.load_state_dict(first.state_dict())
    resumed.start_test("numpy")
    while len(delivered) < len(expected):
        delivered += [b.tolist() for b in resumed]
    assert delivered[:len(expected)] == expected


def test_a_stream_of_samples_is_refused_naming_the_front_end_that_reads_one():
    class Stream:  # an IterableDataset's shape: samples by iteration only
        def __iter__(self):
            return iter(range(10))

    with pytest.raises(TypeError, match=r"got Stream, a stream .* shmseq\.torch\.DataLoader"):
        DataLoader(Stream(), batch_size=2)


# -- a user's sampler in the state ----------------------------------------------------------------
class PassCounting:
    """A sampler whose order is a function of the passes it drew, which only its own state
    tells (no generator among its attributes); drawn at ``iter()``, not at the first item."""

    def __init__(self, length):
        self.length, self.passes = length, 0

    def __iter__(self):
        self.passes += 1
        return iter(np.random.default_rng(self.passes).permutation(self.length).tolist())

    def __len__(self):
        return self.length

    def state_dict(self):
        return {"passes": self.passes}

    def load_state_dict(self, state):
        self.passes = state["passes"]


class OneByOne:
    """A sampler drawing each index from its own generator only as it is asked for: where the
    generator stands depends on how far the pass was read."""

    def __init__(self, length):
        self.length, self.rng = length, np.random.default_rng(0)

    def __iter__(self):
        for _ in range(self.length):
            yield int(self.rng.integers(self.length))

    def __len__(self):
        return self.length


class GlobalNumpy:
    """A sampler drawing from numpy's global generator, as MXNet's ``RandomSampler`` does."""

    def __init__(self, length):
        self.length = length

    def __iter__(self):
        return iter(np.random.permutation(self.length).tolist())

    def __len__(self):
        return self.length


def torch_random(length):
    torch = pytest.importorskip("torch")
    generator = torch.Generator()
    generator.manual_seed(0)
    return torch.utils.data.RandomSampler(range(length), generator=generator)


SAMPLED = {  # each makes a loader's arguments: 23 samples, batches of 4, a new order each pass
    "torch generator": lambda: {"sampler": torch_random(23), "batch_size": 4},
    "drawn as needed": lambda: {"sampler": OneByOne(23), "batch_size": 4},
    "shmseq RandomSampler": lambda: {"sampler": RandomSampler(23, seed=0), "batch_size": 4},
    "shmseq rollover": lambda: {"sampler": RandomSampler(23, seed=0), "batch_size": 4,
                                "last_batch": "rollover"},
    "own state": lambda: {"sampler": PassCounting(23), "batch_size": 4},
    "batch sampler": lambda: {"batch_sampler": BatchSampler(RandomSampler(23, seed=0), 4)},
}


def _interrupted(make, stop, after_loop=False, epochs=3):
    """The batches of ``epochs`` uninterrupted epochs, and those of a run stopped after ``stop``
    batches (inside the loop; ``after_loop``: once that epoch's loop ended) whose state went
    through JSON into a new loader built the same way, which then went on."""
    with make() as reference:
        expected = [b for _ in range(epochs) for b in listed(reference)]
    delivered = []
    with make() as first:
        while len(delivered) < stop:
            for batch in first:
                delivered.append(np.asarray(batch).tolist())
                if len(delivered) == stop and not after_loop:
                    break
        state = json.loads(json.dumps(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    with resumed:
        for _ in range(epochs + 1):
            delivered += listed(resumed)
    return expected, delivered[:len(expected)]


@pytest.mark.parametrize("sampled", SAMPLED)
@pytest.mark.parametrize("stop, after_loop", [
    (6, True),    # after the first epoch: the second epoch's order, not the first's again
    (3, False),   # mid-epoch: the rest of that epoch
    (9, False),   # mid-epoch, in the second epoch
    (12, False),  # at the second epoch's last batch, inside the loop: nothing more of it
])
def test_a_samplers_generators_and_state_are_saved_and_a_resume_draws_what_was_not(
        sampled, stop, after_loop):
    def make():
        return DataLoader(np.arange(23), **SAMPLED[sampled]())

    expected, got = _interrupted(make, stop, after_loop)
    assert got == expected


@pytest.mark.parametrize("sampled", ["drawn as needed", "shmseq rollover"])
@pytest.mark.parametrize("stop", [2, 8])
def test_a_resume_with_workers_draws_the_samplers_pass_as_the_saved_run_did(sampled, stop):
    def make():
        return DataLoader(np.arange(23), num_workers=2, **SAMPLED[sampled]())

    expected, got = _interrupted(make, stop)
    assert got == expected


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_a_pass_drawn_from_a_global_generator_resumes_and_leaves_it_as_the_loop_has_it(library):
    if library == "torch":
        torch = pytest.importorskip("torch")
        seed, get_state = torch.manual_seed, lambda: torch.get_rng_state().tolist()
        sampler = functools.partial(torch.utils.data.RandomSampler, range(23))  # seeds from it
    else:
        seed, get_state = np.random.seed, lambda: np.random.get_state()[1].tolist()
        sampler = functools.partial(GlobalNumpy, 23)
    seed(1)
    with DataLoader(np.arange(23), batch_size=4, sampler=sampler()) as reference:
        expected = listed(reference)
    seed(1)
    with DataLoader(np.arange(23), batch_size=4, sampler=sampler()) as first:
        for step, _ in enumerate(first):
            if step == 1:
                state = json.loads(json.dumps(first.state_dict()))
                break
    seed(99)  # the training loop's own state, restored from its checkpoint
    loop_has = get_state()
    resumed = DataLoader(np.arange(23), batch_size=4, sampler=sampler())
    resumed.load_state_dict(state)
    with resumed:
        assert listed(resumed) == expected[2:] and get_state() == loop_has


def test_a_distributed_samplers_epoch_is_in_the_state():
    """A loop that sets the sampler's epoch after each epoch, not before: the resumed pass is
    drawn with the epoch it was drawn with, not the new sampler's."""
    torch = pytest.importorskip("torch")

    def make():
        sampler = torch.utils.data.DistributedSampler(range(23), num_replicas=1, rank=0, seed=0)
        return DataLoader(np.arange(23), batch_size=4, sampler=sampler)

    with make() as reference:
        reference.set_epoch(3)
        expected = listed(reference)
    with make() as first:
        first.set_epoch(3)
        for step, _ in enumerate(first):
            if step == 1:
                state = first.state_dict()
                break
    resumed = make()
    resumed.load_state_dict(state)
    with resumed:
        assert listed(resumed) == expected[2:]


def test_a_state_of_another_samplers_generators_is_refused():
    state = DataLoader(TEN, batch_size=2, sampler=RandomSampler(10, seed=0)).state_dict()
    other = DataLoader(TEN, batch_size=2, sampler=SequentialSampler(10))
    with pytest.raises(ValueError, match="1 random generator.* this loader's samplers hold 0"):
        other.load_state_dict(state)


@pytest.mark.parametrize("sampled", [None, "shmseq RandomSampler"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_taken_at_an_epochs_last_batch_resumes_to_its_end(sampled, workers):
    """As ``ShmSequence``'s: a loop that counts epochs itself goes on with the next one."""
    def make():
        arguments = SAMPLED[sampled]() if sampled else {"batch_size": 4, "shuffle": True, "seed": 5}
        return DataLoader(np.arange(23), num_workers=workers, **arguments)

    full, state = run_checkpointing_at_last_batch(make(), range(3), at_epoch=1)
    assert (state["epoch"], state["position"]) == (1, 6)
    resumed, _ = run_checkpointing_at_last_batch(make(), range(1, 3), state)
    assert resumed == full[12:]  # nothing more of epoch 1, then epoch 2 as the uninterrupted run


def test_an_iterable_dataset_is_refused_naming_the_front_end_that_reads_one():
    """Even with a ``__len__``: its ``__getitem__`` is torch's, which raises."""
    torch = pytest.importorskip("torch")

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

        def __len__(self):
            return 10

    with pytest.raises(TypeError, match=r"dataset .* got Stream, .*IterableDataset.*"
                                        r"shmseq\.torch\.DataLoader"):
        DataLoader(Stream(), batch_size=2)
