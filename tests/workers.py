"""Module-level workers, so that spawn and forkserver can pickle them."""
import os

import numpy as np


class IndexWorker:
    """Returns its indices: the MDNC documentation's worker."""

    def __getitem__(self, indices):
        return indices


class ImageWorker:
    """A small image batch whose content identifies every sample."""

    def __init__(self, size=8):
        self.size = size

    def __getitem__(self, indices):
        images = np.empty((len(indices), self.size, self.size, 3), np.uint8)
        images[:] = (indices % 251).astype(np.uint8)[:, None, None, None]
        return {"image": images, "label": indices.astype(np.int64), "names": [f"s{i}" for i in indices]}


class FillWorker:
    """Builds its batch in place, straight in the slot."""

    def fill_batch(self, indices, out):
        values = out.empty((len(indices), 4), np.float32)
        values[:] = indices[:, None]
        labels = out.empty(len(indices), np.int64)
        labels[:] = indices
        return values, labels


class SizedWorker:
    """Batch ``k`` carries an array of ``sizes[k]`` bytes, for overflow tests."""

    def __init__(self, sizes):
        self.sizes = sizes

    def __getitem__(self, indices):
        n = self.sizes[int(indices[0]) % len(self.sizes)]
        return np.full(n, indices[0] % 256, np.uint8), indices


class FailingInit:
    def __init__(self):
        raise OSError("cannot open the dataset file")

    def __getitem__(self, indices):
        return indices


class Crash:
    """Dies the way ``how`` says when it meets sample ``at``."""

    def __init__(self, how, at):
        self.how, self.at = how, at

    def __getitem__(self, indices):
        import faulthandler
        import os
        import signal
        if self.at in indices:
            if self.how == "exit":
                os._exit(3)
            faulthandler.disable()  # the test runner's: the crash is on purpose, keep it quiet
            os.kill(os.getpid(), getattr(signal, self.how))
        return indices


class Hang:
    def __init__(self, at):
        self.at = at

    def __getitem__(self, indices):
        import time
        if self.at in indices:
            time.sleep(3600)
        return indices


class BadReturn:
    def __init__(self, kind):
        self.kind = kind

    def __getitem__(self, indices):
        return {"none": None, "objects": np.array([object()] * len(indices)),
                "set": (indices, {1, 2})}[self.kind]


class Slow:
    """A worker that takes ``seconds`` a batch: for interrupting a consumer mid-epoch."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __getitem__(self, indices):
        import time
        time.sleep(self.seconds)
        return indices


class SeedReporter:
    """Tells which worker built the batch, its seed, and a draw from the global generator."""

    def __getitem__(self, indices):
        import shmseq
        info = shmseq.get_worker_info()
        return np.array([info.id, info.seed % 2**31, np.random.randint(2**31)]), indices


def record_seed(directory, worker_id):
    """Writes the worker's seed to ``directory/<worker_id>``: every worker runs it, whichever
    batches it is given."""
    import pathlib
    import shmseq
    pathlib.Path(directory, str(worker_id)).write_text(str(shmseq.get_worker_info().seed))


def record_init(worker_id):
    import os
    os.environ["SHMSEQ_TEST_INIT"] = str(worker_id)


class InitReporter:
    """The id the init hook saw, and the worker's own id."""

    def __getitem__(self, indices):
        import os
        import shmseq
        return np.array([int(os.environ.get("SHMSEQ_TEST_INIT", -1)), shmseq.get_worker_info().id])


class PairDataset:
    """Samples are (image, label, name) tuples, as image datasets return them."""

    def __len__(self):
        return 30

    def __getitem__(self, i):
        return np.full((4, 4, 3), i, np.uint8), i, f"img{i}.jpg"


class SlowStart:
    """Takes ``seconds`` to construct: the consumer waits in ``start()`` meanwhile."""

    def __init__(self, seconds=1.0):
        import time
        time.sleep(seconds)

    def __getitem__(self, indices):
        return indices


