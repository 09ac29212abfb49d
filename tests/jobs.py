"""Jobs of several processes run by the tests (torchrun and its ranks, torchrun agents, a
launcher and its children): each job's output goes to a file, and a job still running at its
timeout is stopped with every process it started, whatever their sessions. torchrun starts each
rank in a session of its own, which neither a kill of torchrun nor one of its process group
reaches: left running, a rank waits in a collective for gloo's 30 minutes, and it kept the
output pipe of a job read through one open, holding the test until pytest's timeout."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

import pytest

FUTEX = "202"  # the futex system call's number on x86-64
TERM_GRACE_S = 5  # SIGTERM first (torchrun stops its ranks, which remove their rings), then SIGKILL


@dataclass
class Ended:
    """How a job ended: its exit status, None if it was stopped at its timeout; its output; the
    processes of it that were stuck in the child side of ``os.fork`` then."""
    returncode: int | None
    output: str
    stuck: list[int]

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_jobs(commands: list[list[str]], timeout: float,
             envs: list[dict[str, str]] | None = None) -> list[Ended]:
    """Start every command at once (each with its ``envs`` entry as its whole environment,
    else this process's) and wait for them all, ``timeout`` seconds from the start at most."""
    envs = envs or [dict(os.environ)] * len(commands)
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        jobs = [subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True,
                                 env=env, start_new_session=True)
                for command, log, env in zip(commands, logs, envs)]
        ended = []
        try:
            for job, log in zip(jobs, logs):
                try:
                    returncode: int | None = job.wait(
                        timeout=max(0.0, deadline - time.monotonic()))
                    stuck: list[int] = []
                except subprocess.TimeoutExpired:
                    returncode, stuck = None, stopped(job)
                log.seek(0)
                ended.append(Ended(returncode, log.read(), stuck))
        except BaseException:  # a Ctrl-C or pytest's own timeout: no job is left running
            for job in jobs:
                if job.poll() is None:
                    stopped(job)
            raise
        return ended


def run_job(command: list[str], timeout: float, env: dict[str, str] | None = None) -> Ended:
    return run_jobs([command], timeout, None if env is None else [env])[0]


def output_of(command: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """The output of a job that must end with status 0 within ``timeout``; else the test fails
    saying how it ended, with the end of its output."""
    ended = run_job(command, timeout, env)
    if ended.returncode != 0:
        how = (f"did not end in {timeout} s" if ended.timed_out
               else f"ended with status {ended.returncode}")
        pytest.fail(f"{' '.join(command)} {how}:\n{ended.output[-4000:]}")
    return ended.output


def stopped(job: subprocess.Popen) -> list[int]:
    """Stop the job and every process it started: SIGTERM, then SIGKILL to those left after
    ``TERM_GRACE_S``. Return those that were stuck in a fork."""
    everyone = family(job.pid)
    stuck = stuck_in_fork(everyone)
    for pid in everyone:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    while any(map(running, everyone)) and time.monotonic() < deadline:
        job.poll()  # reaps the job itself once it ends
        time.sleep(0.05)
    for pid in everyone:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)  # and those of its group orphaned before
    job.wait()
    return stuck


def running(pid: int) -> bool:
    """Not ended: neither gone nor a zombie waiting for its parent to read its status."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


def family(root: int) -> list[int]:
    """``root`` and every process descended from it, whatever their sessions."""
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(name))
    found, todo = [], [root]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def stuck_in_fork(pids: list[int]) -> list[int]:
    """The processes of ``pids`` that run one thread, blocked on a lock (a futex): no thread
    of theirs can release it. A child forked while another thread of its parent held
    CPython's thread-state lock blocks so, before any code of its own runs (CPython < 3.11.8
    and 3.12: gh-112275); torch's DataLoader forks its workers while the last iterator's
    feeder threads exit. Linux on x86-64 only; elsewhere, none."""
    stuck = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as status:
                threads = next(int(line.split()[1]) for line in status
                               if line.startswith("Threads:"))
            with open(f"/proc/{pid}/syscall") as syscall:
                blocked_in = syscall.read().split()[0]
        except (OSError, StopIteration, ValueError, IndexError):
            continue
        if threads == 1 and blocked_in == FUTEX:
            stuck.append(pid)
    return stuck
