"""ShardPlan: every sample once per epoch over ranks x workers, as many batches on every rank,
samples within their shuffle window, the same stream whatever the number of workers."""
import collections

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from shmseq.shards import Shard, ShardIndex, ShardPlan, ShardSequence, write_shards
from shmseq.shards.plan import as_layout


def index_of(sizes) -> ShardIndex:
    """An index of shards with these sample counts (offsets only matter for reading)."""
    return ShardIndex(Shard(f"shard-{n}.tar", np.arange(size, dtype=np.int64) * 1024, size * 1024)
                      for n, size in enumerate(sizes))


def rank_batches(index, batch_size, world_size, policy, epoch, **options):
    return [[batch.tolist() for batch in ShardPlan(index, batch_size, rank=rank,
                                                   world_size=world_size, last_batch=policy,
                                                   **options).batches(epoch)]
            for rank in range(world_size)]


plans = st.fixed_dictionaries({
    "sizes": st.lists(st.integers(0, 40), min_size=1, max_size=12),
    "batch_size": st.integers(1, 16),
    "world_size": st.integers(1, 8),
    "policy": st.sampled_from(["keep", "discard"]),
    "shuffle": st.booleans(),
    "shuffle_window": st.integers(1, 64),
    "seed": st.integers(0, 2**32),
    "epoch": st.integers(0, 5),
})