class ListWorker:
    """A batch with no array at all: a list of ints."""

    def __getitem__(self, indices):
        return [int(i) for i in indices]


class KillOnce:
    """SIGKILLs its own process when it meets any sample of ``at``, once per sample: a marker
    file under ``marks`` remembers it across the replacement workers."""

    def __init__(self, marks, at, size=8, seconds=0.0):
        self.marks, self.at, self.size, self.seconds = str(marks), set(at), size, seconds

    def __getitem__(self, indices):
        import os
        import signal
        import time
        time.sleep(self.seconds)
        for sample in self.at.intersection(indices.tolist()):
            mark = os.path.join(self.marks, str(sample))
            if not os.path.exists(mark):
                open(mark, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        images = np.empty((len(indices), self.size, self.size, 3), np.uint8)
        images[:] = (indices % 251).astype(np.uint8)[:, None, None, None]
        return images, indices.astype(np.int64)


Pair = __import__("collections").namedtuple("Pair", ["image", "label"])


class DtypeWorker:
    """Batches of types a slot must carry faithfully (or refuse clearly)."""

    def __init__(self, kind):
        self.kind = kind

    def __getitem__(self, indices):
        if self.kind == "bfloat16":
            import torch
            return torch.tensor(indices.tolist(), dtype=torch.float32).to(torch.bfloat16) / 3
        if self.kind == "big-endian":
            return (indices * 1000).astype(">i4")
        if self.kind == "namedtuple":
            return Pair(np.full((len(indices), 2), 7, np.uint8), indices)
        return np.ma.masked_array(indices, mask=indices % 2 == 0)


class ExitInInit:
    """Dies in its constructor, without a word."""

    def __init__(self):
        import os
        os._exit(4)

    def __getitem__(self, indices):
        return indices


class DieOrDawdle(Crash):
    """Dies on the batch holding sample ``die_at``; takes ``seconds`` over every other one."""

    def __init__(self, die_at, seconds):
        super().__init__("SIGKILL", die_at)
        self.seconds = seconds

    def __getitem__(self, indices):
        import time
        batch = super().__getitem__(indices)
        time.sleep(self.seconds)
        return batch


class SlowStart5(SlowStart):
    def __init__(self):
        super().__init__(5)


class SlowStart30(SlowStart):
    """Spends 30 s in its constructor in Python, having said so (``say_inside``)."""

    def __init__(self):
        say_inside()
        super().__init__(30)


class WhoBuilt:
    """Tells which worker built the batch, after ``seconds`` of work."""

    def __init__(self, seconds=0.0):
        self.seconds = seconds

    def __getitem__(self, indices):
        import time
        import shmseq
        time.sleep(self.seconds)
        return np.array([shmseq.get_worker_info().id]), indices


class ThreadCount:
    """How many threads torch's operators run on in this worker."""

    def __getitem__(self, indices):
        import torch
        return np.full(len(indices), torch.get_num_threads())


def say_inside() -> None:
    """Write ``inside <pid>`` to stdout, which a worker shares with its consumer, as the worker
    enters a 30-second call: a test kills the consumer once its workers are there, instead of
    after a fixed wait long enough for a spawned worker on a busy machine to get there."""
    import os
    os.write(1, f"inside {os.getpid()}\n".encode())


class Sleeps:
    """Spends 30 s a batch in Python (``time.sleep``), having said so."""

    def __getitem__(self, indices):
        import time
        say_inside()
        time.sleep(30)
        return indices


def sleep_holding_the_gil(seconds: int) -> None:
    """A C call that keeps the GIL (``ctypes.PyDLL`` does not let go of it): no Python thread
    of the process runs meanwhile, a watchdog thread included."""
    import ctypes
    ctypes.PyDLL(None).sleep(seconds)


class HoldsTheGil:
    """Spends 30 s a batch in a C call that holds the GIL, having said so."""

    def __getitem__(self, indices):
        say_inside()
        sleep_holding_the_gil(30)
        return indices


class HoldsTheGilStarting(SlowStart):
    """Spends 30 s in its constructor in a C call that holds the GIL, having said so."""

    def __init__(self):
        say_inside()
        sleep_holding_the_gil(30)


class DiesStartingAfterAKill(KillOnce):
    """Kills its process at sample 13, once; the worker that replaces it then dies in its
    constructor, once. The marks go into the class's ``marks`` folder (set by the test)."""
    marks = None

    def __init__(self):
        import os
        import signal
        super().__init__(self.marks, at=[13], seconds=0.01)  # still running when that dies
        mark = os.path.join(self.marks, "starting")
        if os.path.exists(os.path.join(self.marks, "13")) and not os.path.exists(mark):
            open(mark, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def _die_now():
    import os
    os._exit(7)


class DiesUnpickled:
    """A worker whose unpickling ends its process before the 1 MB that follows is read (as a
    child whose main module fails to import dies before reading what its parent sends)."""

    def __init__(self):
        self.payload = np.zeros(1 << 20, np.uint8)

    def __reduce__(self):
        return (_die_now, (), {"payload": self.payload})  # the call comes before the state

    def __getitem__(self, indices):
        return indices


def slow_start(marks, seconds, worker_id):
    """A worker_init_fn that takes ``seconds``, leaving files that say when the worker began
    and finished starting (``<pid>.starting``, ``<pid>.ready`` under ``marks``)."""
    import os
    import time
    open(os.path.join(marks, f"{os.getpid()}.starting"), "w").close()
    time.sleep(seconds)
    open(os.path.join(marks, f"{os.getpid()}.ready"), "w").close()


class SampleDataset:
    """A dataset of samples, as a torch map-style ``Dataset`` is: ``dataset[i]`` is one image
    and its one-hot label. Given an array of indices it still returns one sample (the label
    marks several classes), without a word."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        label = np.zeros(4, np.float32)
        label[index % 4] = 1.0
        return np.full((3, 8, 8), 0.5, np.float32), label


class SampleWithLabels:
    """A dataset of samples whose label is computed from the index: ``dataset[i]`` is one
    image and ``i % 10``. Given an array of indices it returns one image and a label per index,
    so one of its arrays has a row per index."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        return np.full((3, 8, 8), 0.5, np.float32), index % 10


class ScalarLabels:
    """A dataset of samples that makes its label a Python int: given an array of indices,
    ``int(labels[i])`` raises numpy's TypeError."""

    def __init__(self):
        self.images = np.zeros((64, 3, 8, 8), np.float32)
        self.labels = np.arange(64) % 10

    def __len__(self):
        return 64

    def __getitem__(self, index):
        return self.images[index], int(self.labels[index])


class TypeErrorAt:
    """Raises a TypeError for the batch that holds sample ``at``."""

    def __init__(self, at):
        self.at = at

    def __getitem__(self, indices):
        if self.at in indices:
            raise TypeError(f"sample {self.at} is bad")
        return indices


class EatsMemory:
    """Moves its process into the memory cgroup ``cgroup`` as it starts, and fills ``megabytes``
    of memory when it meets sample ``at``: more than the cgroup allows."""

    def __init__(self, cgroup, at, megabytes):
        self.cgroup, self.at, self.megabytes = cgroup, at, megabytes
        self.joined = False

    def __getitem__(self, indices):
        import os
        if not self.joined:
            with open(os.path.join(self.cgroup, "cgroup.procs"), "w") as procs:
                procs.write(str(os.getpid()))
            self.joined = True
        if self.at in indices:
            np.ones(self.megabytes << 20, np.uint8)
        return indices


class ExitNoting:
    """Notes, in ``folder``, each process whose worker left (``worker_exit``)."""

    def __init__(self, folder) -> None:
        self.folder = folder

    def __getitem__(self, indices):
        return np.asarray(indices, np.int64)

    def worker_exit(self) -> None:
        (self.folder / str(os.getpid())).touch()
