"""``python -m shmseq.bench``: shmseq against PyTorch's DataLoader and others, side by side.

Every loader delivers the same image batches (built by copying rows from memory, so that
what is measured is the transport) to a consumer that checks every one. Prints a table, what
each system is and what the table shows, with a warning where other work kept the machine busy
(the demo's rule: ``shmseq/_apps/load.py``), and writes ``results.md``, ``results.json`` and
``results.png`` into ``--out``.

``--streaming`` runs the streaming workloads instead: shmseq's ``ShardSequence`` against
torch's ``DataLoader`` over the same WebDataset-layout tar shards with the same decode
(photo-like JPEGs decoded and cropped to 224 x 224 in the workers, and raw uint8 images),
and on the JPEGs a third system, whose workers only read the encoded bytes and whose trainer
decodes them with ``shmseq.decode.DecodeStage`` (on the GPU where there is CUDA:
``shmseq-gpu-decode``; else in the trainer's threads: ``shmseq-trainer-decode``), and writes
``streaming.md`` and ``streaming.json``. The shards (about 80 MB of JPEGs and
155 MB of raw images; 20 and 40 MB with ``--quick``) are made in a temporary directory and
deleted at the end; ``--keep-shards`` keeps them for later runs in
``$XDG_CACHE_HOME/shmseq/bench`` (``~/.cache/shmseq/bench``), ``--shards-dir`` where you say.

``--streaming --remote`` reads the shards from local disk, over HTTP and over S3 (moto's
server), each server on 127.0.0.1 in a process of its own with ``--delay-ms`` added to every
request (and ``--bandwidth`` MB/s at most): shmseq's ``ShardSequence`` through its node shard
cache (``--cache-fraction`` of the set) against torch's ``DataLoader`` reading in place, with
the requests per sample, read amplification and peak cache of each remote run, and each
endpoint's own ceiling; and beside them, where installed (``pip install 'shmseq[peers]'``),
litdata, MosaicML streaming and WebDataset over the same servers, each its own recommended way,
in a table of their whole first epoch, steady rate and first batch (``shmseq.bench.peers``). Its shards have 64 samples each, 8,192 of them per set (2,048 with
``--quick``): a set four times the cache's budget (``shmseq.bench.remote_streaming``).

``--autotune`` runs a loader that sizes itself beside a sweep of fixed settings, on workloads
whose best setting the sweep finds: latency-bound workers (each batch waits 20 ms, as on object
storage; num_workers 1 to 16), CPU-bound ones (JPEG decode; 1 to 2x the CPU budget), a slow
trainer (25 ms a step), and big batches (imagenet256, and imagenet64 and cifar; ring slots 2 to
10 with 2 workers). num_workers='auto' is timed from --settle seconds after its loader is made
(10) and traced (its workers and rate every 0.5 s); the default ring (no buffer) is timed as
the fixed settings are; each is left out, saying why, where ShmSequence does not have it yet.
What torch's defaults (num_workers=0; prefetch_factor=2) and Grain's pick_performance_config
pick on each workload runs as fixed settings beside them. Writes ``autotune.md``,
``autotune.json`` and ``autotune.png`` (auto's workers and rate over time); about 9 minutes
(--quick: about 1), ``shmseq.bench.autotune``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, NoReturn

from shmseq._apps import load
from shmseq._apps.report import machine
from shmseq.engine import torch_available

from . import autotune, systems
from . import peers
from . import remote_streaming as remote
from .report import markdown, summarize, write_chart, write_json
from .runner import LIMIT, run_matrix
from .streaming import (QUICK_IMAGES, STAGE, STAGE_DEVICE, STREAM_SYSTEM_NAMES,
                        STREAM_TORCH_SYSTEMS, STREAM_WORKLOADS)
from .systems import OPT_IN, SYSTEMS, TORCH_SYSTEMS
from .workloads import TRANSPORT_WORKLOADS, WORKLOADS, image_pool

ALL_SYSTEMS = [LIMIT, *SYSTEMS]
DEFAULT_SYSTEMS = [name for name in ALL_SYSTEMS if name not in OPT_IN]
REMOTE_SYSTEMS = [*remote.SYSTEM_NAMES, *peers.system_names(remote.BACKENDS)]
FULL = {"repeats": 3, "seconds": 2.0, "warmup_seconds": 0.3}
QUICK = {"repeats": 1, "seconds": 0.5, "warmup_seconds": 0.1}


def _names(known: list[str]) -> Callable[[str], list[str]]:
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
    parser.add_argument("--workloads",
                        type=_names(list({**WORKLOADS, **STREAM_WORKLOADS, **autotune.AUTOTUNE_WORKLOADS})),
                        help=f"comma-separated, among {', '.join(WORKLOADS)} (default: all but "
                             "augment, whose workers spend their time augmenting images with "
                             "torch's operators); with --streaming, among "
                             f"{', '.join(STREAM_WORKLOADS)} (default: both); with --autotune, "
                             f"among {', '.join(autotune.AUTOTUNE_WORKLOADS)} (default: all)")
    parser.add_argument("--systems",
                        type=_names([*ALL_SYSTEMS, *STREAM_SYSTEM_NAMES[1:], *REMOTE_SYSTEMS]),
                        help=f"comma-separated, among {', '.join(ALL_SYSTEMS)} "
                             f"(default: all but {', '.join(OPT_IN)}); with --streaming, among "
                             f"{', '.join(STREAM_SYSTEM_NAMES)} (default: all; {STAGE} runs on shards-jpeg "
                             f"only); with --remote, among {', '.join(REMOTE_SYSTEMS)} "
                             "(default: those of the backends asked for; the peers' where "
                             "installed)")
    parser.add_argument("--streaming", action="store_true",
                        help="run the streaming workloads instead: ShardSequence against torch's "
                             "DataLoader over the same tar shards (see above)")
    parser.add_argument("--autotune", action="store_true",
                        help="run num_workers='auto' and the default ring beside sweeps of fixed "
                             "settings and the static rules' picks instead (see above)")
    parser.add_argument("--settle", type=float,
                        help="--autotune: seconds from making an auto loader to its timed window "
                             f"(default: {autotune.SETTLE_SECONDS:g})")
    parser.add_argument("--remote", nargs="?", const=",".join(remote.BACKENDS),
                        type=_names(list(remote.BACKENDS)),
                        help="--streaming: read the shards over these servers too, comma-separated "
                             f"among {', '.join(remote.BACKENDS)} (alone: both; see above)")
    parser.add_argument("--delay-ms", type=float,
                        help=f"--remote: milliseconds added to every request (default: "
                             f"{remote.DELAY_MS:g})")
    parser.add_argument("--bandwidth", type=float,
                        help="--remote: MB/s each server sends at most, over all its connections "
                             "(default: no cap)")
    parser.add_argument("--cache-fraction", type=float,
                        help="--remote: shmseq's shard cache budget, a fraction of the set "
                             f"(default: {remote.CACHE_FRACTION:g}; raised to what the batches in "
                             "flight read, where that is more)")
    parser.add_argument("--keep-shards", action="store_true",
                        help=f"--streaming: keep the shards for later runs, in {cache_dir()} "
                             "(reused by later runs with --keep-shards); by default they are "
                             "made in a temporary directory and deleted at the end")
    parser.add_argument("--images", type=int,
                        help="--streaming: images in each set of shards (default: 1,024; "
                             f"quick: {QUICK_IMAGES}; with --remote: {remote.IMAGES:,}, quick: "
                             f"{remote.QUICK_IMAGES:,})")
    parser.add_argument("--shards-dir", type=Path,
                        help="--streaming: make the shards here, or reuse those made here "
                             "earlier, and keep them (instead of --keep-shards' place)")
    parser.add_argument("--repeats", type=int, help="rounds over the matrix (default: 3, quick: 1)")
    parser.add_argument("--seconds", type=float,
                        help="timed seconds per system and workload (default: 2, quick: 0.5)")
    parser.add_argument("--buffer", type=int,
                        help="batches in flight: shmseq's ring slots, the bare ring's, "
                             f"DataLoader's prefetch over its workers (default: {systems.IN_FLIGHT}; "
                             "not with --autotune, which sweeps it)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="directory for results.md, .json and .png, or with --streaming "
                             "streaming.md and .json, with --autotune autotune.md, .json and "
                             ".png (default: bench-results)")
    args = parser.parse_args(argv)
    _check_remote(parser, args)
    _check_autotune(parser, args)
    kind = "streaming" if args.streaming else "autotune" if args.autotune else "transport"
    known: tuple[Mapping[str, object], list[str]] = (
        (STREAM_WORKLOADS, _remote_systems(args.remote) if args.remote else STREAM_SYSTEM_NAMES)
        if args.streaming else (autotune.AUTOTUNE_WORKLOADS, []) if args.autotune
        else (WORKLOADS, ALL_SYSTEMS))
    for option, names, among in (("workloads", args.workloads, known[0]),
                                 ("systems", args.systems, known[1])):
        if names is not None and any(name not in among for name in names):
            parser.error(f"--{option}: the {kind} benchmark{' (no --streaming)' * (kind == 'transport')} "
                         f"runs {', '.join(among) or f'no {option}'}")
    if args.images is not None and (not args.streaming or args.images < 1):
        parser.error("--images: a positive number of images, with --streaming")
    if args.workloads is None:
        args.workloads = list(known[0]) if args.streaming or args.autotune else TRANSPORT_WORKLOADS
    if args.systems is None:
        args.systems = list(known[1]) if args.streaming else DEFAULT_SYSTEMS
    return args


def _check_remote(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The remote options: only with --remote, which goes with --streaming; their values in
    range; the defaults of those not given."""
    given = [option for option, value in (("--delay-ms", args.delay_ms),
                                          ("--bandwidth", args.bandwidth),
                                          ("--cache-fraction", args.cache_fraction))
             if value is not None]
    if args.remote is None:
        if given:
            parser.error(f"{', '.join(given)}: with --remote (add --streaming --remote)")
        return
    if not args.streaming:
        parser.error(f"--remote {','.join(args.remote)}: with --streaming (add --streaming)")
    args.delay_ms = remote.DELAY_MS if args.delay_ms is None else args.delay_ms
    args.cache_fraction = (remote.CACHE_FRACTION if args.cache_fraction is None
                           else args.cache_fraction)
    if args.delay_ms < 0:
        parser.error(f"--delay-ms {args.delay_ms:g}: milliseconds >= 0")
    if args.bandwidth is not None and args.bandwidth <= 0:
        parser.error(f"--bandwidth {args.bandwidth:g}: MB/s > 0 (leave it out for no cap)")
    if not 0 < args.cache_fraction <= 1:
        parser.error(f"--cache-fraction {args.cache_fraction:g}: a fraction of the set, in (0, 1]")


