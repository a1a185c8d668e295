"""Samples are recorded as consumed once the training loop is past them, not when read.

``HiddenStateLoader`` reads ahead: DataLoader worker processes (or the device feed's
builder threads) read samples and build batches while the loop trains. Recording a
sample as consumed (``on_consumed`` keep / delete / move, its claim settled ``done``)
when it is read would lose every batch built ahead if the training process dies. So a
consumer (a worker process, a builder thread, or the training process itself) hands
each sample's ``Delivery`` to its ``Ledger`` instead, numbered 1, 2, ... in read order.
Every batch carries a ``Ticket``: its consumer and the number of its last item. When
the loop asks for the next batch (or calls ``loader.commit()``, or the pass ends), the
loader acknowledges the ticket of the batch it handed out last (how, per kind of
consumer: ``Acknowledgements``).

A claim is never released before its sample is settled, and a training
process that dies (its workers die with it: the watcher ends a worker whose parent is
gone) leaves everything not yet acknowledged claimed by a dead process: the group takes
it over. What was handed out but not acknowledged when a pass ends early (``break``, an
exception) is given back when the pass ends, by persistent workers too (``Acks.end_pass``).
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hidden_state_reader.files.identity import pid_alive
from hidden_state_reader.read.backend import Receipt

if TYPE_CHECKING:
    from hidden_state_reader.reader import Delivery

_WATCH_INTERVAL = 0.05  # seconds between a waiting worker's looks at its acknowledgements
_END_WAIT = 30.0  # seconds the training process waits for its workers to end a pass
_END_LOOK = 0.005  # seconds between its looks meanwhile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ticket:
    """What a batch says about the deliveries in it (a dataclass: pinning leaves it alone).

    Attributes:
        consumer: The worker (or builder thread) that read it.
        last: The ledger number of its last item.
        receipts: From a worker process: the receipts the training process settles for
            it; None when the consumer runs in the training process.
    """

    consumer: int
    last: int
    receipts: Sequence[Receipt] | None


class Ledger:
    """One consumer's deliveries not yet settled, numbered in the order it read them.

    Args:
        acks: A worker process's acknowledgements (it hands out receipts for the
            training process to settle); None for a consumer in the training process.
        consumer: The consumer's number (its worker id or thread index).
    """

    def __init__(self, acks: Acks | None, consumer: int) -> None:
        self.acks = acks
        self.consumer = consumer
        self.pid = os.getpid()  # a ledger copied into a forked worker is not the worker's
        self.handed_out = 0
        self._open: deque[tuple[int, Delivery, bool]] = deque()  # number, delivery, receipt sent
        self._receipts: list[Receipt] = []
        self._lock = threading.Lock()
        self._passes = 0  # passes begun (a persistent worker's k-th is the loop's k-th)
        self._ended = 0  # the last pass end the training process asked for, handled
        self.pass_over = False  # the loop's pass ended: nothing more reaches it

    def hand_out(self, delivery: Delivery | None) -> None:
        """The consumer hands out its next item (None: a position skipped as unreadable).

        After the training process ended the pass (``end_pass_if_asked``) the item goes
        into a batch the loader drops: it is given back at once.
        """
        with self._lock:
            self.handed_out += 1
            if delivery is None:
                return
            if self.pass_over:
                delivery.give_back()
                return
            receipt = delivery.receipt() if self.acks is not None else None
            if receipt is not None:
                self._receipts.append(receipt)
            self._open.append((self.handed_out, delivery, receipt is not None))

    def ticket(self) -> Ticket:
        """The ticket of the batch just built: everything handed out since the last one."""
        with self._lock:
            receipts, self._receipts = self._receipts, []
            in_worker = self.acks is not None
            return Ticket(self.consumer, self.handed_out, receipts if in_worker else None)

    def settle_through(self, last: int) -> None:
        """The training loop is past item ``last``: record it and those before as consumed."""
        with self._lock:
            while self._open and self._open[0][0] <= last:
                _, delivery, receipt_sent = self._open[0]
                if receipt_sent:
                    delivery.release()  # the training process settled it
                else:
                    delivery.commit()
                self._open.popleft()

    def catch_up(self) -> None:
        """In a worker process: settle what the training loop has acknowledged so far."""
        if self.acks is not None:
            self.settle_through(self.acks.of(self.consumer))

    def give_back(self) -> None:
        """Return every delivery not settled: the loop never got past it."""
        with self._lock:
            self._give_back_open()

    def _give_back_open(self) -> None:
        while self._open:
            self._open[0][1].give_back()
            self._open.popleft()

    def finish(self) -> None:
        """Catch up, then give back the rest (a worker's pass or process ends)."""
        self.catch_up()
        self.give_back()

    def begin_pass(self) -> None:
        """A pass starts: settle and give back what an earlier one left, then hand out again.

        A pass end asked for before now is handled by this (a later look of the watcher
        must not end the new pass). A worker slow to start may begin a pass the loop has
        ended already: then ``pass_over`` is set at once.
        """
        asked = 0 if self.acks is None else self.acks.ends_asked()
        self.catch_up()
        with self._lock:
            self._give_back_open()
            self._passes += 1
            self._ended = max(self._ended, asked)
            self.pass_over = asked >= self._passes
        if self.acks is not None:
            self.acks.confirm_end(self.consumer, asked)

    def end_pass_if_asked(self) -> None:
        """In a worker process: end the pass once the training process asked for it.

        Settles what the loop acknowledged, gives back the rest (what it held, what was
        read ahead), gives back at once whatever the worker still reads for the ended
        pass, and tells the training process (``Acks.end_pass`` waits for it).
        """
        if self.acks is None:
            return
        asked = self.acks.ends_asked()  # before the catch-up: acknowledged before asked
        if asked <= self._ended:
            return
        self.catch_up()
        with self._lock:
            if asked <= self._ended:  # a pass began meanwhile and handled it
                return
            self._give_back_open()
            self._ended = asked
            self.pass_over = True
        self.acks.confirm_end(self.consumer, asked)


class Acks:
    """The last item number the training loop acknowledged, per worker, in shared memory.

    Made in the training process before the workers start; they read it.

    Args:
        workers: DataLoader worker processes.
    """

    def __init__(self, workers: int) -> None:
        self._shared = torch.zeros(max(1, workers), dtype=torch.int64).share_memory_()
        # Pass ends: [0, 0] how many the training process asked for; [1, w] how many
        # worker w handled; [2, w] its pid (0 until it reads).
        self._ends = torch.zeros((3, max(1, workers)), dtype=torch.int64).share_memory_()

    def acknowledge(self, ticket: Ticket) -> None:
        """Settle the ticket's receipts here, then tell its worker it may let go."""
        for receipt in ticket.receipts or ():
            receipt.settle()
        self._shared[ticket.consumer] = ticket.last

    def of(self, consumer: int) -> int:
        """The last number acknowledged to ``consumer``."""
        return int(self._shared[consumer])

    def reset(self) -> None:
        """Fresh worker processes number from 1 again."""
        self._shared.zero_()
        self._ends.zero_()

    def ends_asked(self) -> int:
        """How many pass ends the training process has asked for."""
        return int(self._ends[0, 0])

    def confirm_end(self, consumer: int, asked: int) -> None:
        """In worker ``consumer``: pass ends up to ``asked`` are handled."""
        self._ends[2, consumer] = os.getpid()
        self._ends[1, consumer] = asked

    def end_pass(self) -> None:
        """In the training process: persistent workers end the pass; wait until they did.

        Each worker's watcher settles what the loop acknowledged and gives back the rest
        (``Ledger.end_pass_if_asked``), so a sibling's reader of the next pass, or another
        consumer of the group, finds none of it still claimed. A worker that never read
        has nothing to give back; one that is gone gave everything back with its claims.
        """
        asked = self.ends_asked() + 1
        self._ends[0, 0] = asked
        deadline = time.monotonic() + _END_WAIT
        while True:
            left = [w for w in range(self._ends.shape[1]) if self._end_pending(w, asked)]
            if not left:
                return
            if time.monotonic() > deadline:
                log.warning(
                    "DataLoader workers %s did not end their pass within %ss; they give "
                    "back what they hold when they next read",
                    left,
                    _END_WAIT,
                )
                return
            time.sleep(_END_LOOK)

    def _end_pending(self, consumer: int, asked: int) -> bool:
        pid = int(self._ends[2, consumer])
        return int(self._ends[1, consumer]) < asked and pid != 0 and pid_alive(pid)


class Acknowledgements:
    """A dataset's acknowledgements: the shared numbers, and this process's ledgers.

    Inactive (every method does nothing) until a loader that records what its loop
    consumed binds the dataset; kept by the dataset, so worker processes get a copy.
    An acknowledged ticket is settled by its consumer's kind:

    * a consumer in the training process (builder thread, ``num_workers=0``): its ledger
      commits the deliveries at once, in the loop's thread;
    * a worker process: the ticket carries a ``Receipt`` per sample (what ``consumed`` does,
      picklable; the directory backend has them). The training process settles them
      itself, at once: files deleted or moved, claim files marked ``done`` through their
      path; then it publishes the ticket's number in shared memory (``Acks``). The worker,
      which held each claim's lock all along, lets go of the claims it sees acknowledged,
      before each read, from a watcher thread while it waits, and when it exits. A source
      without receipts (the store) is settled by the worker the same way, when it sees the
      acknowledgement.
    """

    def __init__(self) -> None:
        self.active = False
        self.acks: Acks | None = None
        self._ledgers: dict[int, Ledger] = {}

    def __getstate__(self) -> dict[str, object]:
        """What a spawned worker gets: the shared numbers, not this process's ledgers."""
        return {**self.__dict__, "_ledgers": {}}

    def activate(self, workers: int) -> None:
        """Record samples as consumed on acknowledgement; ``workers``: worker processes."""
        self.active = True
        self.acks = Acks(workers) if workers > 0 else None

    def begin_pass(self, fresh_workers: bool) -> None:
        """A pass starts; ``fresh_workers``: new worker processes, numbering from 1 again."""
        if self.acks is not None and fresh_workers:
            self.acks.reset()

    def start(self, consumer: int, in_worker: bool) -> Ledger | None:
        """The ledger ``consumer`` hands its items to this pass (None when inactive).

        A worker process's ledger is watched (``watch_in_worker``); a persistent worker's
        ledger first settles and gives back what its previous pass left.
        """
        if not self.active:
            return None
        ledger = self._ledgers.get(consumer)
        if ledger is None or ledger.pid != os.getpid():  # not one copied into a fork
            ledger = self._ledgers[consumer] = Ledger(self.acks if in_worker else None, consumer)
            if ledger.acks is not None:
                watch_in_worker(ledger)
        ledger.begin_pass()
        return ledger

    def ticket(self, consumer: int) -> Ticket | None:
        """The ticket of the batch just built from ``consumer``'s items, in this process."""
        ledger = self._ledgers.get(consumer)
        if ledger is None or ledger.pid != os.getpid():
            return None
        return ledger.ticket()

    def acknowledge(self, ticket: Ticket | None) -> None:
        """The training loop is past the batch of ``ticket``: its samples are consumed."""
        if ticket is None:
            return
        if ticket.receipts is not None:
            assert self.acks is not None
            self.acks.acknowledge(ticket)
        else:
            self._ledgers[ticket.consumer].settle_through(ticket.last)

    def close_pass(self, workers_stay: bool = False) -> None:
        """A pass ended: its consumers give back what was not acknowledged.

        Args:
            workers_stay: The worker processes outlive the pass (``persistent_workers``):
                they are asked to give back now, and waited for. Workers that exit
                give back as they exit.
        """
        for ledger in self._ledgers.values():
            if ledger.pid == os.getpid() and ledger.acks is None:
                ledger.give_back()
        if workers_stay and self.acks is not None:
            self.acks.end_pass()


def watch_in_worker(ledger: Ledger) -> None:
    """In a worker process: settle what is acknowledged while it waits, and at its exit.

    A daemon thread looks at the acknowledgements every few milliseconds, and ends the
    worker at once when the training process is gone (a worker blocked in a wait for
    new samples would otherwise hold its claims until the wait ends). At a normal exit
    (``multiprocessing`` finalizers) the worker settles what the loop acknowledged last
    and gives back the rest.
    """
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(_WATCH_INTERVAL)
            if os.getppid() != parent:
                os._exit(1)  # the training process died: the kernel releases the claims
            ledger.catch_up()
            ledger.end_pass_if_asked()

    threading.Thread(target=watch, daemon=True, name="hidden-state-acks").start()
    multiprocessing.util.Finalize(None, ledger.finish, exitpriority=10)
