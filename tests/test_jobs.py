"""The tests' jobs (jobs.py): one that outlives its timeout is stopped with the processes it
started in sessions of their own, as torchrun starts its ranks, and those stuck in a fork are
named."""
import os
import sys
import time

import pytest

from jobs import run_job, run_jobs, running

BLOCKED = "import threading; lock = threading.Lock(); lock.acquire(); lock.acquire()"
SLEEPING = "import time; time.sleep(60)"


def launcher(child: str) -> list[str]:
    """A job that starts ``child`` in a session of its own, says so, then sleeps."""
    return [sys.executable, "-c",
            "import subprocess, sys, time; "
            f"child = subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True); "
            "print('child', child.pid, flush=True); time.sleep(60)"]


def child_of(output: str) -> int:
    return int(output.split()[1])


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                    reason="stuck_in_fork reads Linux's x86-64 system call numbers")
def test_a_job_past_its_timeout_is_stopped_with_its_children_and_names_the_stuck_ones():
    began = time.monotonic()
    blocked, sleeping = run_jobs([launcher(BLOCKED), launcher(SLEEPING)], timeout=3)
    assert time.monotonic() - began < 3 + 2 * 5 + 5, "within the timeout and the grace periods"
    assert blocked.timed_out and sleeping.timed_out
    assert blocked.stuck == [child_of(blocked.output)], "the blocked child, not its parent"
    assert sleeping.stuck == []
    assert not running(child_of(blocked.output)) and not running(child_of(sleeping.output))


def test_a_job_that_ends_gives_its_status_and_output():
    ended = run_job([sys.executable, "-c", "print('out'); import sys; sys.exit(3)"], timeout=30)
    assert (ended.returncode, ended.output, ended.stuck) == (3, "out\n", [])
    assert not ended.timed_out