def _check_autotune(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--autotune: a mode of its own, which sweeps the ring; --settle goes with it, and the
    defaults of --settle and --buffer."""
    if args.autotune and args.streaming:
        parser.error("--autotune or --streaming: one mode at a time")
    if args.autotune and args.buffer is not None:
        parser.error("--buffer: --autotune sweeps the ring's slots itself")
    if args.settle is not None and (not args.autotune or args.settle < 0):
        parser.error("--settle: seconds >= 0, with --autotune")
    args.settle = autotune.SETTLE_SECONDS if args.settle is None else args.settle
    args.buffer = systems.IN_FLIGHT if args.buffer is None else args.buffer


def _remote_systems(backends: list[str]) -> list[str]:
    """The remote mode's systems that read from local disk or from one of ``backends``."""
    return [name for name in REMOTE_SYSTEMS
            if remote.source_of(name) in (remote.LOCAL, *backends)]


def cache_dir() -> Path:
    """Where ``--keep-shards`` keeps the shards: ``$XDG_CACHE_HOME/shmseq/bench``."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(home) / "shmseq" / "bench"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _imports_torchcodec() -> bool:
    """Whether the GPU decode stage's decoder imports, saying why it does not."""
    from shmseq.decode import nvjpeg_decoder
    try:
        nvjpeg_decoder()
    except ImportError as exc:
        _log(f"{STAGE} skipped: {exc}")
        return False
    return True


def _without_torch(names: list[str], torch_systems: Collection[str]) -> list[str]:
    """The systems that run without torch, saying which were left out."""
    skipped = [name for name in names if name in torch_systems]
    if skipped:
        _log(f"torch is not installed: {', '.join(skipped)} skipped "
             "(pip install torch to compare with PyTorch's DataLoader)")
    return [name for name in names if name not in torch_systems]


def _machine_load(at_start: load.Snapshot, at_end: load.Snapshot) -> tuple[list[str], str | None]:
    """The machine's load while the loaders ran, and the warning where other work took the
    cores they need (the demo's rule, ``load.busy``: each system's workers and its consumer)."""
    facts = [f"{load.describe_load(at_start.load)} at the start, "
             f"{load.describe_load(at_end.load)} at the end"]
    others = load.others_cores(at_start, at_end)
    if others is not None:
        facts.append(f"other processes kept {others:.2f} of {load.usable_cores()} cores busy on "
                     "average while the loaders ran")
    busy = load.busy(at_start, at_end, systems.NUM_WORKERS, load.usable_cores())
    return facts, load.warning(busy) if busy else None


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    settings: dict[str, Any] = dict(QUICK if args.quick else FULL)
    settings.update({k: v for k, v in (("repeats", args.repeats), ("seconds", args.seconds))
                     if v is not None})
    if args.streaming:
        return streaming_main(args, settings, argv)
    if args.autotune:
        return autotune_main(args, settings, argv)
    workloads = [WORKLOADS[name] for name in args.workloads]
    systems.IN_FLIGHT = args.buffer
    if not torch_available():
        args.systems = _without_torch(args.systems, TORCH_SYSTEMS)
        if any(WORKLOADS[name].augment for name in args.workloads):
            _log("torch is not installed: the augment workload skipped (its augmentation runs "
                 "torch's operators)")
            args.workloads = [name for name in args.workloads if not WORKLOADS[name].augment]
    began = time.perf_counter()
    for workload in workloads:
        image_pool(workload.side)  # built before any clock starts, then inherited by every worker
    at_start = load.snapshot()
    runs = run_matrix(args.systems, workloads, log=_log, **settings)
    facts, warning = _machine_load(at_start, load.snapshot())
    cells = summarize(runs)
    info = machine()
    command = shlex.join(["python", "-m", "shmseq.bench", *argv])
    text = markdown(cells, info, {**settings, "buffer": args.buffer}, command, facts, warning)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text)
    write_json(args.out / "results.json", runs, cells, info,
               {**settings, "buffer": args.buffer, "workloads": args.workloads,
                "systems": args.systems, "load": facts, "warning": warning})
    written = "md, json"
    if write_chart(args.out / "results.png", cells):
        written += ", png"
    else:
        _log("matplotlib is not installed (pip install 'shmseq[bench]'): no chart")
    _log(f"wrote results.{{{written}}} into {args.out} in {time.perf_counter() - began:.0f} s")
    if warning:
        _log(warning)
    return 0


