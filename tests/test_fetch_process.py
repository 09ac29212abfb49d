"""A rank's shard fetches run in a fetch process of its own, not in the training process: no
fetching thread in the trainer, the fetch process's counts in the trainer's stats, and it ends
with the sequence's finish() or with the trainer itself; one that dies is named once, and the
workers fetch what they need themselves."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

from shmseq.bench.memory import children
from shmseq.shards import ShardIndex, ShardSequence, write_shards
from shmseq.shards.fetch_process import FetchProcessDied
from servers import server, web  # noqa: F401 - the server fixtures

SHARDS, PER_SHARD = 12, 16


def write(folder) -> ShardIndex:
    samples = ({"__key__": f"s{i:05d}", "id": str(i), "bin": bytes([i % 251]) * 4000}
               for i in range(SHARDS * PER_SHARD))
    write_shards(samples, str(folder / "train-%03d.tar"), samples_per_shard=PER_SHARD)
    return ShardIndex.load(str(folder / "shards.json"))


def decode(sample: dict) -> np.ndarray:
    return np.array([int(sample["id"])], np.int64)


def fetch_processes(pids: set[int] | None = None) -> list[int]:
    """The fetch processes among this process's children (or ``pids``)."""
    found = []
    for pid in children() if pids is None else pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                if b"shmseq.shards.fetch_process" in file.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def gone(pid: int) -> bool:
    """Ended: no such process, or one only its parent has yet to reap."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return file.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except OSError:
        return True


@pytest.fixture
def sequence(tmp_path, web):
    write(tmp_path / "web")
    seq = ShardSequence(f"{web}/web/shards.json", decode, batch_size=8, num_workers=1, seed=5,
                        out_type="null", start_method="fork", shuffle_shards=4,
                        cache_dir=str(tmp_path / "cache"))
    yield seq
    seq.cache.remove()


def test_the_training_process_fetches_no_shard_itself(sequence):
    """While the epoch runs: one fetch process, given its setup in a memfd, no fetching thread
    in the trainer; the shards it fetched are in the trainer's stats; after finish() it is
    gone."""
    seen = []
    with sequence.start():
        for batch in sequence:
            seen += np.asarray(batch).ravel().tolist()
            if len(seen) == 8:
                threads = [thread.name for thread in threading.enumerate()]
                fetchers = fetch_processes()
                given = os.readlink(f"/proc/{fetchers[0]}/fd/0")
        stats = sequence.stats
    assert sorted(seen) == list(range(SHARDS * PER_SHARD))
    assert len(fetchers) == 1
    # its setup came in a memfd: down a pipe, a setup over 64 KiB held start() until the new
    # process had imported shmseq and read it
    assert given.startswith("/memfd:shmseq-fetch-setup"), given
    assert not [name for name in threads if "fetch" in name or "prefetch" in name], threads
    assert stats.shard_fetches == SHARDS  # the budget holds them all: each fetched once
    assert stats.remote_requests >= SHARDS  # its bytes, whose answer says its version
    assert not fetch_processes()


def test_a_dead_fetch_process_is_named_once_and_the_epoch_goes_on(sequence):
    """Killed after the first batch: named once (its pid, its exit code), within a second or
    at finish() at the latest, and every sample of the epoch still comes, the workers fetching
    their shards themselves."""
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sequence.start():
            for batch in sequence:
                seen += np.asarray(batch).ravel().tolist()
                if len(seen) == 8:
                    [pid] = fetch_processes()
                    os.kill(pid, signal.SIGKILL)
                    while not gone(pid):
                        time.sleep(0.01)
    assert sorted(seen) == list(range(SHARDS * PER_SHARD))
    said = [str(w.message) for w in caught if issubclass(w.category, FetchProcessDied)]
    assert len(said) == 1, said
    assert f"(pid {pid}) ended with exit code -9" in said[0]
    assert "workers fetch the shards they need themselves" in said[0]


def test_the_fetch_process_ends_with_its_trainer(tmp_path, web):
    """A trainer killed outright (SIGKILL: no finish(), no finalizer) takes its fetch process
    with it within a second or so."""
    write(tmp_path / "web")
    script = textwrap.dedent(f"""
        import sys, time
        import numpy as np
        from shmseq.shards import ShardSequence
        seq = ShardSequence({web + '/web/shards.json'!r}, lambda s: np.int64(0), batch_size=8,
                            num_workers=1, out_type="null", cache_dir={str(tmp_path / 'cache')!r})
        seq.start()
        next(iter(seq))
        print("started", flush=True)
        time.sleep(60)
    """)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "started"
        [fetcher] = fetch_processes(children(trainer.pid))
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 5
        while not gone(fetcher) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gone(fetcher)
    finally:
        trainer.kill()
        trainer.wait()


def test_a_trainer_with_sigpipe_at_its_default_outlives_its_fetch_process(tmp_path, web):
    """Tools that restore SIGPIPE's default die on a write to a pipe nobody reads: the trainer
    never writes to its fetch process, so the one that died is only named."""
    write(tmp_path / "web")
    script = textwrap.dedent(f"""
        import os, signal, time, warnings
        import numpy as np
        from shmseq.bench.memory import children
        from shmseq.shards import ShardSequence
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        seq = ShardSequence({web + '/web/shards.json'!r}, lambda s: np.int64(1), batch_size=8,
                            num_workers=1, out_type="null", cache_dir={str(tmp_path / 'cache')!r})
        marker = b"shmseq.shards." b"fetch_process"  # the fetch process's, not this script's
        with warnings.catch_warnings(record=True) as caught, seq.start():
            warnings.simplefilter("always")
            seen = 0
            for batch in seq:
                seen += len(batch)
                if seen == 8:
                    for pid in children():
                        if marker in open(f"/proc/{{pid}}/cmdline", "rb").read():
                            os.kill(pid, signal.SIGKILL)
                            time.sleep(0.2)
        print(seen, sum("ended with exit code -9" in str(w.message) for w in caught))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout.split() == [str(SHARDS * PER_SHARD), "1"], done.stderr[-3000:]


def test_finish_ends_the_fetch_process_though_a_fork_of_the_trainer_holds_its_pipe(sequence):
    """A process forked from the trainer (a framework's helper, another loader's worker) holds
    a copy of the pipe whose closing told the fetch process to end: finish() waited 10 s for
    it, then killed it. The page says so too: it ends within its next look."""
    with sequence.start():
        next(iter(sequence))
        [fetcher] = fetch_processes()
        child = os.fork()
        if child == 0:  # holds every descriptor of the trainer's, as a fork does
            time.sleep(30)
            os._exit(0)
        try:
            began = time.monotonic()
            sequence.finish()
            took = time.monotonic() - began
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    assert gone(fetcher)
    assert took < 5, f"finish() took {took:.1f} s"
