"""simplejpeg against torchcodec's CPU decode_jpeg on the same JPEGs: images/s with 1 and 2
threads, and how far their pixels are apart. The figure behind the decode stage's CPU decoder
(docs/decode.md).

The JPEGs are the shard bench's (``shmseq.bench.shard_data.jpeg_samples``: photo-like, 300-500
px a side, quality 90, 4:2:0), decoded to RGB as ``DecodeStage``'s CPU path decodes them: one
call an image, the images of a round split between the threads. Runs interleave the decoders
within each round. torchcodec must import: PyPI's Linux wheel is a CUDA 13 build, which needs a
CUDA build of torch (it runs without a GPU); the CPU pair comes from PyTorch's CPU index.

    python bench/cpu_jpeg_decoders.py [images] [rounds]
"""
import concurrent.futures
import os
import statistics
import sys
import time

import numpy as np
import simplejpeg
import torch
from torchcodec.decoders import decode_jpeg

from shmseq.bench.shard_data import jpeg_samples

DECODERS = {
    "simplejpeg": lambda data: simplejpeg.decode_jpeg(data, colorspace="RGB"),
    "torchcodec": lambda data: decode_jpeg(torch.from_numpy(data)).permute(1, 2, 0).numpy(),
}


def decode_all(decode, images: list, threads: int) -> tuple[float, float]:
    """Wall and CPU seconds to decode every image, split between ``threads`` threads as the
    stage splits them (the CPU seconds, this process's, are what other processes cannot take)."""
    began, spent = time.perf_counter(), time.process_time()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        parts = [pool.submit(lambda part: [decode(data) for data in part], images[start::threads])
                 for start in range(threads)]
        for part in parts:
            part.result()
    return time.perf_counter() - began, time.process_time() - spent


def agreement(images: list) -> str:
    """Max and mean absolute difference of the two decoders' pixels, over every image."""
    diffs = [np.abs(DECODERS["simplejpeg"](data).astype(np.int16)
                    - DECODERS["torchcodec"](data).astype(np.int16)) for data in images]
    largest = max(int(diff.max()) for diff in diffs)
    mean = sum(float(diff.sum()) for diff in diffs) / sum(diff.size for diff in diffs)
    differing = sum(int(np.count_nonzero(diff)) for diff in diffs) / sum(diff.size for diff in diffs)
    return f"max |diff| {largest} levels, mean {mean:.4f}, {differing:.2%} of values differ"


def main(count: int = 512, rounds: int = 5) -> None:
    images = [np.frombuffer(bytearray(sample["jpg"]), np.uint8) for sample in jpeg_samples(count)]
    mean_kb = sum(len(data) for data in images) / len(images) / 1000
    print(f"{count} JPEGs, {mean_kb:.0f} kB on average; torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}")
    print(agreement(images))  # every image decoded once by each before the timed rounds
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    rates = {(name, threads): [] for name in DECODERS for threads in (1, 2)}
    per_cpu_s = {key: [] for key in rates}
    for _ in range(rounds):
        for name, threads in rates:
            wall, cpu = decode_all(DECODERS[name], images, threads)
            rates[name, threads].append(count / wall)
            per_cpu_s[name, threads].append(count / cpu)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    for key, found in rates.items():
        print(f"{key[0]}, {key[1]} thread(s): {spread(found)} images/s, "
              f"{spread(per_cpu_s[key])} images per CPU-second")
    for threads in (1, 2):
        for measure, found in (("images/s", rates), ("images per CPU-second", per_cpu_s)):
            ratios = [ours / theirs for ours, theirs in zip(found["torchcodec", threads],
                                                            found["simplejpeg", threads])]
            print(f"torchcodec / simplejpeg, {threads} thread(s), {measure} round by round: "
                  f"{spread(ratios, '.2f')}")


def spread(values: list, form: str = ",.0f") -> str:
    """The median (min-max)."""
    return f"{statistics.median(values):{form}} ({min(values):{form}}-{max(values):{form}})"


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:]))
