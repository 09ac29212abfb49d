"""What crosses between the engine's parts (engine/common/protocol.py): every message, as the
side that sends it makes it and the side that reads it gets it, and the user's objects'
contracts (``Worker`` with ``Hooks``, ``Plan``).

The messages to a worker are written, as the pool writes them, into the task pipe of a real
worker loop (``worker_loop``, in a thread, as the pool's thread workers run); its answers are
read back from its reply pipe, as the pool reads them. All of a test's messages are queued
before the worker starts, so that its first read takes them all: the order it answers in is
then the protocol's (what overtakes what), not the test's timing.
"""
from __future__ import annotations

import ast
import inspect
import os
import pickle
import select
import threading
import time
import typing
from multiprocessing import connection

import numpy as np
import pytest

from shmseq.engine.common import protocol
from shmseq.engine.common.hooks import WorkerStart
from shmseq.engine.common.layout import read_batch
from shmseq.engine.common.protocol import (Attached, Build, Built, Counted, Done, Ended,
                                           ErrorReport, Failed, Hooks, InitFailed, MapRing,
                                           Noted, Overflow, Place, Plan, Ready, Rebuild, Skipped,
                                           Stop, TakeWorker, Worker)
from shmseq.engine.common.wire import FrameReader, framed
from shmseq.engine.trainer.plan import EpochPlan, SamplerPlan, as_index_array
from shmseq.engine.trainer.ring import Ring
from shmseq.engine.worker.batch import StreamEnded
from shmseq.engine.worker.loop import WorkerInfo, worker_loop
from workers import FailingInit, IndexWorker

WAIT_S = 30  # the most a test waits for a worker's answers; never reached when it answers


def indices(first: int) -> np.ndarray:
    return np.arange(first, first + 4, dtype=np.int64)


class TalkingWorker:
    """A worker as ``protocol.Worker`` allows it, every optional hook given: it skips a sample
    of the batch whose first sample is 0 and counts two remote requests for each batch; batch
    4's fails, batch 8's stream has ended, batch 12's is larger than a 4 KiB slot."""

    def __getitem__(self, batch):
        first = int(batch[0])
        self.last = first
        if first == 4:
            raise TypeError("sample 4 is bad")
        if first == 8:
            raise StreamEnded
        if first == 12:
            return np.zeros(10_000, np.uint8), batch
        return batch

    def pop_skipped(self):
        return ["sample 0: unreadable"] if getattr(self, "last", None) == 0 else []

    def pop_counts(self):
        return {"remote_requests": 2}


class WorkerThread:
    """A worker loop on a thread of its own with its two pipes: ``send`` queues messages in its
    task pipe (before ``start``: all taken by its first read), ``answers`` reads its replies."""

    def __init__(self, worker, messages=(), wid: int = 0) -> None:
        self._tasks_out, self._tasks_in = connection.Pipe(duplex=False)
        self._results_out, self._results_in = connection.Pipe(duplex=False)
        self.replies = FrameReader(self._results_out.fileno())
        self.send(*messages)
        self.thread = threading.Thread(
            target=worker_loop, name=f"shmseq-test-worker-{wid}", daemon=True,
            args=(worker, self._tasks_out, self._results_in, WorkerInfo(wid, 1, wid), WorkerStart(),
                  None))

    def send(self, *messages) -> None:
        for message in messages:
            self._tasks_in.send_bytes(framed(message)[4:])  # framed as Connection frames

    def start(self) -> "WorkerThread":
        self.thread.start()
        return self

    def answers(self, count: int) -> list:
        got: list = []
        deadline = time.monotonic() + WAIT_S
        while len(got) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"the worker answered {got} only"
            select.select([self.replies.fd], [], [], left)
            got += self.replies.read()
        assert len(got) == count, f"more answers than {count}: {got}"
        return got

    def quiet(self) -> bool:
        """Whether nothing more came (a short look: what was due came with the last answers)."""
        ready, _, _ = select.select([self.replies.fd], [], [], 0.05)
        return not ready

    def close(self) -> None:
        """The consumer closes the pipes: the worker leaves."""
        self._tasks_in.close()
        if self.thread.is_alive() or self.thread.ident is not None:
            self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the worker did not leave once its pipes closed"
        for end in (self._tasks_out, self._results_out, self._results_in):
            end.close()