@settings(max_examples=300, deadline=None)
@given(plans)
def test_every_sample_once_per_epoch_and_as_many_batches_on_every_rank(case):
    index = index_of(case["sizes"])
    total, ranks, size = len(index), case["world_size"], case["batch_size"]
    dealt = rank_batches(index, size, ranks, case["policy"], case["epoch"], shuffle=case["shuffle"],
                         seed=case["seed"], shuffle_window=case["shuffle_window"])
    assert len({len(batches) for batches in dealt}) == 1  # DDP never waits on a rank
    assert len({tuple(len(b) for b in batches) for batches in dealt}) == 1
    seen = collections.Counter(i for batches in dealt for batch in batches for i in batch)
    if case["policy"] == "keep":
        per_rank = -(-total // ranks)
        assert set(seen) == set(range(total))
        padding = per_rank * ranks - total  # repeats, as DistributedSampler pads
        assert sum(seen.values()) == total + padding
        first = ShardPlan(index, size, shuffle=case["shuffle"], seed=case["seed"],
                          shuffle_window=case["shuffle_window"]).global_order(case["epoch"])
        repeated = sorted(i for i, count in seen.items() for _ in range(count - 1))
        assert repeated == sorted(np.resize(first, padding).tolist()) if total else not repeated
    else:
        per_rank = total // ranks // size * size
        assert max(seen.values(), default=1) == 1
        assert sum(seen.values()) == per_rank * ranks


@settings(max_examples=150, deadline=None)
@given(plans)
def test_a_sample_moves_less_than_the_window_from_its_shard_order(case):
    index = index_of(case["sizes"])
    plan = ShardPlan(index, case["batch_size"], shuffle=True, seed=case["seed"],
                     shuffle_window=case["shuffle_window"])
    order = plan.global_order(case["epoch"])
    assert sorted(order.tolist()) == list(range(len(index)))
    in_shard_order = ShardPlan(index, case["batch_size"], shuffle=True, seed=case["seed"],
                               shuffle_window=1).global_order(case["epoch"])
    shards, ordinals = index.locate(in_shard_order)
    assert (np.diff(ordinals)[np.diff(shards) == 0] == 1).all()  # each shard in its own order
    place = np.empty(len(index), np.int64)
    place[in_shard_order] = np.arange(len(index))
    assert (np.abs(place[order] - np.arange(len(order))) <= case["shuffle_window"]).all()


@settings(max_examples=100, deadline=None)
@given(plans)
def test_the_batches_of_the_first_steps_are_the_start_of_the_epoch(case):
    """After n steps the ranks together have had the epoch's first n x world_size batches:
    a prefix, whatever the world size (what lets a run resume on another one)."""
    index = index_of(case["sizes"])
    size, ranks = case["batch_size"], case["world_size"]
    options = dict(shuffle=case["shuffle"], seed=case["seed"], shuffle_window=case["shuffle_window"])
    dealt = rank_batches(index, size, ranks, "keep", case["epoch"], **options)
    first = ShardPlan(index, size, **options).global_order(case["epoch"])
    steps = max(len(dealt[0]) - 1, 0)  # every step but a last, shorter one
    taken = sorted(i for batches in dealt for batch in batches[:steps] for i in batch)
    assert taken == sorted(np.resize(first, steps * size * ranks).tolist())


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    samples = ({"__key__": f"k{i:04d}", "id": str(i)} for i in range(137))
    write_shards(samples, str(folder / "part-%02d.tar"), samples_per_shard=19)
    return str(folder / "shards.json")


def decode_id(sample: dict) -> int:
    return int(sample["id"])


@settings(max_examples=12, deadline=None)
@given(workers=st.integers(0, 4), world_size=st.integers(1, 3), batch_size=st.integers(1, 9),
       policy=st.sampled_from(["keep", "discard"]))
def test_workers_deliver_the_plan_exactly(shards, workers, world_size, batch_size, policy):
    """Ranks x workers (threads here, processes elsewhere) deliver what the plan says."""
    for rank in range(world_size):
        seq = ShardSequence(shards, decode_id, batch_size=batch_size, num_workers=workers,
                            thread_type="thread", out_type="null", seed=5, shuffle_window=7,
                            rank=rank, world_size=world_size, last_batch=policy)
        with seq.start():
            got = [batch.tolist() for batch in seq]
        plan = ShardPlan(seq.worker.reader.index, batch_size, shuffle=True, seed=5,
                         shuffle_window=7, rank=rank, world_size=world_size, last_batch=policy)
        assert got == [batch.tolist() for batch in plan.batches(0)]


def run_ranks(shards, world_size, state=None, steps=None, policy="keep", **options):
    """Each rank's batches (ids) from ``state`` on: ``steps`` of them, or to the epoch's end;
    and rank 0's state after them. ``options``: the sequence's window (``shuffle_window=9``
    unless given), its cache."""
    dealt, saved = [], None
    for rank in range(world_size):
        seq = ShardSequence(shards, decode_id, batch_size=4, num_workers=0, out_type="null",
                            seed=11, rank=rank, world_size=world_size, last_batch=policy,
                            **(options or {"shuffle_window": 9}))
        if state is not None:
            seq.load_state_dict(state)
        with seq.start():
            batches = iter(seq)
            dealt.append([next(batches).tolist() for _ in range(steps)] if steps is not None
                         else [batch.tolist() for batch in batches])
            saved = saved or seq.state_dict()
        if seq.cache is not None:
            seq.cache.remove()
    return dealt, saved


@pytest.mark.parametrize("policy", ["keep", "discard"])
@pytest.mark.parametrize("before, after", [(2, 3), (3, 2), (4, 1), (1, 4), (2, 2)])
def test_a_resume_on_another_world_size_keeps_the_global_order(shards, before, after, policy):
    """Stopped after some steps on ``before`` ranks and resumed on ``after``: every sample of
    the epoch once (with padding only at the end), in the global order, twice over too."""
    first, state = run_ranks(shards, before, steps=3, policy=policy)
    second, state = run_ranks(shards, after, state=state, steps=1, policy=policy)
    third, _ = run_ranks(shards, after + 1 if after < 4 else 1, state=state, policy=policy)
    assert len({len(batches) for batches in third}) == 1
    taken = [i for part in (first, second, third) for batches in part for b in batches for i in b]
    counts = collections.Counter(taken)
    if policy == "keep":
        assert set(counts) == set(range(137))
        assert sum(counts.values()) - 137 < 4 * 5  # padding: less than a batch per rank
    else:
        assert max(counts.values()) == 1 and 137 - len(counts) < 4 * 5
    order = ShardPlan(ShardIndex.load(shards), 4, shuffle=True, seed=11,
                      shuffle_window=9).global_order(0).tolist()
    steps_first = sorted(i for batches in first for b in batches for i in b)
    assert steps_first == sorted(order[:3 * 4 * before])  # the epoch's first batches
    steps_two = sorted(i for part in (first, second) for batches in part for b in batches for i in b)
    assert steps_two == sorted(order[:3 * 4 * before + 4 * after])  # and the next ones


@pytest.mark.parametrize("thread_type", ["thread", "proc"])
def test_more_workers_than_shards_still_deliver_every_sample_once(tmp_path, thread_type):
    """2 shards, 2 ranks x 5 workers: workers read different samples of the same shards."""
    samples = ({"__key__": f"k{i:04d}", "id": str(i)} for i in range(45))
    write_shards(samples, str(tmp_path / "part-%02d.tar"), samples_per_shard=30)
    seen = []
    for rank in range(2):
        seq = ShardSequence(str(tmp_path / "shards.json"), decode_id, batch_size=4, num_workers=5,
                            thread_type=thread_type, out_type="null", seed=2, rank=rank,
                            world_size=2, start_method="fork" if thread_type == "proc" else None)
        with seq.start():
            seen.append([i for batch in seq for i in batch.tolist()])
    assert len(seen[0]) == len(seen[1]) == 23  # 45 dealt to 2 ranks: one sample repeated
    assert collections.Counter(seen[0] + seen[1]) == collections.Counter(
        [*range(45), *ShardPlan(ShardIndex.load(str(tmp_path / "shards.json")), 4, shuffle=True,
                                seed=2).global_order(0)[:1].tolist()])


# -- shards dealt to nodes ------------------------------------------------------------------------

def layouts(max_nodes=4, max_ranks=3):
    """Each rank's node: 1..max_nodes nodes of 1..max_ranks ranks each, in any rank order."""
    return st.lists(st.integers(1, max_ranks), min_size=1, max_size=max_nodes).flatmap(
        lambda ranks: st.permutations([node for node, count in enumerate(ranks)
                                       for _ in range(count)]))


node_plans = st.fixed_dictionaries({
    "sizes": st.lists(st.integers(0, 40), min_size=1, max_size=13),
    "batch_size": st.integers(1, 9),
    "layout": layouts(),
    "policy": st.sampled_from(["keep", "discard"]),
    "shuffle": st.booleans(),
    "window": st.sampled_from([{"shuffle_window": 5}, {"shuffle_shards": 1}, {"shuffle_shards": 3}]),
    "seed": st.integers(0, 2**32),
    "epoch": st.integers(0, 5),
})


def node_plan(case, layout=None, rank=0) -> ShardPlan:
    layout = case["layout"] if layout is None else layout
    return ShardPlan(index_of(case["sizes"]), case["batch_size"], rank=rank,
                     world_size=len(layout), nodes=layout, last_batch=case["policy"],
                     shuffle=case["shuffle"], seed=case["seed"], **case["window"])


def node_batches(case, layout=None, history=()) -> list[list[list[int]]]:
    """Each rank's batches of the case's epoch under ``layout``, after the runs of ``history``."""
    layout = case["layout"] if layout is None else layout
    dealt = []
    for rank in range(len(layout)):
        plan = node_plan(case, layout, rank)
        if history:
            plan.resume_after(case["epoch"], list(history))
        dealt.append([batch.tolist() for batch in plan.batches(case["epoch"])])
    return dealt


@settings(max_examples=300, deadline=None)
@given(node_plans)
def test_with_nodes_every_sample_once_per_epoch_and_as_many_batches_on_every_rank(case):
    total, ranks, size = sum(case["sizes"]), len(case["layout"]), case["batch_size"]
    dealt = node_batches(case)
    assert len({tuple(len(b) for b in batches) for batches in dealt}) == 1  # DDP never waits
    seen = collections.Counter(i for batches in dealt for batch in batches for i in batch)
    if case["policy"] == "keep":
        assert set(seen) == set(range(total))
        assert sum(seen.values()) == -(-total // ranks) * ranks  # padding: repeats
    else:
        assert max(seen.values(), default=1) == 1
        assert sum(seen.values()) == total // ranks // size * size * ranks
    assert dealt == node_batches(case, [f"host-{node}" for node in case["layout"]])  # any labels


@settings(max_examples=300, deadline=None)
@given(node_plans)
def test_a_node_reads_its_own_shards_but_what_equal_steps_need(case):
    """Each shard belongs to one node, whatever the epoch; a node reads another's samples only
    where its own shards hold fewer than its ranks' share, and no more than it lacks."""
    index, layout = index_of(case["sizes"]), as_layout(case["layout"])
    owner = node_plan(case).owners(layout)
    ranks = np.bincount(layout)
    own = np.bincount(owner, weights=case["sizes"], minlength=len(ranks))
    total = sum(case["sizes"])
    per_rank = total // len(layout) if case["policy"] == "discard" else -(-total // len(layout))
    assert (own / ranks).max() - (own / ranks).min() <= max(case["sizes"])  # balanced by samples
    dealt = node_batches({**case, "layout": layout})
    for node in range(len(ranks)):
        ids = [i for rank in np.flatnonzero(np.asarray(layout) == node)
               for batch in dealt[rank] for i in batch]
        foreign = int((owner[index.locate(np.array(ids, np.int64))[0]] != node).sum()) if ids else 0
        assert foreign <= max(ranks[node] * per_rank - own[node], 0)


@settings(max_examples=100, deadline=None)
@given(node_plans)
def test_with_one_node_the_ranks_take_the_global_order_batch_by_batch(case):
    """One node: the dealing of old, whatever the layout's labels."""
    one = {**case, "layout": [0] * len(case["layout"])}
    ranks = len(case["layout"])
    old = rank_batches(index_of(case["sizes"]), case["batch_size"], ranks, case["policy"],
                       case["epoch"], shuffle=case["shuffle"], seed=case["seed"], **case["window"])
    assert node_batches(one) == old


@settings(max_examples=300, deadline=None)
@given(node_plans, st.lists(st.tuples(layouts(), st.floats(0, 1)), min_size=1, max_size=3),
       layouts())
def test_a_run_resumed_on_other_nodes_and_ranks_takes_every_sample_left_once(case, runs, last):
    """Runs on several layouts, each stopped after some of its steps, then one to the epoch's
    end: every sample of the epoch once over them all (the last run's padding and cut aside),
    as many batches on every rank of each run."""
    total, size = sum(case["sizes"]), case["batch_size"]
    history, taken = [], []
    for layout, fraction in runs:
        dealt = node_batches(case, layout, history)
        steps = int(fraction * len(dealt[0]))
        assert len({len(batches) for batches in dealt}) == 1
        taken += [i for batches in dealt for batch in batches[:steps] for i in batch]
        history.append((tuple(layout), steps))
    dealt = node_batches(case, last, history)
    assert len({tuple(len(b) for b in batches) for batches in dealt}) == 1
    rest = [i for batches in dealt for batch in batches for i in batch]
    left, ranks = total - len(set(taken)), len(last)
    if case["policy"] == "keep":  # all that was left, and as much padding as the ranks lack
        assert set(taken) | set(rest) == set(range(total))
        assert len(rest) == -(-left // ranks) * ranks
    else:
        assert len(taken) == len(set(taken)) and not set(taken) & set(rest)
        assert len(rest) == len(set(rest)) == left // ranks // size * size * ranks


def run_nodes(shards, cache_dir, monkeypatch, nodes, state=None, steps=None):
    """``run_ranks`` on ``nodes`` (each rank's node, as torch.distributed would gather them from
    the ranks' cache folders), through the cache."""
    monkeypatch.setattr("shmseq.shards.sequence.cache_nodes", lambda folder: nodes)
    return run_ranks(shards, len(nodes), state, steps, shuffle_shards=2, cache=True,
                     cache_dir=cache_dir, job="nodes")


def test_a_run_on_two_nodes_resumes_on_one_node_of_three_ranks(shards, tmp_path, monkeypatch):
    """The sequence tells its plan each rank's node: 2 nodes x 2 ranks read their own shards;
    stopped after 3 steps and resumed on 1 node x 3 ranks, the rest of the epoch is dealt once."""
    index = ShardIndex.load(shards)
    first, state = run_nodes(shards, str(tmp_path), monkeypatch, ["a", "a", "b", "b"], steps=3)
    assert state["nodes"] == [0, 0, 1, 1] and state["position"] == 3
    owner = ShardPlan(index, 4, seed=11, shuffle=True, world_size=4, rank=0).owners((0, 0, 1, 1))
    for node, ranks in enumerate(((0, 1), (2, 3))):
        ids = np.array([i for rank in ranks for batch in first[rank] for i in batch])
        assert (owner[index.locate(ids)[0]] == node).all()  # its own shards only
    rest, after = run_nodes(shards, str(tmp_path), monkeypatch, ["n"] * 3, state=state)
    assert after["nodes"] == [0, 0, 0] and after["epoch"] == 1
    assert len({len(batches) for batches in rest}) == 1
    taken = [i for batches in first for batch in batches for i in batch]
    left = [i for batches in rest for batch in batches for i in batch]
    assert len(taken) == len(set(taken)) == 3 * 4 * 4 and not set(taken) & set(left)
    assert set(taken) | set(left) == set(range(137))
    assert len(left) == -(-(137 - 48) // 3) * 3  # one sample of padding