def _stop_on_sigterm(signum: int, frame: object) -> NoReturn:
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: loaders stop, the shards go


def streaming_main(args: argparse.Namespace, settings: dict, argv: list[str]) -> int:
    """The streaming workloads: shards made (or reused), the runs, the report."""
    from .streaming import cells_of, markdown, measurer, runs_on

    systems.IN_FLIGHT = args.buffer
    if not torch_available():
        args.systems = _without_torch(args.systems, STREAM_TORCH_SYSTEMS + tuple(remote.TORCH_SYSTEM_NAMES))
    if importlib.util.find_spec("simplejpeg") is None and "shards-jpeg" in args.workloads:
        _log("simplejpeg is not installed: shards-jpeg skipped (pip install 'shmseq[vision]')")
        args.workloads = [name for name in args.workloads if name != "shards-jpeg"]
    if STAGE in args.systems and STAGE_DEVICE == "cuda" and not _imports_torchcodec():
        args.systems = [name for name in args.systems if name != STAGE]
    skipped: dict[str, str] = {}
    if args.remote:
        _servable(args)
        skipped = _peers_installed(args)
    if not args.workloads or not args.systems:
        _log("nothing left to run")
        return 1
    workloads = _stream_workloads(args)
    began = time.perf_counter()
    scratch = args.shards_dir is None and not args.keep_shards
    root = (Path(tempfile.mkdtemp(prefix="shmseq-bench-shards-")) if scratch
            else args.shards_dir or cache_dir())
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        prepared, data, folders = _prepare_shards(workloads, root)
        with (remote.mode(prepared, root, folders, args.remote, args.delay_ms, args.bandwidth,
                          args.cache_fraction, _log, args.systems, skipped) if args.remote
              else contextlib.nullcontext((measurer(prepared), None))) as (measure, report):
            at_start = load.snapshot()
            runs = run_matrix(args.systems, list(workloads.values()), log=_log, measure=measure,
                              runs_on=runs_on, **settings)
        at_end = load.snapshot()  # the servers stopped: their CPU counted as the job's
    finally:
        signal.signal(signal.SIGTERM, previous)
        if scratch:
            shutil.rmtree(root, ignore_errors=True)
    facts, warning = _machine_load(at_start, at_end)
    info = machine()
    command = shlex.join(["python", "-m", "shmseq.bench", *argv])
    full = {**settings, "buffer": args.buffer}
    text = markdown(runs, workloads, info, full, data, facts, command, warning, report)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "streaming.md").write_text(text)
    write_json(args.out / "streaming.json", runs, cells_of(runs, workloads), info,
               {**full, "workloads": {name: asdict(w) for name, w in workloads.items()},
                "systems": args.systems, "decode_stage_device": STAGE_DEVICE, "shards": data,
                "load": facts, "warning": warning,
                **({"remote": report.as_json(runs)} if report else {})})
    if scratch:
        _log("shards: made in a temporary directory and deleted; --keep-shards keeps them for "
             f"later runs, in {cache_dir()}")
    else:
        _log(f"shards kept: {', '.join(map(str, folders.values()))}, reused by later runs with "
             f"{'--keep-shards' if args.shards_dir is None else '--shards-dir ' + shlex.quote(str(root))}"
             f"; delete them with: rm -r {' '.join(shlex.quote(str(f)) for f in folders.values())}")
    _log(f"wrote streaming.{{md, json}} into {args.out} in {time.perf_counter() - began:.0f} s")
    if warning:
        _log(warning)
    return 0


