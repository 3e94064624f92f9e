"""One error on every rank, never a hang: what a rank does when it fails and its peers wait for it.

Two situations, two mechanisms.

**Setup** (``soybean.parallelize``: capture, planning, lowering).  Every rank of a distributed call takes part in
a sequence of *exchanges* (``Setup``): ``all_gather_object`` over one gloo group made at the start of the call
(``Setup.open``, before anything can fail on one rank only), each rank sending a value or its error.  Rank 0's
plan is one exchange (``share``); the call's end is another (``finish``).  A rank that fails sends its error at
its next exchange instead (``fail``), whichever exchange its peers are at: every exchange is the same collective
on the same group, so they meet.  Making process groups (``runtime.comm.torch_groups``) is a collective too, so it
starts with an exchange (``checkpoint``): a rank that failed since the last one meets its peers there.  An
exchange that carries an error ends the call on every rank with the error that happened first (each error is
numbered in the group's store as it is met, ``_number``): the failing rank raises its own exception, the others
the same exception rebuilt (its class and message: ``MemoryBudgetError``, ``CaptureError``, ``ValueError``) or,
where it cannot be rebuilt, ``RankFailedError`` naming its rank and type.

**Steps** (forward, backward, ``train_step`` of every module kind).  A rank that fails mid-step cannot tell its
peers through a collective: they wait inside one (torch's pipeline schedule in a ``recv``, a program in an
all-reduce) for a message that never comes.  So the failing rank records ``"Type: message"`` in the default
group's store (``record``) as its exception leaves the guarded region (``guarded``), and its peers learn of it
when their own wait ends, which it does either way: at once when the failing rank's process exits (gloo's
connections close: "Connection closed by peer"), else when the collective timeout runs out (every group soybean
makes waits ``runtime.launch.collective_timeout``, not torch's 30 minutes of ``dist.new_group``).  A peer whose
guarded region fails reads the store and raises ``RankFailedError("rank 1 failed: AttributeError: ...")`` instead
of gloo's error.  (In torch 2.13 nothing else ends a gloo wait: ``ProcessGroup.abort()`` and ``shutdown()``
leave the connections open, so a peer's ``recv`` waits on; measured.)
"""
from __future__ import annotations

import contextvars
import functools
import json
import pickle
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch.distributed as dist

__all__ = ["RankFailedError", "guarded", "record", "recorded", "Setup", "agreed_setup", "current_setup",
           "checkpoint", "describe", "SETUP_WAIT_S"]

# The other ranks wait this long for rank 0's plan (planning 1,024 devices takes minutes), over the setup's own
# group, so the collective timeout can stay short.  A rank that dies closes its connections, so the wait ends at
# once then.
SETUP_WAIT_S = 3600.0
# Keys in the default group's store: a counter numbering the errors met, and each error by its number.
_COUNT = "soybean/failures"
_FAILURE = "soybean/failure/"
# An error's message is cut to this many characters in a record (a store value and a one-line report).
_MESSAGE_CHARS = 2000
# The attribute a recorded exception carries (its number), so a nested guard does not record it twice.
_MARK = "_soybean_failure"

F = TypeVar("F", bound=Callable[..., Any])


class RankFailedError(RuntimeError):
    """Another rank failed first: ``rank`` and its error, ``"Type: message"`` (``None``: the rank is unknown)."""

    def __init__(self, rank: int | None, error: str, here: str | None = None) -> None:
        self.rank, self.error, self.here = rank, error, here
        who = f"rank {rank} failed" if rank is not None else "another rank failed"
        seen = f" (on this rank the wait for it ended with {here})" if here else ""
        super().__init__(f"{who}: {error}{seen}")

    def __reduce__(self) -> tuple:
        return (RankFailedError, (self.rank, self.error, self.here))


