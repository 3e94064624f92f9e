"""Bucketed parameter-gradient synchronisation (what DDP does, for any plan).

A parameter replicated on mesh axis ``a`` but used by work split over ``a`` gets a
partial gradient on each device of that axis; the serial gradient is their sum.
Summing after the parameter's gradient is accumulated is exact (the sum is
linear and nothing else reads the gradient before the optimizer), so instead of
one all-reduce per use in backward, gradients are packed into buckets of about
``bucket_mb`` and each bucket is all-reduced once per axis, as soon as all its
parameters are ready.

Buckets are fixed up front as DDP fixes them (reverse registration order; a bucket
closes once it reaches its cap; the first cap small, so communication starts early) and
flushed strictly in bucket order, so every rank issues the same collectives in the same order whatever order autograd
finishes the gradients in.  On a process group a bucket reduced over one axis is
all-reduced asynchronously, overlapping the rest of backward; the last bucket's
hook waits for all of them, so gradients are complete when backward returns.

Gradient accumulation (several backward passes before the optimizer step) stays exact: a gradient already summed
by an earlier backward must not be summed again (``n`` ranks would count it ``n`` times).  So a parameter's hook
before accumulation (``Tensor.register_hook``, which sees this backward's gradient before ``AccumulateGrad`` adds
it) sets the earlier gradient ``E`` aside when it is a sum (``_summed``: what the last sum left, untouched since)
and lets this backward's ``G_r`` land alone; the bucket sums ``sum_r G_r`` and adds ``E`` back: ``E + sum_r G_r``,
the serial accumulated gradient.  Passes whose sum is deferred (``defer``, or a caller's ``no_sync``) accumulate
their unsummed parts together, and the next sum sums them once, ``E`` added back after.  It holds one more
gradient per parameter while a backward runs, only where there is an earlier sum.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from .comm import Group, Work


class GradSync:
    def __init__(self, params: Sequence[tuple[nn.Parameter, tuple[int, ...]]], groups: Sequence[Group],
                 bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 reduce_dtype: torch.dtype | None = None) -> None:
        """``reduce_dtype``: all-reduce the gradients in this dtype (a mixed precision policy's compute dtype;
        ``None``: the parameters' own)."""
        self.groups = list(groups)
        self.reduce_dtype = reduce_dtype
        self.buckets: list[list[nn.Parameter]] = []
        self.axes: list[tuple[int, ...]] = []
        self._pending: list[tuple[Work, torch.Tensor, int]] = []
        cap = first_bucket_mb * 2**20
        cur: list[nn.Parameter] = []
        cur_axes: tuple[int, ...] = ()  # read only once ``cur`` holds a parameter
        size = 0.0
        seen: set[int] = set()
        for p, axes in reversed(list(params)):  # backward produces late layers' gradients first
            if not p.requires_grad or id(p) in seen:  # a parameter listed twice would never complete its bucket
                continue
            seen.add(id(p))
            if cur and (axes != cur_axes or p.dtype != cur[0].dtype):  # one bucket is one flat all-reduce
                self.buckets.append(cur)
                self.axes.append(cur_axes)
                cur, size = [], 0.0
            cur.append(p)
            cur_axes = axes
            size += p.numel() * p.element_size()
            # DDP's rule: a bucket closes once it reaches its cap, with the gradient that crossed it.  Closing
            # before that gradient instead would leave the first bucket a lone bias and expose the last layer's
            # weight sum at the end of backward (measured 5% of an MLP step behind DDP).
            if size >= cap:
                self.buckets.append(cur)
                self.axes.append(cur_axes)
                cur, size = [], 0.0
                cap = bucket_mb * 2**20
        if cur:
            self.buckets.append(cur)
            self.axes.append(cur_axes)
        self.where = {id(p): b for b, ps in enumerate(self.buckets) for p in ps}
        # One flat buffer per bucket, kept across steps: a fresh one each step would be
        # page-faulted in every time (as costly as the copy itself on a CPU).
        self._flat: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._ready: list[int] = [0] * len(self.buckets)
        self._next = 0
        self._absent: set[int] = set()  # parameters this backward does not reach (``watch``)
        self._watch: torch.utils.hooks.RemovableHandle | None = None
        self.deferred = False  # ``defer``: summed by ``sync_now``, once per step
        # Each parameter's earlier, already summed gradient, set aside while this backward's is summed (module doc),
        # and the parameters whose gradient is such a sum, untouched since.
        self._earlier: dict[int, torch.Tensor] = {}
        self._summed: set[int] = set()
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for ps in self.buckets for p in ps]
        self.handles += [p.register_hook(self._set_aside(p)) for ps in self.buckets for p in ps]

    def _set_aside(self, p: nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor]:
        """``p``'s hook before accumulation: its earlier gradient set aside, so this backward's lands alone."""
        def hook(g: torch.Tensor) -> torch.Tensor:
            if p.grad is not None and id(p) in self._summed and id(p) not in self._earlier:
                self._earlier[id(p)] = p.grad
                p.grad = None
            self._summed.discard(id(p))  # an unsummed part arrives
            return g

        return hook

    def watch(self, uses: Sequence[torch.Tensor], params: Sequence[nn.Parameter]) -> None:
        """Learn, during the coming backward, which of ``params`` it does not reach: ``uses[i]`` is the tensor
        forward read ``params[i]`` as.  A parameter that only feeds an output the loss ignores (a pooler nobody
        reads) gets no gradient, serially as here; its bucket must not wait for it.  Autograd's multi-grad hook
        (mode ``all``) reports, once backward has computed every gradient it will, which of ``uses`` got none."""
        if self._watch is not None:
            self._watch.remove()  # a forward whose backward never ran
        mine = [(u, p) for u, p in zip(uses, params) if id(p) in self.where and u.requires_grad]
        if not mine:
            self._watch = None
            return

        def seen(grads: Sequence[torch.Tensor | None]) -> None:
            if self._watch is not None:
                self._watch.remove()
                self._watch = None
            for (_, p), g in zip(mine, grads):
                if g is None:
                    self._absent.add(id(p))
                    self._on_grad(p)

        self._watch = torch.autograd.graph.register_multi_grad_hook([u for u, _ in mine], seen, mode="all")

    def check_complete(self) -> None:
        """Raise if the last backward left a bucket unsynchronised (some of its parameters got no
        gradient): their gradients would silently stay unsummed."""
        if self._next == 0 and not any(self._ready):
            return
        missing = [tuple(p.shape) for b in range(self._next, len(self.buckets)) for p in self.buckets[b]
                   if p.grad is None]
        raise RuntimeError(
            f"soybean: the last backward did not reach every parameter whose gradient must be summed across devices "
            f"({len(missing)} without a gradient, shapes {missing[:4]}): every parameter must take part in the loss; "
            "detach or remove unused ones before parallelize")

    def defer(self) -> None:
        """Sum once per step, not per backward: a pipeline schedule runs one backward per microbatch, each
        accumulating into ``grad``, and only the accumulated gradient may be summed (``sync_now`` after the
        schedule).  The hooks then do nothing."""
        self.deferred = True

    @torch.no_grad()
    def sync_now(self) -> None:
        """Every bucket summed now, synchronously, from the gradients accumulated so far (a parameter without one
        sums as zeros and stays without)."""
        for b, ps in enumerate(self.buckets):
            self._absent.update(id(p) for p in ps if p.grad is None)
            self._flush(b)
        self._finish()
        self._ready = [0] * len(self.buckets)
        self._next = 0

    def _on_grad(self, p: torch.Tensor) -> None:
        if self.deferred:
            return
        b = self.where[id(p)]
        self._ready[b] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            self._flush(self._next)
            self._ready[self._next] = 0
            self._next += 1
        if self._next == len(self.buckets):
            self._next = 0  # the next backward starts over
            self._finish()

    @torch.no_grad()
    def _flush(self, b: int) -> None:
        ps = self.buckets[b]
        grads = [self._grad(p).reshape(-1) for p in ps]
        dtype = self.reduce_dtype or grads[0].dtype
        flat = self._flat[b]
        if flat is None or flat.dtype != dtype or flat.device != grads[0].device:
            numel = sum(g.numel() for g in grads)
            flat = self._flat[b] = torch.empty(numel, dtype=dtype, device=grads[0].device)
        if dtype == grads[0].dtype:
            torch.cat(grads, out=flat)
        else:  # reduced in the policy's compute dtype: cast into the bucket, back out in _scatter
            off = 0
            for g in grads:
                flat[off:off + g.numel()].copy_(g)
                off += g.numel()
        axes = self.axes[b]
        starts = [getattr(self.groups[a], "all_reduce_inplace_async", None) for a in axes]
        if all(s is not None for s in starts):
            # In place, axis after axis (a copy per axis would hold two more buckets at once); only the last
            # axis's sum overlaps the rest of backward, each earlier one must finish before the next reads it.
            for start in starts[:-1]:
                start(flat).wait()  # type: ignore[misc]
            self._pending.append((starts[-1](flat), flat, b))  # type: ignore[misc]
            return
        for axis in axes:
            flat = self.groups[axis].all_reduce(flat)
        self._scatter(flat, b)

    @torch.no_grad()
    def _finish(self) -> None:
        for work, flat, b in self._pending:
            work.wait()
            self._scatter(flat, b)
        self._pending.clear()
        self._absent.clear()

    def _scatter(self, flat: torch.Tensor, b: int) -> None:
        off = 0
        for p in self.buckets[b]:
            n = p.numel()
            earlier = self._earlier.pop(id(p), None)
            if id(p) not in self._absent:
                g = self._grad(p)
                g.copy_(flat[off:off + n].view_as(g))
                if earlier is not None:
                    g.add_(earlier)  # the earlier backward's sum, back beside this one's
                self._summed.add(id(p))
            elif earlier is not None:
                p.grad = earlier
            off += n

    def _grad(self, p: torch.Tensor) -> torch.Tensor:
        """``p.grad``, which a bucket's parameters all have once it is ready; zeros for one this backward does
        not reach (summed as nothing, and left without a gradient, as serially)."""
        if id(p) in self._absent:
            return torch.zeros_like(p)
        g = p.grad
        assert g is not None
        return g
