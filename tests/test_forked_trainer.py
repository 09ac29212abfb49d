"""A forked trainer cannot hurt the parent: a child forked (``os.fork()``) while a sequence or a
DataLoader iterator is live cannot iterate it, and neither its ``close()`` nor its exit (the
finalizers, ``multiprocessing``'s exit hook) stops, kills or steals from the parent's workers.

Each scenario runs in a script of its own, so that the forked child, which exits as a user's
would (``sys.exit``: atexit handlers and finalizers run), never unwinds through pytest. Every
process prints one JSON line saying what it saw."""
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from leaks import shm_entries

TESTS = Path(__file__).parent

_PRELUDE = textwrap.dedent(f"""
    import json, os, signal, sys, time
    sys.path.insert(0, {str(TESTS)!r})

    def report(who, **fields):
        print(json.dumps({{"who": who, "pid": os.getpid(), **fields}}), flush=True)

    def fork_child(body):
        '''Run body() in a forked child, which then exits normally (called at the script's top
        level: the child unwinds through nothing of the parent's). The parent gets its pid.'''
        sys.stdout.flush()
        pid = os.fork()
        if pid:
            return pid
        signal.alarm(10)  # a child stuck on the parent's pipes is ended, not waited for
        try:
            report("child", **body())
        except BaseException as exc:
            report("child", error=type(exc).__name__, message=str(exc))
        sys.exit(0)

    def exit_code(pid):
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    def alive(pid):
        try:
            with open(f"/proc/{{pid}}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False

    def worker_pids(pipeline):
        return [handle.pid for handle in pipeline.pool.handles]
""")

EPOCH = [[4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3] for k in range(100)]  # 400 samples, by 4


def run(*parts: str) -> dict[str, dict]:
    """Run the scenario (the script's ``parts``): what the parent and the child reported.
    Checks that the script ended well and left neither a segment nor a worker behind."""
    script = _PRELUDE + "".join(textwrap.dedent(part) for part in parts)
    process = subprocess.Popen([sys.executable, "-c", script],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    output, errors = process.communicate(timeout=60)
    assert process.returncode == 0, errors
    reports = {line["who"]: line for line in map(json.loads, output.splitlines())}
    assert set(reports) == {"parent", "child"}, (output, errors)
    assert not shm_entries({process.pid, reports["child"]["pid"]})
    _assert_gone(reports["parent"]["workers"])
    return reports


def _assert_gone(pids: list[int], grace: float = 5.0) -> None:
    deadline = time.monotonic() + grace
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids), "a worker outlived its parent"


def assert_refused(child: dict, parent: dict) -> None:
    """The child got a ShmSeqError that names both processes and says what to do instead."""
    assert child["error"] == "ShmSeqError", child
    assert f"process {parent['pid']}" in child["message"], child
    assert f"forked child (pid {child['pid']})" in child["message"], child
    assert "in the child" in child["message"], child


def assert_unharmed(parent: dict) -> None:
    """The parent got every batch once, in order, from the workers it started (none killed or
    replaced), and its child exited normally."""
    assert parent.get("error") is None, parent
    assert parent["child_exit"] == 0, parent
    assert parent["alive_after_child"] == parent["workers"], parent
    assert parent["workers_at_end"] == parent["workers"] and parent["restarts"] == 0, parent
    assert parent["batches"] == EPOCH


def live_sequence(method: str) -> str:
    """The scenario's start: a started ShmSequence whose first batch the parent took."""
    return f"""
        from shmseq import ShmSequence
        from workers import IndexWorker
        seq = ShmSequence(IndexWorker, 400, batch_size=4, num_workers=2, shuffle=False,
                          out_type="null", start_method={method!r}, timeout=10,
                          worker_restarts=2)
        seq.start()
        pipeline, stats = seq.pipeline, seq.stats
        batches = iter(seq)
        got = [next(batches).tolist()]
    """


_PARENT_FINISHES = """
    workers = worker_pids(pipeline)
    code = exit_code(child)
    alive_after_child = [pid for pid in workers if alive(pid)]
    try:
        got += [batch.tolist() for batch in batches]
        report("parent", child_exit=code, workers=workers, alive_after_child=alive_after_child,
               workers_at_end=worker_pids(pipeline), restarts=stats.restarts, batches=got)
    except Exception as exc:
        report("parent", error=f"{type(exc).__name__}: {exc}", workers=workers)
"""


@pytest.mark.timeout(30)
def test_a_child_cannot_take_a_batch_and_the_parent_finishes_its_epoch():
    reports = run(live_sequence("fork"), """

        def take_a_batch():
            next(batches)
            return {"error": None}

        child = fork_child(take_a_batch)
    """, _PARENT_FINISHES, """
        seq.finish()
    """)
    assert_refused(reports["child"], reports["parent"])
    assert_unharmed(reports["parent"])


@pytest.mark.timeout(30)
def test_the_child_can_start_its_own_pipeline():
    """What the refusal tells the child to do works: ``start()`` again gives it workers of its
    own, and the parent is unharmed."""
    reports = run(live_sequence("fork"), """

        def start_again():
            with seq.start():
                return {"first": next(iter(seq)).tolist(),
                        "own_workers": worker_pids(seq.pipeline) != worker_pids(pipeline)}

        child = fork_child(start_again)
    """, _PARENT_FINISHES, """
        seq.finish()
    """)
    assert reports["child"] == {**reports["child"], "first": [0, 1, 2, 3], "own_workers": True}
    assert_unharmed(reports["parent"])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("method", ["fork", "forkserver"])
@pytest.mark.parametrize("action", ["exits", "closes the pipeline"])
def test_a_child_that_exits_or_closes_leaves_the_parents_workers_alone(method, action):
    body = {"exits": "{}", "closes the pipeline": "pipeline.close() or {}"}[action]
    reports = run(live_sequence(method), f"""
        child = fork_child(lambda: {body})
    """, _PARENT_FINISHES, """
        seq.finish()
    """)
    assert reports["child"].get("error") is None, reports["child"]
    assert_unharmed(reports["parent"])


@pytest.mark.timeout(30)
def test_a_torch_dataloader_iterator_is_refused_in_the_child_and_the_parent_finishes():
    pytest.importorskip("torch")
    reports = run("""
        import torch
        from shmseq.torch import DataLoader
        import torch_datasets as data
        loader = DataLoader(data.Counting(400), batch_size=4, num_workers=2, timeout=10,
                            persistent_workers=True, worker_restarts=2)
        batches = iter(loader)
        got = [next(batches).tolist()]
        pipeline, stats = batches.pipeline, loader.stats

        def take_a_batch():
            next(batches)
            return {"error": None}

        child = fork_child(take_a_batch)
    """, _PARENT_FINISHES, """
        loader.close()
    """)
    assert_refused(reports["child"], reports["parent"])
    assert_unharmed(reports["parent"])