def autotune_main(args: argparse.Namespace, settings: dict, argv: list[str]) -> int:
    """The self-tuning loader against the sweeps and the static rules: the runs, the report."""
    if importlib.util.find_spec("simplejpeg") is None and "cpu-jpeg" in args.workloads:
        _log("simplejpeg is not installed: cpu-jpeg skipped (pip install 'shmseq[vision]')")
        args.workloads = [name for name in args.workloads if name != "cpu-jpeg"]
    if not args.workloads:
        _log("nothing left to run")
        return 1
    began = time.perf_counter()
    matrix = autotune.matrix(args.workloads, args.settle, _log)
    for workload in matrix.workloads:  # built before any clock starts, then inherited by workers
        image_pool(workload.side)
        if workload.jpeg:
            autotune.jpeg_pool()
    at_start = load.snapshot()
    runs = run_matrix(matrix.names, matrix.workloads, log=_log, measure=matrix.measure,
                      runs_on=matrix.runs_on, **settings)
    facts, warning = _machine_load(at_start, load.snapshot())
    info = machine()
    command = shlex.join(["python", "-m", "shmseq.bench", *argv])
    text = autotune.markdown(runs, matrix, info, settings, command, facts, warning)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "autotune.md").write_text(text)
    write_json(args.out / "autotune.json", runs, summarize(runs, autotune.AUTOTUNE_WORKLOADS), info,
               {**settings, "settle_seconds": args.settle, "workloads": args.workloads,
                "settings": {w: list(found) for w, found in matrix.settings.items()},
                "picks": matrix.picks, "left_out": matrix.left_out, "load": facts,
                "warning": warning})
    written = "md, json"
    if not autotune.traced(runs, matrix):
        _log(f"num_workers='{autotune.AUTO}' did not run: no chart of its workers over time")
    elif autotune.write_chart(args.out / "autotune.png", runs, matrix):
        written += ", png"
    else:
        _log("matplotlib is not installed (pip install 'shmseq[bench]'): no chart")
    _log(f"wrote autotune.{{{written}}} into {args.out} in {time.perf_counter() - began:.0f} s")
    if warning:
        _log(warning)
    return 0


