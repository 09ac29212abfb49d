"""``python -m shmseq.demo``: see the package's docstring, or ``--help``."""
from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, NoReturn

try:
    import torch
    from tqdm import tqdm
except ImportError as missing:
    raise SystemExit(f"the demo needs torch and tqdm ({missing}): "
                     "pip install torch 'shmseq[demo]'") from missing

from .._apps import load
from .._apps.report import machine
from ..vision import ImageArrayWorker, ImageFolderWorker
from . import __doc__ as ABOUT
from . import report, sweep
from .data import MAX_SIDE, MIN_SIDE, make_array_store, make_jpeg_folder
from .loaders import LOADERS, Worker, endless, shmseq_sequence
from .training import Epoch, Trainer, train

FULL = {"images": 2000, "side": 256, "crop": 224, "batch_size": 64, "steps_ms": "50,20,10,5,2,1",
        "repeats": 3, "seconds": 0.8, "epochs": 2}
QUICK = {"images": 96, "side": 40, "crop": 32, "batch_size": 16, "steps_ms": "20,5,1",
         "repeats": 1, "seconds": 0.15, "epochs": 1}
CLASSES = 10


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m shmseq.demo", description=ABOUT,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", choices=("store", "jpeg"), default="store",
                        help="decoded images memory-mapped from a store (default), or JPEG files")
    parser.add_argument("--keep", action="store_true",
                        help="keep the synthetic dataset for later runs, in "
                             f"{cache_dir()} (reused by later runs with --keep); by default it "
                             "is made in a temporary directory and deleted at the end")
    parser.add_argument("--workdir", type=Path,
                        help="make the synthetic dataset here, or reuse the one made here "
                             "earlier, and keep it (instead of --keep's place)")
    parser.add_argument("--out", type=Path, default=Path("demo-results"),
                        help="where results.md, results.json and sweep.png go (%(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes, for every loader")
    parser.add_argument("--seed", type=int, default=0, help="data, shuffling, augmentation, weights")
    parser.add_argument("--quick", action="store_true", help="a tiny run, for the tests")
    for name, kind, text in (("images", int, "images in the dataset"),
                             ("side", int, "side of the stored images (store format)"),
                             ("crop", int, "side of the random crops a batch holds"),
                             ("batch-size", int, "images a batch"),
                             ("steps-ms", str, "accelerator step times, in ms, comma-separated"),
                             ("repeats", int, "interleaved repeats of the sweep"),
                             ("seconds", float, "timed seconds per loader and step time"),
                             ("epochs", int, "epochs of the training run")):
        key = name.replace("-", "_")
        parser.add_argument(f"--{name}", type=kind, help=f"{text} (default {FULL[key]}; "
                            f"{QUICK[key]} with --quick)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.steps_ms = [float(step) for step in str(args.steps_ms).split(",")]
    return args


def cache_dir() -> Path:
    """Where ``--keep`` keeps the dataset: ``$XDG_CACHE_HOME/shmseq/demo`` (``~/.cache``)."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(home) / "shmseq" / "demo"


def dataset(args: argparse.Namespace,
            workdir: Path) -> tuple[ImageArrayWorker | ImageFolderWorker, Path]:
    """The in-place worker over the synthetic dataset under ``workdir``, and the dataset's
    folder (made unless an earlier run made it there)."""
    if args.format == "store":
        root = workdir / f"store-{args.images}-{CLASSES}-{args.side}-{args.seed}"
        store = human(args.images * args.side * args.side * 3)
        announced(root, f"{args.images} images of {args.side}x{args.side} (decoded, a store of "
                        f"{store})", lambda: make_array_store(root, args.images, CLASSES,
                                                              args.side, seed=args.seed))
        return ImageArrayWorker(root, args.crop, seed=args.seed), root
    root = workdir / f"jpeg-{args.images}-{CLASSES}-{args.seed}"
    announced(root, f"{args.images} JPEG files of {MIN_SIDE} to {MAX_SIDE} pixels a side",
              lambda: make_jpeg_folder(root, args.images, CLASSES, seed=args.seed))
    return ImageFolderWorker(root, args.crop, seed=args.seed), root


def announced(root: Path, what: str, make: Callable[[], Path]) -> None:
    """``make()`` the dataset ``root``, said before it starts and when it is done: the full
    demo's store takes seconds, which would pass without a word; one made earlier is reused."""
    if root.is_dir():
        print(f"reusing the synthetic dataset made earlier in {root}", flush=True)
        return
    print(f"making the synthetic dataset: {what} in {root}...", flush=True)
    began = time.perf_counter()
    make()
    print(f"dataset made in {time.perf_counter() - began:.1f} s", flush=True)


def size_of(path: Path) -> int:
    """Bytes of the files under ``path`` (or of the file)."""
    if path.is_file():
        return path.stat().st_size
    return sum(os.path.getsize(os.path.join(folder, name))
               for folder, _, names in os.walk(path) for name in names)


def human(size: int) -> str:
    """Bytes as ``du -h`` counts them."""
    return f"{size / 2**20:,.0f} MiB" if size >= 2**20 else f"{size / 2**10:,.0f} KiB"


@contextlib.contextmanager
def terminated_as_exit() -> Iterator[None]:
    """SIGTERM (a ``timeout``, a job scheduler) unwinds like Ctrl-C: loaders stop, data goes."""
    def stop(signum: int, frame: object) -> NoReturn:
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def training_run(worker: Worker, args: argparse.Namespace, device: torch.device) -> list[Epoch]:
    print(f"training a small CNN on shmseq batches ({len(worker)} images, {CLASSES} classes, "
          f"{args.epochs} epoch{'s' * (args.epochs != 1)}):", flush=True)

    seq = shmseq_sequence(worker, args.batch_size, args.workers, args.seed, device)

    def say(epoch: Epoch) -> None:
        print(f"  epoch {epoch.number}: loss {epoch.loss:.3f}, accuracy {epoch.accuracy:.1%}, "
              f"{epoch.images_per_s:,.0f} img/s\n    the loader (seq.stats.summary()): "
              f"{seq.stats.summary()}", flush=True)

    with seq.start():
        return train(endless(seq), math.ceil(len(worker) / args.batch_size), args.epochs,
                     Trainer(CLASSES, device, args.seed), say)


def sweep_run(worker: Worker, args: argparse.Namespace,
              device: torch.device) -> list[sweep.Measurement]:
    loaders = {name: functools.partial(open_loader, worker, args.batch_size, args.workers,
                                       args.seed, device)
               for name, open_loader in LOADERS.items()}
    total = len(loaders) * len(args.steps_ms) * args.repeats
    with tqdm(total=total, desc="accelerator sweep", unit="run", dynamic_ncols=True,
              file=sys.stderr) as bar:
        def progress(m: sweep.Measurement) -> None:
            bar.set_postfix_str(f"{m.loader} at {m.step_ms:g} ms: {m.images_per_s:,.0f} img/s, "
                                f"stall {m.stall:.0%}")
            bar.update()
        return sweep.run(loaders, args.steps_ms, args.repeats, args.seconds, progress)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.command = shlex.join(["python", "-m", "shmseq.demo",
                               *(sys.argv[1:] if argv is None else argv)])
    began, at_start = time.perf_counter(), load.snapshot()
    print(f"machine: {load.describe_cores()}, {load.describe_load(at_start.load)}", flush=True)
    scratch = args.workdir is None and not args.keep
    workdir = Path(tempfile.mkdtemp(prefix="shmseq-demo-")) if scratch else (
        args.workdir or cache_dir())
    try:
        with terminated_as_exit():
            root, written, busy = run(args, workdir, at_start)
        data = size_of(root)
    finally:
        if scratch:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"results: {', '.join(written)} in {args.out}{os.sep} "
          f"({human(sum(size_of(args.out / name) for name in written))})")
    if scratch:
        print(f"dataset: {human(data)}, made in a temporary directory and deleted; --keep keeps it "
              f"for later runs, in {cache_dir()}")
    else:
        print(f"dataset kept: {root} ({human(data)}), reused by later runs with "
              f"{'--keep' if args.workdir is None else '--workdir ' + shlex.quote(str(workdir))}; "
              f"delete it with: rm -r {shlex.quote(str(root))}")
    print(f"done in {time.perf_counter() - began:.0f} s")
    if busy:
        print(load.warning(busy))


