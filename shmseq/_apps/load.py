"""Was the machine busy? Its cores, its load average, and the CPU that other work took meanwhile.

The figures of the demo and the bench are only comparable on a machine that gives the job its
cores. The job runs ``workers + 1`` busy processes (the workers, and the trainer), so it leaves
``free = max(0, usable cores - workers - 1)`` cores to anything else. It warns that its
figures may not reproduce when other work took more than ``free`` cores plus half a core
(``SLACK``) on average while it ran: the non-idle time of the cores it may run on (from
``/proc/stat``, steal time included: a virtual machine's host running something else), less
the CPU time of the job's own processes, over the job's wall time.

The load average is printed at the start and the end, but judged only where ``/proc/stat``
cannot be read (then: the 1-minute load average at the start above ``free + SLACK``, or at the
end above the job's processes plus ``free + SLACK``): it is a decaying average over the last
minute, so a command that ended just before the job still shows in it at the start, and the
job itself does at the end.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

SLACK = 0.5  # cores of other work tolerated beyond those the job leaves free
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal (guest is in user)


@dataclass
class Snapshot:
    wall: float                                 # time.perf_counter()
    load: tuple[float, float, float] | None     # 1, 5 and 15-minute load averages
    busy_seconds: float | None                  # the usable cores' non-idle time, from boot
    own_seconds: float                          # this process's CPU, and its reaped children's


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _busy_seconds(cores: set[int]) -> float | None:
    try:
        with open("/proc/stat") as stat:
            lines = [line.split() for line in stat if line.startswith("cpu")]
        ticks = sum(int(fields[1 + i]) for fields in lines
                    if fields[0][3:].isdigit() and int(fields[0][3:]) in cores
                    for i in _BUSY_FIELDS if 1 + i < len(fields))
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def snapshot() -> Snapshot:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    try:
        cores = os.sched_getaffinity(0)
    except AttributeError:
        cores = set(range(os.cpu_count() or 1))
    times = os.times()
    own = times.user + times.system + times.children_user + times.children_system
    return Snapshot(time.perf_counter(), load, _busy_seconds(cores), own)


def describe_cores() -> str:
    return f"{usable_cores()} usable cores (os.cpu_count: {os.cpu_count()})"


def describe_load(load: tuple[float, float, float] | None) -> str:
    if load is None:
        return "load average unknown"
    return "load average " + " ".join(f"{value:.2f}" for value in load) + " (1, 5, 15 min)"


def others_cores(start: Snapshot, end: Snapshot) -> float | None:
    """Cores' worth of other work on the job's cores between two snapshots, on average."""
    wall = end.wall - start.wall
    if start.busy_seconds is None or end.busy_seconds is None or wall <= 0:
        return None
    others = (end.busy_seconds - start.busy_seconds) - (end.own_seconds - start.own_seconds)
    return max(0.0, others / wall)


def busy(start: Snapshot, end: Snapshot, workers: int, cores: int) -> list[str]:
    """Why the figures may not reproduce: the rule in the module's docstring; [] if idle."""
    job = workers + 1
    free = max(0, cores - job)
    allowed = free + SLACK
    leaves = (f"more than the {free} of {cores} usable cores that the job ({workers} workers and "
              f"the trainer) leaves free, +{SLACK:g}")
    during = others_cores(start, end)
    if during is not None:
        return ([f"other work kept {during:.2f} cores busy on average while the job ran, {leaves}"]
                if during > allowed else [])
    found = []
    if start.load is not None and start.load[0] > allowed:
        found.append(f"the 1-minute load average was {start.load[0]:.2f} when the job started, "
                     f"{leaves}")
    if end.load is not None and end.load[0] - job > allowed:
        found.append(f"the 1-minute load average was {end.load[0]:.2f} at the end, the job's {job} "
                     f"processes and {leaves}")
    return found


def warning(reasons: list[str]) -> str:
    """The warning that goes with the figures when ``busy`` found reasons."""
    return (f"WARNING: the machine was busy ({'; '.join(reasons)}): these figures may not "
            "reproduce; compare them only with figures taken on an idle machine.")
