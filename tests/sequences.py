"""The small sequence that most tests of a sequence's life and failures start from."""
from shmseq import ShmSequence
from workers import IndexWorker


def make(worker=IndexWorker, dset_size=40, **options) -> ShmSequence:
    """A ``ShmSequence`` of ``worker``: 4 samples a batch, 2 workers, in order, numpy arrays,
    30 s to wait for a batch; ``options`` override any of these."""
    options = {"batch_size": 4, "num_workers": 2, "shuffle": False, "out_type": "null",
               "timeout": 30, **options}
    return ShmSequence(worker, dset_size, **options)


def run_checkpointing_at_last_batch(loader, epochs, state=None, at_epoch=None):
    """Read ``epochs`` as a trainer does (``set_epoch`` from its own counter), after loading
    ``state`` if given; without one, take a state at the last batch of epoch ``at_epoch`` (the
    first read, if None). What came, as (epoch, batch) pairs, and the state taken."""
    got, saved = [], None
    with loader:
        if state is not None:
            loader.load_state_dict(state)
        for epoch in epochs:
            loader.set_epoch(epoch)
            for step, batch in enumerate(loader):
                got.append((epoch, batch.tolist()))
                last = step == len(loader) - 1 and at_epoch in (None, epoch)
                if saved is None and state is None and last:
                    saved = loader.state_dict()
    return got, saved
