"""The small sequence that most tests of a sequence's life and failures start from."""
from shmseq import ShmSequence
from workers import IndexWorker


def make(worker=IndexWorker, dset_size=40, **options) -> ShmSequence:
    """A ``ShmSequence`` of ``worker``: 4 samples a batch, 2 workers, in order, numpy arrays,
    30 s to wait for a batch; ``options`` override any of these."""
    options = {"batch_size": 4, "num_workers": 2, "shuffle": False, "out_type": "null",
               "timeout": 30, **options}
    return ShmSequence(worker, dset_size, **options)
