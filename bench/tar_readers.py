"""Every sample of local tar shards read once: webdataset's streaming reader against shmseq's
reader by member offset (in shard order, and with a 1000-sample shuffle window). The figure
behind shmseq.shards' choice of tarfile's header format + fsspec over webdataset.

    pip install webdataset
    for run in 1 2 3; do for reader in wds 0 1000; do
        python bench/tar_readers.py uint8 $reader; done; done
"""
import importlib
import sys
import time

import numpy as np

from shmseq.shards import ShardIndex, ShardPlan, ShardReader, write_shards

SAMPLE_BYTES = {"small": 3_000, "jpeg": 110_000, "uint8": 150_528}


def shards(kind: str, folder: str) -> ShardIndex:
    try:
        return ShardIndex.load(f"{folder}/shards.json")
    except FileNotFoundError:
        size = SAMPLE_BYTES[kind]
        noise = np.random.default_rng(0).integers(0, 256, size + 4096, dtype=np.uint8).tobytes()
        samples = ({"__key__": f"{i:06d}", "bin": noise[i % 4096:i % 4096 + size], "cls": i % 1000}
                   for i in range(3000))
        return write_shards(samples, f"{folder}/p-%03d.tar", samples_per_shard=250)


def read_webdataset(index: ShardIndex) -> int:
    import webdataset
    return sum(len(sample["bin"]) for sample in
               webdataset.WebDataset([shard.url for shard in index.shards], shardshuffle=False))


def read_by_offset(index: ShardIndex, window: int) -> int:
    reader = ShardReader(index)
    plan = ShardPlan(index, 64, shuffle=window > 0, seed=0, shuffle_window=max(window, 1))
    total = sum(len(sample["bin"]) for batch in plan.batches(0) for sample in reader.read(batch))
    reader.close()
    return total


def main(kind: str, reader: str) -> None:
    index = shards(kind, f"/tmp/shmseq-tar-readers/{kind}")
    if reader == "wds":
        importlib.import_module("webdataset")  # its import is not timed
    began = time.perf_counter()
    total = read_webdataset(index) if reader == "wds" else read_by_offset(index, int(reader))
    took = time.perf_counter() - began
    print(f"{kind} {reader}: {len(index) / took:,.0f} samples/s, {total / took / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main(*sys.argv[1:3])
