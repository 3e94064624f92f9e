"""How the bench times a variant: one training step, the outcome of a timing, and the two protocols.

One training step is ``loss = model(*inputs)`` (or ``loss_fn(model(*inputs[:-1]), inputs[-1])`` with the loss
outside the model), ``loss.backward()``, an AdamW step and ``zero_grad``.  A variant is *built* once (a fresh
model, prepared, with its optimizer: ``Build``), and every rank *agrees* on whether building or stepping it
failed (``Agreement``, through the process group's store: the first error met decides for all, so no rank waits
on a barrier another left; a rank whose variant failed while a peer's did not leaves that peer inside a collective
that never completes, so the free ranks raise ``GroupBroken`` and leave, which closes their connections and frees
it, and the caller starts a new group without that variant).  Each timed step
starts and ends with a barrier and is timed on rank 0's clock.  The protocols differ only in their order:

* ``sequential``: each variant built and timed in turn, twice, in order then in reverse (half the steps each);
  a variant's time is the mean of its two medians, so a steady drift of the machine cancels out;
* ``interleaved``: every variant built and warmed up first, then the variants take turns, ``per_round`` timed
  steps at a time, so drift of a shared machine between turns favours none.
"""
from __future__ import annotations

import functools
import gc
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..run.outputs import LazyFull


class Unavailable(Exception):
    """A variant that cannot run for this model; the message is the reason reported."""


@dataclass
class Measurement:
    """One variant's outcome: a median step time, or ``None`` and the reason."""

    step_s: float | None = None
    reason: str | None = None
    loss: float | None = None                  # first step's loss over the global batch
    times: list[float] = field(default_factory=list)  # every timed step, in order (rank 0's clock)

    @staticmethod
    def failed(err: BaseException) -> Measurement:
        """A null measurement whose reason is ``err`` in one line."""
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        reason = text if isinstance(err, Unavailable) else f"{type(err).__name__}: {text}".rstrip(": ")
        return Measurement(reason=reason[:400])


@dataclass
class Prepared:
    """A variant ready to train: the module to call and the inputs this rank passes."""

    model: nn.Module
    inputs: tuple
    loss_fn: Callable[..., torch.Tensor] | None = None  # the loss computed outside the model (``--loss outside``)
    # a pipeline's forward and backward of the whole batch (``train_step(*inputs, loss_fn=, target=)``): the step
    # calls it instead of ``model(...)`` and ``backward``
    train_step: Callable[..., torch.Tensor] | None = None


Step = Callable[[], torch.Tensor]      # one training step; returns the detached loss
Build = Callable[[str], Step]          # a variant's name -> its freshly built training step


def as_loss(out: Any) -> torch.Tensor:
    """The scalar to call ``backward`` on: the loss itself, or the sum of the (first) output.  A Hugging Face
    ``ModelOutput`` (or any dict) gives its ``loss`` when the model computed one, else its ``logits``; a
    ``LazyFull`` (a split output) its sum, computed on the tiles."""
    if isinstance(out, Mapping):
        out = out["loss"] if out.get("loss") is not None else out.get("logits", next(iter(out.values()), None))
    if isinstance(out, (tuple, list)):
        out = out[0]
    if isinstance(out, LazyFull):  # a split output (soybean's full-batch contract): summed tile by tile, no gather
        return out.float().sum()
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the model returned {type(out).__name__}, not a tensor or a ModelOutput with a loss or logits")
    return out if out.dim() == 0 else out.float().sum()


