"""Where the CPU of one cold epoch goes, process by process: ``ShardSequence`` over the streaming
bench's JPEG shards (2,048 by default, 64 a shard, decoded and cropped to 224 in 2 workers), read
from local disk, over HTTP and over S3 as ``python -m shmseq.bench --streaming --remote`` reads
them (its servers on 127.0.0.1, 30 ms a request, each in a process of its own on the same
cores; its cache budget), each run from an empty cache folder.

    python bench/cold_epoch_cpu.py                       # 3 interleaved runs of each source
    python bench/cold_epoch_cpu.py --repeats 5 --images 1024 --sources local,http

Every 50 ms each process's CPU (user and system) is read from /proc, so that a process that
ends before the epoch does (a worker, the fetch process) still counts. Printed per source, as
medians (min-max) of the runs: the epoch, from making the loader to its last batch; the CPU of
all the processes together, in core-seconds; and by role: the decode workers, the rank's fetch
process, the trainer, the server. Where the loader keeps every core busy, the epoch is that
total over the cores: what a remote epoch spends beyond local disk's is what it loses.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from shmseq.bench.__main__ import cache_dir
from shmseq.bench.remote_streaming import DELAY_MS, SAMPLES_PER_SHARD, budget, serving, workload
from shmseq.bench.shard_data import decoder, make_shards
from shmseq.bench.streaming import shard_sequence
from shmseq.bench.streaming_workloads import STREAM_WORKLOADS, Prepared
from shmseq.shards import ShardIndex

TICKS = os.sysconf("SC_CLK_TCK")
LOOK_S = 0.05
ROLES = ("workers", "fetch process", "trainer", "server")


def children() -> dict[int, list[int]]:
    """Each process's children, from /proc."""
    found: dict[int, list[int]] = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            found[int(stat.rsplit(")", 1)[1].split()[1])].append(int(name))
    return found


def cpu_s(pid: int) -> float | None:
    """The process's CPU so far (user and system), None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


def role(pid: int, server: int) -> str:
    if pid == server:
        return "server"
    if pid == os.getpid():
        return "trainer"
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "workers"
    return "fetch process" if b"fetch_process" in command else "workers"


class CpuWatch:
    """Every ``LOOK_S``, the CPU of this process, the server and all their descendants but the
    other servers (``apart``): the last seen of each process, from when the watch began (a
    process already there counts from then)."""

    def __init__(self, server: int | None, apart: set[int]) -> None:
        self.server = server if server is not None else -1
        self.apart = apart
        self.start: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._look()
        self.start = {pid: seen for pid, (_, seen) in self.last.items()}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(LOOK_S):
            self._look()

    def _look(self) -> None:
        tree = children()
        todo = [os.getpid(), self.server]
        while todo:
            pid = todo.pop()
            seen = cpu_s(pid)
            if seen is not None:
                self.last[pid] = (self.last[pid][0] if pid in self.last else role(pid, self.server),
                                  seen)
            todo.extend(child for child in tree.get(pid, []) if child not in self.apart)

    def stop(self) -> dict[str, float]:
        """CPU seconds by role since the watch began."""
        self._stop.set()
        self._thread.join()
        self._look()
        spent = dict.fromkeys(ROLES, 0.0)
        for pid, (name, seen) in self.last.items():
            spent[name] += seen - self.start.get(pid, 0.0)
        return spent


def cold_epoch(prepared: Prepared, source: str | ShardIndex, options: dict, server: int | None,
               servers: set[int]) -> tuple[float, dict[str, float]]:
    """One epoch from making the loader to its last batch, and the CPU spent by role (the
    server's of ``servers`` only)."""
    watch = CpuWatch(server, servers - {server})
    began = time.perf_counter()
    seq = shard_sequence(source, prepared.workload, prepared.decode, out_type="null", **options)
    with seq.start():
        batches = sum(1 for _ in seq)
        took = time.perf_counter() - began
    spent = watch.stop()
    assert batches == prepared.workload.images // prepared.workload.batch_size, batches
    return took, spent


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--sources", default="local,http,s3")
    args = parser.parse_args(argv)
    sources = args.sources.split(",")
    work = workload(STREAM_WORKLOADS["shards-jpeg"], args.images)
    folder = make_shards(cache_dir() / work.folder, work.kind, work.images, SAMPLES_PER_SHARD)
    prepared = Prepared(work, ShardIndex.load(str(folder / "shards.json")),
                        decoder(work.kind, work.side))
    cache_bytes = budget(prepared, 0.25).bytes
    runs: dict[str, list[tuple[float, dict[str, float]]]] = collections.defaultdict(list)
    remote = [name for name in sources if name != "local"]
    with serving(folder.parent, {work.name: folder}, remote, DELAY_MS, None,
                 lambda line: print(line, file=sys.stderr)) as endpoints:
        servers = {pid for endpoint in endpoints.values()
                   if (pid := endpoint.server.process.pid) is not None}
        for repeat in range(args.repeats):
            for name in sources:
                with tempfile.TemporaryDirectory(prefix="shmseq-cold-") as cache:
                    if name == "local":
                        run = cold_epoch(prepared, prepared.index, {}, None, servers)
                    else:
                        endpoint = endpoints[name]
                        run = cold_epoch(prepared, endpoint.urls[work.name],
                                         {"cache_dir": cache, "cache_bytes": cache_bytes,
                                          "storage_options": endpoint.storage_options},
                                         endpoint.server.process.pid, servers)
                runs[name].append(run)
                print(f"run {repeat + 1}/{args.repeats} {name}: {run[0]:.2f} s", file=sys.stderr)
    print(f"{work.images} JPEGs in shards of {SAMPLES_PER_SHARD}, 2 workers, {DELAY_MS:.0f} ms a "
          f"request, {args.repeats} interleaved runs, medians (min-max), on {os.cpu_count()} "
          "cores; CPU in core-seconds\n")
    print("| source | epoch s | CPU, all | " + " | ".join(ROLES) + " |")
    print("|---|---:|---:|" + "---:|" * len(ROLES))
    for name in sources:
        took = [epoch for epoch, _ in runs[name]]
        total = [sum(spent.values()) for _, spent in runs[name]]
        each = [spread([spent[who] for _, spent in runs[name]]) for who in ROLES]
        print(f"| {name} | {spread(took)} | {spread(total)} | " + " | ".join(each) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