@pytest.fixture
def ring():
    ring = Ring.create(4, 4096, wake=lambda: None)
    yield ring
    ring.close()


def same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


# -- every message, over a pipe -------------------------------------------------------------------
REPORT = ErrorReport("builtins.KeyError", "3", "Traceback ...", pickle.dumps(KeyError(3)))
SAMPLES = {
    Build: Build(3, 1, indices(8)), Rebuild: Rebuild(3, None, indices(8)),
    MapRing: MapRing("a ring's spec"), Place: Place(2, None), TakeWorker: TakeWorker(b"worker"),
    Stop: Stop(), Ready: Ready(1), Attached: Attached(1), Built: Built(2, 4096),
    Done: Done(3, 1, 640, 0.5, 0.25, 0.125),
    Overflow: Overflow(3, 1, np.arange(10_000, dtype=np.uint8), 0.5, 0.25),
    Failed: Failed(4, 2, REPORT), Ended: Ended(5, None), Skipped: Skipped(6, ["why"]),
    Noted: Noted(6, {"worker_id": 0}),
    Counted: Counted({"remote_requests": 2}), InitFailed: InitFailed(1, REPORT),
}


def test_every_message_kind_is_in_one_direction_and_crosses_a_pipe_as_itself():
    to_worker, from_worker = typing.get_args(protocol.ToWorker), typing.get_args(protocol.FromWorker)
    assert not set(to_worker) & set(from_worker)
    assert set(SAMPLES) == set(to_worker) | set(from_worker), "a message kind without a sample"
    reader, writer = os.pipe()
    try:
        replies = FrameReader(reader)
        for message in SAMPLES.values():
            os.write(writer, framed(message))
            (got,) = replies.read()
            assert type(got) is type(message) and same(tuple(got), tuple(message)), message
    finally:
        os.close(reader)
        os.close(writer)


def test_build_and_done_are_fixed_records_and_the_others_plain_tuples():
    """The two messages every batch costs take no pickling: a ``Done`` is as long whatever its
    values, a ``Build`` grows by 8 bytes an index; the others travel as plain tuples, their
    class never named in the bytes (it would be looked up by name at each end)."""
    assert len(framed(Done(0, 0, 0, 0.0, 0.0, 0.0))) == len(framed(Done(2**40, 7, 10**9, 1e9, 1.5, 3.0)))
    assert len(framed(Build(0, 1, np.arange(8)))) - len(framed(Build(9, None, np.arange(4)))) == 32
    assert b"Build" not in framed(Build(7, 1, [np.arange(2), np.arange(2, 4)]))  # a list: pickled
    for kind, message in SAMPLES.items():
        assert kind.__name__.encode() not in framed(message), kind


# -- a worker's answers -----------------------------------------------------------------------------
def test_a_worker_says_ready_maps_the_ring_then_answers_each_build_in_order(ring):
    worker = WorkerThread(IndexWorker(), [MapRing(ring.spec), Build(0, 0, indices(0)),
                                          Build(1, 1, indices(4))]).start()
    try:
        ready, attached, first, second = worker.answers(4)
        assert (ready, attached) == (Ready(0), Attached(0))
        assert type(first) is Done and type(second) is Done
        assert (first.number, first.slot, second.number, second.slot) == (0, 0, 1, 1)
        assert first.size > 0 and min(first[3:]) >= 0
        assert read_batch(ring.region(1)).tolist() == [4, 5, 6, 7]
        assert worker.quiet()
    finally:
        worker.close()


def test_a_rebuild_overtakes_the_builds_queued_before_it_but_not_the_ring(ring):
    worker = WorkerThread(IndexWorker(), [MapRing(ring.spec), Build(0, 0, indices(0)),
                                          Build(1, 1, indices(4)), Rebuild(5, 2, indices(20))])
    try:
        answers = worker.start().answers(5)
        assert [type(a) for a in answers] == [Ready, Attached, Done, Done, Done]
        assert [a.number for a in answers[2:]] == [5, 0, 1]
        assert read_batch(ring.region(2)).tolist() == [20, 21, 22, 23]
    finally:
        worker.close()


