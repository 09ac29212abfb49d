"""The main job: how fast an accelerator each loader keeps fed, and a model that learns.

``python -m shmseq.demo`` makes (once, then reuses) a store of decoded 256 x 256 images, then:

1. trains a small CNN for a short while on shmseq batches (random 224 x 224 crops and flips
   written straight into the slots), printing loss and accuracy per epoch;
2. sweeps a simulated accelerator's step time (50 to 1 ms) for shmseq and PyTorch's
   ``DataLoader`` (sample-level as its documentation recommends, and batch-level), with the
   same workers and the same per-sample work: images/s delivered, the share of time the
   training step waits for data, and the trainer's CPU per batch (``sweep.py`` says exactly
   how the accelerator is simulated);
3. prints the table and writes ``results.md``, ``results.json`` and ``sweep.png`` (stall
   against step time) into ``--out``.

``--format jpeg`` runs the same on JPEG files decoded by ``shmseq.vision``: decoding then
bounds every loader alike. ``--quick`` is a tiny run, for the tests.

Modules: ``data`` (the synthetic datasets), ``loaders`` (the loaders compared), ``sweep``
(the simulated accelerator and the measurements), ``training`` (the CNN), ``report``.
"""
