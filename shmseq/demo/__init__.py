"""The main job: how fast an accelerator each loader keeps fed, and a model that learns.

``python -m shmseq.demo`` prints the machine's cores and load average, makes a store of decoded
256 x 256 images (saying what and where before it starts, seconds for the full store, and how
long it took; in a temporary directory, deleted at the end; ``--keep`` keeps it for later
runs in ``$XDG_CACHE_HOME/shmseq/demo``, ``~/.cache/shmseq/demo`` by default, and ``--workdir``
keeps it where you say), then:

1. trains a small CNN for a short while on shmseq batches (random 224 x 224 crops and flips
   written straight into the slots), printing loss and accuracy per epoch;
2. sweeps a simulated accelerator's step time (50 to 1 ms) for shmseq and PyTorch's
   ``DataLoader`` (sample-level as its documentation recommends, and batch-level), with the
   same workers and the same per-sample work: images/s delivered, the share of time the
   training step waits for data, and the trainer's CPU per batch (``sweep.py`` says exactly
   how the accelerator is simulated);
3. prints the table and writes ``results.md``, ``results.json`` and ``sweep.png`` (stall
   against step time) into ``--out`` (``demo-results``), with the load average at the start
   and the end, and a warning where other work kept the machine busy (``shmseq._apps.load``
   says when): such figures may not reproduce;
4. says where the results are and how big, and whether the dataset was deleted or where it
   is kept, with how to delete it.

``--format jpeg`` runs the same on JPEG files decoded by ``shmseq.vision``: decoding then
bounds every loader alike. ``--quick`` is a tiny run, for the tests.

Modules: ``data`` (the synthetic datasets), ``loaders`` (the loaders compared), ``sweep``
(the simulated accelerator and the measurements), ``training`` (the CNN), ``report``; it
shares ``shmseq._apps`` with the bench (was the machine busy, what it is, data written once).
"""