def describe(err: BaseException) -> str:
    """``"Type: first line of the message"`` (cut to ``_MESSAGE_CHARS``)."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(err).__name__}: {line}"[:_MESSAGE_CHARS].rstrip(": ")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _store() -> dist.Store | None:
    """The default group's store, or None without a process group of several ranks."""
    if not _distributed():
        return None
    group = dist.group.WORLD
    return group.get_group_store() if group is not None else None


def _number(err: BaseException) -> int | None:
    """``err``'s number among the errors this job met (the store's counter), given once; None when unknown."""
    got = getattr(err, _MARK, None)
    if got is not None:
        return int(got)
    store = _store()
    if store is None:
        return None
    try:
        n = int(store.add(_COUNT, 1))
    except Exception:  # the store's host is gone: nobody can read a record anyway
        return None
    try:
        setattr(err, _MARK, n)
    except AttributeError:  # an exception without a __dict__: numbered again if met again
        pass
    return n


def record(err: BaseException) -> None:
    """Record ``err`` as this rank's failure in the default group's store (best effort: never raises)."""
    store = _store()
    if store is None or getattr(err, _MARK, None) is not None:
        return
    n = _number(err)
    if n is None:
        return
    try:
        store.set(f"{_FAILURE}{n}", json.dumps({"rank": dist.get_rank(), "error": describe(err)}))
    except Exception:  # the store's host is gone
        pass


def recorded(other_than: int | None = None) -> tuple[int, str] | None:
    """The first failure recorded in the store by a rank other than ``other_than``: ``(rank, "Type: message")``;
    None when there is none (or no store to read)."""
    store = _store()
    if store is None:
        return None
    try:
        count = int(store.add(_COUNT, 0))
        for n in range(1, count + 1):
            key = f"{_FAILURE}{n}"
            if not store.check([key]):  # numbered, not yet written (``get`` would wait for it)
                continue
            entry = json.loads(store.get(key))
            if entry["rank"] != other_than:
                return int(entry["rank"]), str(entry["error"])
    except Exception:  # the store's host (rank 0's process) is gone
        return None
    return None


def _note(err: BaseException, text: str) -> None:
    if sys.version_info >= (3, 11):  # notes are new in 3.11; on 3.10 the error goes as it is
        err.add_note(text)


@contextmanager
def guarded() -> Iterator[None]:
    """Run a step's region so that a failure anywhere is one error on every rank (module docstring).

    An exception leaving the region: when another rank recorded a failure, ``RankFailedError`` naming it (chained
    from this rank's, usually the collective that ended); else this rank's own exception, recorded first for its
    peers.  Usable as a decorator.  Without a process group of several ranks it changes nothing."""
    try:
        yield
    except RankFailedError:
        raise
    except Exception as e:
        if not _distributed():
            raise
        me = dist.get_rank()
        if getattr(e, _MARK, None) is None:  # not already recorded by an inner region
            first = recorded(other_than=me)
            if first is not None:
                raise RankFailedError(first[0], first[1], describe(e)) from e
            record(e)
            _note(e, f"(raised on rank {me} of {dist.get_world_size()}; the other ranks raise RankFailedError)")
        raise


# ---- setup: exchanges over a group of the call's own -------------------------------------------------------


@dataclass
class _Failure:
    """One rank's error as an exchange carries it."""

    rank: int
    number: int | None  # the order in which the job met its errors (None: unknown, after every numbered one)
    error: str          # ``describe(err)``
    pickled: bytes | None  # the exception itself, when it pickles

    def rebuilt(self) -> BaseException:
        """The exception as rank ``rank`` raised it (class and message), else ``RankFailedError`` naming it."""
        if self.pickled is not None:
            try:
                err = pickle.loads(self.pickled)
                if isinstance(err, Exception):
                    _note(err, f"(raised on rank {self.rank}; every rank raises it)")
                    return err
            except Exception:  # a class that cannot be rebuilt from what it pickled: named instead
                pass
        return RankFailedError(self.rank, self.error)