def test_stop_overtakes_every_task_queued_before_it_and_the_worker_leaves(ring):
    worker = WorkerThread(IndexWorker(), [MapRing(ring.spec), Build(0, 0, indices(0)),
                                          Build(1, 1, indices(4)), Stop()])
    try:
        assert worker.start().answers(1) == [Ready(0)]
        worker.thread.join(WAIT_S)
        assert not worker.thread.is_alive() and worker.quiet()  # left, with its pipes open
    finally:
        worker.close()


def test_a_batch_built_without_a_slot_is_held_until_place_and_blocks_the_next(ring):
    """Before the ring: ``Built`` tells the batch's size, and the worker builds no other batch
    until ``Place`` says where it goes (a slot, or none: back encoded)."""
    worker = WorkerThread(IndexWorker(), [Build(0, None, indices(0)), Build(1, None, indices(4))])
    try:
        ready, built = worker.start().answers(2)
        assert ready == Ready(0) and type(built) is Built and built.number == 0 and built.size > 0
        assert worker.quiet()  # batch 1 waits for batch 0's place
        worker.send(MapRing(ring.spec), Place(0, 3))
        attached, done, built_next = worker.answers(3)
        assert attached == Attached(0) and (done.number, done.slot) == (0, 3)
        assert read_batch(ring.region(3)).tolist() == [0, 1, 2, 3]
        assert type(built_next) is Built and built_next.number == 1
        worker.send(Place(1, None))
        (overflow,) = worker.answers(1)
        assert type(overflow) is Overflow and (overflow.number, overflow.slot) == (1, None)
        assert read_batch(overflow.payload).tolist() == [4, 5, 6, 7]
    finally:
        worker.close()


def test_a_failure_an_ended_stream_and_a_batch_too_large_each_have_their_answer(ring):
    worker = WorkerThread(TalkingWorker(), [MapRing(ring.spec), Build(1, 1, indices(4)),
                                            Build(2, 2, indices(8)), Build(3, 3, indices(12))])
    try:
        answers = [a for a in worker.start().answers(8) if type(a) is not Counted]
        assert [type(a) for a in answers] == [Ready, Attached, Failed, Ended, Overflow]
        failed, ended, overflow = answers[2:]
        assert (failed.number, failed.slot, ended, overflow.number, overflow.slot) == (
            1, 1, Ended(2, 2), 3, 3)
        report = failed.error
        assert (report.type_name, report.message) == ("builtins.TypeError", "sample 4 is bad")
        assert 'raise TypeError("sample 4 is bad")' in report.traceback  # the worker's own frame
        assert isinstance(pickle.loads(report.pickled), TypeError)
        payload, batch = read_batch(overflow.payload)
        assert len(payload) == 10_000 and batch.tolist() == [12, 13, 14, 15]
    finally:
        worker.close()


def test_counted_and_skipped_come_just_before_their_batchs_answer(ring):
    worker = WorkerThread(TalkingWorker(), [MapRing(ring.spec), Build(0, 0, indices(0)),
                                            Build(1, 1, indices(16))])
    try:
        answers = worker.start().answers(7)[2:]
        assert [type(a) for a in answers] == [Counted, Skipped, Done, Counted, Done]
        assert answers[0] == Counted({"remote_requests": 2})
        assert answers[1] == Skipped(0, ["sample 0: unreadable"])
        assert (answers[2].number, answers[4].number) == (0, 1)
    finally:
        worker.close()


def test_a_worker_that_cannot_be_made_says_init_failed_and_nothing_else():
    worker = WorkerThread(FailingInit, [Build(0, None, indices(0))], wid=3)
    try:
        (answer,) = worker.start().answers(1)
        assert type(answer) is InitFailed and answer.wid == 3
        assert answer.error.type_name == "builtins.OSError"
        assert "cannot open the dataset file" in answer.error.message
        worker.thread.join(WAIT_S)
        assert not worker.thread.is_alive() and worker.quiet()
    finally:
        worker.close()


