"""``python -m shmseq.bench``: shmseq against PyTorch's DataLoader and others, side by side.

Every loader delivers the same image batches (built by copying rows from memory, so that
what is measured is the transport) to a consumer that checks every one. Prints a table and
what it shows, and writes ``results.md``, ``results.json`` and ``results.png`` into
``--out``.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from shmseq.devices import torch_available

from .report import machine, markdown, summarize, write_chart, write_json
from .runner import LIMIT, run_matrix
from . import systems
from .systems import OPT_IN, SYSTEMS, TORCH_SYSTEMS
from .workloads import TRANSPORT_WORKLOADS, WORKLOADS, image_pool

ALL_SYSTEMS = [LIMIT, *SYSTEMS]
DEFAULT_SYSTEMS = [name for name in ALL_SYSTEMS if name not in OPT_IN]
FULL = {"repeats": 3, "seconds": 2.0, "warmup_seconds": 0.3}
QUICK = {"repeats": 1, "seconds": 0.5, "warmup_seconds": 0.1}


def _names(known: list[str]):
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"choose among {', '.join(known)}")
        return names
    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m shmseq.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="one short repeat of the matrix (about a minute; no spreads)")
    parser.add_argument("--workloads", type=_names(list(WORKLOADS)), default=TRANSPORT_WORKLOADS,
                        help=f"comma-separated, among {', '.join(WORKLOADS)} (default: all but "
                             "augment, whose workers spend their time augmenting images with "
                             "torch's operators)")
    parser.add_argument("--systems", type=_names(ALL_SYSTEMS), default=DEFAULT_SYSTEMS,
                        help=f"comma-separated, among {', '.join(ALL_SYSTEMS)} "
                             f"(default: all but {', '.join(OPT_IN)})")
    parser.add_argument("--repeats", type=int, help="rounds over the matrix (default: 3, quick: 1)")
    parser.add_argument("--seconds", type=float,
                        help="timed seconds per system and workload (default: 2, quick: 0.5)")
    parser.add_argument("--buffer", type=int, default=systems.IN_FLIGHT,
                        help="batches in flight: shmseq's ring slots, the bare ring's, "
                             "DataLoader's prefetch over its workers (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="directory for results.md, .json and .png (default: bench-results)")
    return parser.parse_args(argv)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    settings.update({k: v for k, v in (("repeats", args.repeats), ("seconds", args.seconds))
                     if v is not None})
    workloads = [WORKLOADS[name] for name in args.workloads]
    systems.IN_FLIGHT = args.buffer
    if not torch_available():
        skipped = [name for name in args.systems if name in TORCH_SYSTEMS]
        if skipped:
            _log(f"torch is not installed: {', '.join(skipped)} skipped "
                 "(pip install torch to compare with PyTorch's DataLoader)")
        args.systems = [name for name in args.systems if name not in TORCH_SYSTEMS]
        if any(WORKLOADS[name].augment for name in args.workloads):
            _log("torch is not installed: the augment workload skipped (its augmentation runs "
                 "torch's operators)")
            args.workloads = [name for name in args.workloads if not WORKLOADS[name].augment]
    began = time.perf_counter()
    for workload in workloads:
        image_pool(workload.side)  # built before any clock starts, then inherited by every worker
    runs = run_matrix(args.systems, workloads, log=_log, **settings)
    cells = summarize(runs)
    info = machine()
    command = shlex.join(["python", "-m", "shmseq.bench", *argv])
    text = markdown(cells, info, {**settings, "buffer": args.buffer}, command)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text)
    write_json(args.out / "results.json", runs, cells, info,
               {**settings, "buffer": args.buffer, "workloads": args.workloads,
                "systems": args.systems})
    written = "md, json"
    if write_chart(args.out / "results.png", cells):
        written += ", png"
    else:
        _log("matplotlib is not installed (pip install 'shmseq[bench]'): no chart")
    _log(f"wrote results.{{{written}}} into {args.out} in {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