def _failure(rank: int, err: BaseException) -> _Failure:
    try:
        pickled: bytes | None = pickle.dumps(err)
    except Exception:  # an exception holding something unpicklable: sent as its text
        pickled = None
    return _Failure(rank, _number(err), describe(err), pickled)


class Setup:
    """The exchanges of one distributed ``parallelize`` call (module docstring).  ``open`` makes its group (every
    rank, at the same point, before anything can fail on one rank only); ``share`` sends a value; ``fail`` sends
    an error and raises; ``finish`` is the call's last exchange; ``close`` frees the group."""

    def __init__(self) -> None:
        self.group: Any = None
        self.rank = 0
        self.settled = False  # an exchange carried an error: every rank knows, no more exchanges

    def open(self) -> None:
        """Make the call's group, when there is a process group of several ranks and none was made yet."""
        if self.group is None and _distributed():
            self.rank = dist.get_rank()
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=SETUP_WAIT_S))

    def _exchange(self, mine: Any) -> list[Any]:
        box: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(box, mine, group=self.group)
        return box

    def _raise_first(self, got: list[Any], own: BaseException | None) -> NoReturn:
        self.settled = True
        fails = [f for f in got if isinstance(f, _Failure)]
        first = min(fails, key=lambda f: (f.number is None, f.number or 0, f.rank))
        if first.rank == self.rank and own is not None:
            raise own
        raise first.rebuilt() from own

    def share(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (by rank); raises the first error when a rank sent one instead."""
        if self.group is None:
            return [value]
        got = self._exchange(value)
        if any(isinstance(f, _Failure) for f in got):
            self._raise_first(got, None)
        return got

    def fail(self, err: BaseException) -> NoReturn:
        """Send ``err`` at this rank's next exchange and raise the error that happened first (``err`` itself when
        it did); without a group, or once an exchange settled the call, ``err`` as it is."""
        if self.group is None or self.settled:
            raise err
        got = self._exchange(_failure(self.rank, err))
        self._raise_first(got, err)

    def checkpoint(self) -> None:
        """An exchange of nothing: every rank got this far, or every rank raises the first error."""
        if self.group is not None and not self.settled:
            self.share(None)

    def finish(self) -> None:
        """The call's last exchange (``checkpoint``); no more after it."""
        self.checkpoint()
        self.settled = True

    def close(self) -> None:
        if self.group is not None:
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # the default group is already gone (a peer left): nothing to free
                pass
            self.group = None


# The ``Setup`` of the ``agreed_setup`` call running in this context (``parallelize`` nests no other).
_SETUP: contextvars.ContextVar[Setup | None] = contextvars.ContextVar("soybean_setup", default=None)


def current_setup() -> Setup:
    """The running ``agreed_setup`` call's ``Setup`` (a fresh one outside any: its exchanges run without the
    call's end)."""
    got = _SETUP.get()
    return got if got is not None else Setup()


def checkpoint() -> None:
    """Inside an ``agreed_setup`` call (``parallelize``), ``Setup.checkpoint``: before a collective whose peers may
    never come (``runtime.comm.torch_groups``: ``dist.new_group`` waits for every rank), so that a rank that failed
    since the last exchange meets its peers there; outside one, nothing."""
    setup = _SETUP.get()
    if setup is not None:
        setup.checkpoint()


def agreed_setup(fn: F) -> F:
    """``fn`` (``parallelize``) with a ``Setup``: ``fn`` calls ``current_setup().open()`` once the process group
    is known and ``share`` for rank 0's plan; an exception on any rank ends the call on every rank with the first
    error, a success ends with ``finish``."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        setup = Setup()
        token = _SETUP.set(setup)
        try:
            try:
                out = fn(*args, **kwargs)
            except Exception as e:
                setup.fail(e)
            setup.finish()
            return out
        finally:
            _SETUP.reset(token)
            setup.close()

    return run  # type: ignore[return-value]
