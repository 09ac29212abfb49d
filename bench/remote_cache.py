"""Remote shards through the node's shard cache against reading each sample where it lies:
the JPEG shards (2,048 photo-like images, 16 shards of 128) served over HTTP on 127.0.0.1 with
a delay added to every request, one epoch, transport only (``decode`` takes the JPEG's bytes),
2 workers. Per run: images/s, requests and bytes the server answered, requests per sample,
read amplification (bytes served / bytes of the samples), and the cache's peak. Every remote
run starts from an empty cache (its first epoch: every shard fetched).

    PYTHONPATH=. python bench/remote_cache.py [delay_ms=30] [rounds=3]

The server is ``shmseq.bench.servers.FileServer`` (werkzeug's threaded server, with Range),
each request delayed by ``delay_ms``. Medians (min-max) of interleaved rounds.
"""
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from shmseq.bench.servers import FileServer
from shmseq.bench.shard_data import load_index, make_shards
from shmseq.shards import ShardSequence

IMAGES, PER_SHARD = 2048, 128
RUNS = {  # name: (over HTTP, ShardSequence options, the epoch measured)
    "local disk, shuffle_window=1000": (False, {"shuffle_window": 1000}, 0),
    "local disk, shuffle_shards=8": (False, {"shuffle_shards": 8}, 0),
    "HTTP, shuffle_window=1000, no cache (before)": (True, {"shuffle_window": 1000}, 0),
    "HTTP, default (shuffle_shards=8, cache): 1st epoch": (True, {}, 0),
    "HTTP, default: 2nd epoch (the cache holds it all)": (True, {}, 1),
}


def jpeg_bytes(sample: dict) -> np.ndarray:
    return np.array([len(sample["jpg"])], np.int64)


def run(name: str, root: Path, server: FileServer, samples_bytes: int) -> dict:
    remote, options, epoch = RUNS[name]
    url = f"{server.url}/shards.json" if remote else str(root / "shards.json")
    cache = tempfile.mkdtemp(prefix="cache-", dir=root)
    cached = {"cache_dir": cache} if remote and "shuffle_window" not in options else {}
    seq = ShardSequence(url, jpeg_bytes, batch_size=64, num_workers=2, seed=0, out_type="null",
                        **cached, **options)
    server.clear_log()
    began = time.perf_counter()  # start() included: the prefetcher begins fetching there
    with seq.start():
        for _ in range(epoch):
            for batch in seq:
                del batch
            server.clear_log()
            began = time.perf_counter()
        images = sum(len(batch) for batch in seq)
        seconds = time.perf_counter() - began
    requests, sent = server.requests, server.bytes_sent
    shutil.rmtree(cache)
    assert images == IMAGES
    return {"images/s": images / seconds, "requests": requests, "MB served": sent / 1e6,
            "requests/sample": requests / images, "amplification": sent / samples_bytes,
            "peak cache MB": seq.stats.cache_peak_bytes / 1e6}


def main(delay_ms: float = 30, rounds: int = 3) -> None:
    root = make_shards(Path(tempfile.gettempdir()) / f"shmseq-remote-bench-{IMAGES}",
                       "jpeg", IMAGES, PER_SHARD)
    index = load_index(root)
    samples_bytes = sum(shard.end for shard in index.shards)
    found = {name: [] for name in RUNS}
    with FileServer(root, delay=delay_ms / 1000) as server:
        for _ in range(rounds):
            for name in RUNS:
                found[name].append(run(name, root, server, samples_bytes))
    print(f"{IMAGES} JPEGs ({samples_bytes / 1e6:.0f} MB of samples) in {len(index.shards)} "
          f"shards; HTTP on 127.0.0.1 with {delay_ms:g} ms a request; 2 workers, transport only; "
          f"median (min-max) of {rounds} interleaved rounds\n")
    columns = list(next(iter(found.values()))[0])
    print("| read from | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, runs in found.items():
        cells = []
        for column in columns:
            values = [r[column] for r in runs]
            middle = statistics.median(values)
            cells.append(f"{middle:,.3g}" if min(values) == max(values) else
                         f"{middle:,.3g} ({min(values):,.3g}-{max(values):,.3g})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(*(float(arg) if i == 0 else int(arg) for i, arg in enumerate(sys.argv[1:3])))