def test_take_worker_is_the_first_message_of_a_worker_started_without_one(ring):
    """A worker started by spawn or forkserver is sent itself pickled, first (the pool does so
    for processes; here a thread reads it the same way)."""
    worker = WorkerThread(None, [TakeWorker(pickle.dumps(IndexWorker())), MapRing(ring.spec),
                                 Build(0, 0, indices(8))])
    try:
        ready, attached, done = worker.start().answers(3)
        assert (ready, attached, done.number) == (Ready(0), Attached(0), 0)
        assert read_batch(ring.region(0)).tolist() == [8, 9, 10, 11]
    finally:
        worker.close()


# -- the user's objects ------------------------------------------------------------------------------
def declared(protocol_class: type) -> dict[str, object]:
    """The members a Protocol class declares: its methods and properties, and its attributes."""
    members = {name: value for name, value in vars(protocol_class).items()
               if callable(value) or isinstance(value, property)}
    members.update(dict.fromkeys(protocol_class.__annotations__))
    return {name: value for name, value in members.items()
            if not name.startswith("_") or name == "__getitem__"}


def test_hooks_is_where_every_optional_hook_of_a_worker_is_looked_up():
    """Every member of ``Worker`` but ``__getitem__`` (the worker is ``obj`` itself) is one of
    ``Hooks``' attributes: the user's own where given, a default otherwise."""
    optional = set(declared(Worker)) - {"__getitem__"}
    assert optional == {"fill_batch", "pop_skipped", "pop_counts", "pop_state", "worker_exit",
                        "dataset", "pickled_parts", "unpicklable"}
    bare = Hooks(IndexWorker())
    assert (bare.fill_batch, bare.dataset, bare.unpicklable) == (None, None, None)
    assert bare.pop_state() is None and bare.worker_exit() is None
    assert (bare.pop_skipped(), bare.pop_counts(), bare.pickled_parts()) == ([], {}, {})
    talking = TalkingWorker()
    talking.last = 0
    given = Hooks(talking)
    assert given.obj is talking and given.pop_skipped() == ["sample 0: unreadable"]
    assert given.pop_counts() == {"remote_requests": 2}
    for name in optional:
        assert hasattr(bare, name), name


@pytest.mark.parametrize("protocol_class", [Worker, Plan])
def test_each_member_of_a_user_objects_protocol_is_documented_and_the_class_says_who_calls(
        protocol_class):
    for name, member in declared(protocol_class).items():
        if member is None:  # an attribute: said in its comment, and in the class's text
            assert name in protocol_class.__doc__ or name in inspect.getsource(protocol_class)
            continue
        function = member.fget if isinstance(member, property) else member
        assert (function.__doc__ or "").strip(), f"{protocol_class.__name__}.{name} says nothing"
    words = {Worker: ["called in that worker's thread", "Made once in each worker"],
             Plan: ["The consumer's thread calls it", "the front end", "in the user's thread"]}
    for said in words[protocol_class]:
        assert said in " ".join(protocol_class.__doc__.split()), said


@pytest.mark.parametrize("make", [
    lambda: EpochPlan(as_index_array(12), 4, shuffle=True, seed=0),
    lambda: SamplerPlan([[0, 1], [2, 3]]),
], ids=["EpochPlan", "SamplerPlan"])
def test_the_engines_plans_are_plans(make):
    """Each plan of the engine has every member ``Plan`` declares, each method taking the
    arguments it declares, by the same names."""
    plan = make()
    for name, member in declared(Plan).items():
        assert hasattr(plan, name), name
        if callable(member) and not isinstance(member, property):
            wanted = list(inspect.signature(member).parameters)[1:]
            assert list(inspect.signature(getattr(plan, name)).parameters) == wanted, name


def test_protocol_imports_nothing_of_shmseq_when_it_runs():
    """Every other part may import it: only the type checker's imports name shmseq."""
    tree = ast.parse(inspect.getsource(protocol))
    checked_only = {id(node) for block in tree.body if isinstance(block, ast.If)
                    and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in checked_only:
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
                alias.name for alias in node.names]
            assert getattr(node, "level", 0) == 0 and not any(
                name.split(".")[0] == "shmseq" for name in names), ast.unparse(node)