def _servable(args: argparse.Namespace) -> None:
    """Leave out the backends whose packages are missing, and their systems, saying which."""
    for backend in list(args.remote):
        lacking = remote.missing(backend)
        if lacking:
            _log(f"{', '.join(lacking)} not installed: the {backend} server skipped "
                 f"(pip install {' '.join(lacking)})")
            args.remote.remove(backend)
            args.systems = [name for name in args.systems if remote.source_of(name) != backend]


def _peers_installed(args: argparse.Namespace) -> dict[str, str]:
    """Leave out the peers that cannot run here and their systems, saying which and why."""
    skipped = {}
    for peer in dict.fromkeys(p for name in args.systems if (p := peers.peer_of(name))):
        reason = peers.missing(peer)
        if reason:
            _log(f"{peer} skipped: {reason}")
            skipped[peer] = reason
            args.systems = [name for name in args.systems if peers.peer_of(name) != peer]
    return skipped


def _stream_workloads(args: argparse.Namespace) -> dict:
    """The streaming workloads asked for, by name: quick's smaller sets, --images', --remote's
    shards."""
    from .streaming import quick
    workloads = {name: quick(STREAM_WORKLOADS[name]) if args.quick else STREAM_WORKLOADS[name]
                 for name in args.workloads}
    if args.remote:
        images = args.images or (remote.QUICK_IMAGES if args.quick else remote.IMAGES)
        return {name: remote.workload(workload, images) for name, workload in workloads.items()}
    if args.images is not None:
        workloads = {name: replace(workload, images=args.images)
                     for name, workload in workloads.items()}
    return workloads


