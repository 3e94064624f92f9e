"""Complex views: ``view_as_complex`` (a float ``(..., 2)`` tensor seen as complex ``(...)``) and its inverse
``view_as_real``; the parts of a complex tensor (``real``, ``imag``); the discrete Fourier transforms.

The trailing pair of real and imaginary parts is never split (a device would hold half of a number):
every other dim keeps its number on both sides.  Both are linear over the reals: ``P -> P`` (a pending sum
of complex numbers is the pending sums of their parts).  Rotary embeddings written with complex
multiplication (Llama's reference code, torchtitan's ``apply_rotary_emb``) view queries and keys this way.
"""
from __future__ import annotations

from ._common import Args, Shard, dims_arg, partial_strategies
from .base import ELEMENTWISE, VIEW, OpSpec, Strategy1D, register


@register("aten.view_as_complex.default", family="complex", cost=VIEW)
def view_as_complex(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.tensor("self")
    found = [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim - 1)]
    return found + partial_strategies(a, [["self"]])


@register("aten.view_as_real.default", "aten.real.default", "aten.imag.default", family="complex", cost=VIEW)
def view_as_real(op: OpSpec) -> list[Strategy1D]:
    """Every dim splits (``view_as_real``'s new trailing pair, and ``real(z)[i] = Re z[i]``, keep each number
    where it was); linear over the reals (``P -> P``)."""
    a = Args(op)
    x = a.tensor("self")
    found = [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim)]
    return found + partial_strategies(a, [["self"]])


@register("aten.fft_fftn.default", "aten.fft_fft.default", "aten.fft_ifftn.default", "aten.fft_ifft.default",
          family="complex", cost=ELEMENTWISE)
def fft(op: OpSpec) -> list[Strategy1D]:
    """``X[k] = sum_n x[n] exp(-2 pi i k n / N)`` along the transformed dims (``dim``: all of them when None;
    ``fft``/``ifft``: one, the last by default): each output element reads every element of its input along
    them, so only the other dims split (each line transformed where it lies); linear (``P -> P``: a transform of
    a pending sum is the pending sum of the transforms).  FNet mixes tokens with a 2-D transform over sequence and
    hidden dims: its batch splits."""
    a = Args(op)
    x = a.tensor("self")
    dims = dims_arg(a["dim"], x.ndim)  # fftn's None: every dim (with ``s`` given, more than it transforms)
    found = [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim) if d not in dims]
    return found + partial_strategies(a, [["self"]])
