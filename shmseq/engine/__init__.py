"""The engine: batches written by workers into a ring of shared-memory slots, read in order.

::

 trainer/  in the training process; the consumer's thread moves every slot
   plan.py           which indices form batch k of epoch e
   pool.py           sends Build(number, free slot, indices) down a task pipe ----+
                     reads the replies and the workers' sentinels  <--------+     |
   ring.py           the slot state machine; every count of slots           |     |
   convert.py        every batch, one route: slot -> device -> consumer     |     |
   devices.py        numpy and torch views, page-locking, CUDA copies       |     |
   pipeline.py       wires them; takes each batch in one pass; closes all   |     |
   worker_handle.py  starts a worker, process or thread                     |     |
   stats.py          the counters a training loop logs                      |     |
   tuning.py         how many workers and slots: pure rules                 |     |
   control.py        applies them every half second, from the step          |     |
                                                                            |     v
 worker/   in each worker (a process or a thread)                           |
   loop.py           takes the task; replies Done(number, slot, ...) -------+
   batch.py          worker_obj[indices], written once into its slot

 common/   what both sides share: protocol.py (every message and hand-over, as types),
   wire.py (how messages cross a pipe), layout.py (the bytes of a slot), segments.py (the
   ring's memory), ragged.py (variable-size items), board.py (which batch a worker builds, the
   evidence a death is charged on), lifeline.py (a worker never outlives its consumer),
   errors.py

Imports run one way: trainer/ -> worker/ (it starts the workers) -> common/. Nothing in the
engine imports the front ends above it (``shmseq.sequence``, ``shmseq.torch``, ...).
"""