def _prepare_shards(workloads: dict, root: Path) -> tuple[dict, list[str], dict[str, Path]]:
    """Each workload's shards made under ``root`` (or reused): (its ``Prepared``, a line saying
    what they are, its folder), each by workload."""
    from .shard_data import decoder, jpeg_stats, load_index, make_shards, size_of
    from .streaming import Prepared
    prepared, data, folders = {}, [], {}
    for name, workload in workloads.items():
        made = time.perf_counter()
        existed = (root / workload.folder).is_dir()
        folder = make_shards(root / workload.folder, workload.kind, workload.images,
                             workload.samples_per_shard, workload.side)
        index = load_index(folder)
        line = (f"{name}: {len(index):,} samples in {len(index.shards)} shards, "
                f"{size_of(index) / 2**20:,.0f} MiB "
                f"({'reused' if existed else f'made in {time.perf_counter() - made:.1f} s'})")
        if workload.kind == "jpeg":
            stats = jpeg_stats(index)
            line += (f", JPEGs of {stats['kB']:.0f} kB and {stats['pixels'] / 1e3:.0f} "
                     f"kpixels on average ({stats['bits_per_pixel']:.1f} bits a pixel), "
                     f"decoded and cropped to {workload.side} x {workload.side}")
        else:
            line += f", raw {workload.side} x {workload.side} x 3 uint8 images"
        data.append(line + f", {workload.batch_size} a batch")
        folders[name] = folder
        prepared[name] = Prepared(workload, index, decoder(workload.kind, workload.side))
    return prepared, data, folders


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