def training_step(prep: Prepared, lr: float) -> Step:
    """``prep``'s training step with a fresh AdamW of learning rate ``lr``."""
    opt = torch.optim.AdamW(prep.model.parameters(), lr=lr)

    def step() -> torch.Tensor:
        if prep.train_step is not None:
            if prep.loss_fn is None:
                loss = prep.train_step(*prep.inputs, loss_fn=as_loss)
            else:
                loss = prep.train_step(*prep.inputs[:-1], loss_fn=prep.loss_fn, target=prep.inputs[-1])
            opt.step()
            opt.zero_grad()
            return loss.detach()
        out = prep.model(*prep.inputs) if prep.loss_fn is None else prep.model(*prep.inputs[:-1])
        loss = as_loss(out) if prep.loss_fn is None else prep.loss_fn(out, prep.inputs[-1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local value (a replicated loss), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def timed(step: Step, n: int, sync: Callable[[], None]) -> tuple[list[float], torch.Tensor | None]:
    """Seconds of ``n`` steps, ``sync`` (a barrier across ranks, or nothing) before and after each, and the first
    step's loss."""
    times: list[float] = []
    first: torch.Tensor | None = None
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
        first = loss if first is None else first
    return times, first


def measure(step: Step, steps: int, warmup: int, sync: Callable[[], None]) -> Measurement:
    """The median of ``steps`` timed steps after ``warmup`` untimed ones, with the first step's loss."""
    first: torch.Tensor | None = None
    for _ in range(warmup):
        loss = step()
        first = loss if first is None else first
    times, first_timed = timed(step, steps, sync)
    first = first if first is not None else first_timed
    assert first is not None
    return Measurement(step_s=statistics.median(times), loss=float(local_value(first)), times=times)


class GroupBroken(Exception):
    """``variant`` failed on some ranks while others did not come to agree (left inside a collective): the process
    group cannot go on; ``reason`` is the first error met, naming its rank."""

    def __init__(self, variant: str, reason: str) -> None:
        self.variant, self.reason = variant, reason
        super().__init__(f"{variant}: {reason}")

    def __reduce__(self) -> tuple:  # rank 0 returns it through a pickle
        return (GroupBroken, (self.variant, self.reason))


# How long a rank whose variant failed waits for every rank's report before it judges the missing ones stuck in a
# collective (``GroupBroken``).  Ranks failing alike (a variant unavailable for this model) report within moments.
AGREE_GRACE_S = 10.0
_POLL_S = 0.002


class Agreement:
    """Every rank's outcome of each attempt, through the default group's store, never a collective (a peer may be
    stuck in one): each rank posts its error or none, errors numbered as met (``add``); once all posted, the first
    error met decides for all.  When a rank failed and some rank has not posted within ``grace_s``, the attempt is
    *broken* (``GroupBroken``); which of the two it is, is set once for all ranks (``compare_set``)."""

    def __init__(self, world: int, grace_s: float = AGREE_GRACE_S) -> None:
        self.world, self.grace_s, self.attempts = world, grace_s, 0
        self.rank = dist.get_rank() if world > 1 else 0
        self.store = dist.group.WORLD.get_group_store() if world > 1 and dist.group.WORLD is not None else None

    def __call__(self, variant: str, err: BaseException | None) -> str | None:
        """The agreed reason (``None``: every rank succeeded); ``GroupBroken`` when the attempt broke the group."""
        self.attempts += 1
        mine = None if err is None else Measurement.failed(err).reason or type(err).__name__
        if self.store is None:
            return mine
        try:
            return self._agree(f"soybean/bench/{self.attempts}/", mine)
        except GroupBroken as e:
            raise GroupBroken(variant, e.reason) from err
        except Exception as e:  # the store's host (rank 0) left; what it met is in its own report
            raise GroupBroken(variant, f"{mine} (rank {self.rank})" if mine else
                              f"a rank left ({type(e).__name__})") from err

    def _agree(self, key: str, mine: str | None) -> str | None:
        store = self.store
        assert store is not None
        number = int(store.add(key + "errors", 1)) if mine is not None else 0
        store.set(key + str(self.rank), json.dumps([number, mine]))
        since = time.monotonic() if mine is not None else None
        while True:
            posted = {r: json.loads(store.get(key + str(r))) for r in range(self.world) if store.check([key + str(r)])}
            errors = sorted((n, r, reason) for r, (n, reason) in posted.items() if reason is not None)
            verdict = None
            if len(posted) == self.world:
                verdict = store.compare_set(key + "verdict", "", "agreed")
            elif store.check([key + "verdict"]):
                verdict = store.get(key + "verdict")
            elif errors and since is None:
                since = time.monotonic()  # another rank failed: the grace runs from here
            elif since is not None and time.monotonic() - since > self.grace_s:
                verdict = store.compare_set(key + "verdict", "", "broken")
            first = f"{errors[0][2]} (rank {errors[0][1]})" if errors else None
            if verdict == b"broken":
                raise GroupBroken("", first or "a rank did not report")
            if verdict is not None and len(posted) == self.world:
                return first
            time.sleep(_POLL_S)


def mean_over_ranks(world: int, value: float) -> float:
    """The mean of ``value`` over the ranks (a first loss: the global one for an even batch split)."""
    values: list[Any] = [None] * world
    dist.all_gather_object(values, value)
    return statistics.fmean(values)


def release_memory() -> None:
    """Free the last variant's tensors and hand the freed heap back to the OS (glibc's ``malloc_trim``), so every
    variant starts from the same allocator state instead of inheriting the fragments of the one before."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _attempt(agree: Agreement, variant: str, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``fn()`` on every rank, and the reason agreed on when any rank's call failed (``GroupBroken`` when a rank
    was left stuck)."""
    out, err = None, None
    try:
        out = fn()
    except Exception as e:  # a failing variant is reported, the others still run
        err = e
    return out, agree(variant, err)


def sequential(variants: Sequence[str], build: Build, steps: int, warmup: int, world: int,
               grace_s: float = AGREE_GRACE_S) -> dict[str, Measurement]:
    """The ``sequential`` protocol (module docstring): each variant built and measured alone, twice.  ``grace_s``:
    ``Agreement``'s."""
    agree = Agreement(world, grace_s)
    half = max(1, steps // 2)
    passes: list[dict[str, Measurement]] = [{}, {}]
    for p, order in enumerate((variants, variants[::-1])):
        for variant in order:
            m, reason = _attempt(agree, variant, functools.partial(
                lambda v: measure(build(v), half, warmup, dist.barrier), variant))
            if reason is not None:
                passes[p][variant] = Measurement(reason=reason)
            else:
                assert m.loss is not None  # ``measure`` always records the first step's loss
                passes[p][variant] = replace(m, loss=mean_over_ranks(world, m.loss))
            release_memory()
            dist.barrier()
    out: dict[str, Measurement] = {}
    for variant in variants:
        a, b = passes[0][variant], passes[1][variant]
        if a.step_s is None or b.step_s is None:
            out[variant] = a if a.step_s is None else b
        else:
            out[variant] = replace(a, step_s=(a.step_s + b.step_s) / 2, times=a.times + b.times)
    return out


def interleaved(variants: Sequence[str], build: Build, steps: int, warmup: int, rounds: int,
                world: int, grace_s: float = AGREE_GRACE_S) -> dict[str, Measurement]:
    """The ``interleaved`` protocol (module docstring): ``rounds`` turns (0: one timed step per turn).  ``grace_s``:
    ``Agreement``'s."""
    agree = Agreement(world, grace_s)
    built: dict[str, Step] = {}
    failed: dict[str, str] = {}
    first: dict[str, float] = {}

    def warm(variant: str) -> Step:
        step = build(variant)
        first[variant] = float(local_value(step()))
        for _ in range(max(0, warmup - 1)):
            step()
        return step

    for variant in variants:
        step, reason = _attempt(agree, variant, functools.partial(warm, variant))
        if reason is not None:
            failed[variant] = reason
        else:
            built[variant] = step
    times: dict[str, list[float]] = {v: [] for v in built}
    rounds = rounds or steps
    per_round = max(1, steps // rounds)
    for _ in range(rounds):
        for variant in list(built):
            ts, reason = _attempt(agree, variant, functools.partial(
                lambda v: timed(built[v], per_round, dist.barrier)[0], variant))
            if reason is not None:
                failed[variant] = reason
                built.pop(variant)
            else:
                times[variant] += ts
    return {v: Measurement(reason=failed[v]) if v in failed else
            Measurement(step_s=statistics.median(times[v]), loss=mean_over_ranks(world, first[v]), times=times[v])
            for v in variants}