def run(args: argparse.Namespace, workdir: Path,
        at_start: load.Snapshot) -> tuple[Path, list[str], list[str]]:
    """Make or find the dataset, train, sweep, report: the dataset's folder, the files written
    and why the machine was busy, if it was."""
    worker, root = dataset(args, workdir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # The loader's workers need their cores: torch's threads spinning against busy cores
    # slow every training step down many times over.
    torch.set_num_threads(max(1, load.usable_cores() - args.workers))
    epochs = training_run(worker, args, device)
    measurements = sweep_run(worker, args, device)
    at_end = load.snapshot()
    summaries = sweep.summarize(measurements)
    info = machine()
    busy = load.busy(at_start, at_end, args.workers, load.usable_cores())
    others = load.others_cores(at_start, at_end)
    at_end_text = load.describe_load(at_end.load) + (
        "" if others is None else f"; other work took {others:.2f} cores on average meanwhile")
    setup = {"format": args.format, "images": len(worker), "crop": args.crop,
             "batch_size": args.batch_size, "workers": args.workers, "steps_ms": args.steps_ms,
             "repeats": args.repeats, "seconds": args.seconds, "device": str(device),
             "machine": {**info, "usable_cores": load.usable_cores(), "cpu_count": os.cpu_count(),
                         "load_at_start": at_start.load, "load_at_end": at_end.load,
                         "others_cores": others, "busy": busy}}
    title = (f"{args.workers} workers, batches of {args.batch_size} random {args.crop}x{args.crop} "
             f"crops from {'JPEG files' if args.format == 'jpeg' else 'a decoded image store'}")
    warning = load.warning(busy) if busy else None
    text = "\n".join([
        f"shmseq demo: {title}; {len(worker)} images, {device}",
        f"machine: {info['cpu']}, {load.describe_cores()}, {info['ram']} RAM; Python "
        f"{info['python']}, torch {info['torch']}; at the start {load.describe_load(at_start.load)}; "
        f"at the end {at_end_text}", "", *([warning, ""] if warning else []),
        report.table(summaries), "", report.COLUMNS, "", "What it shows:",
        *(f"- {line}" for line in report.findings(summaries)), "",
        f"Reproduce: `{args.command}`", ""])
    print("\n" + text)
    report.write(args.out, setup, measurements, summaries, epochs, text)
    written = ["results.md", "results.json"]
    if report.chart(args.out / "sweep.png", summaries, title, warning):
        written.append("sweep.png")
    else:
        print("matplotlib is not installed (pip install 'shmseq[demo]'): no chart", file=sys.stderr)
    return root, written, busy


if __name__ == "__main__":
    main()
