"""``rules.window.Window``: the rows a member reads, and its crop, reproduce the serial op exactly.

For every 1-D convolution, transposed convolution and nearest upsampling of the sweep (lengths 5, 12,
kernels 1-3, strides 1-3, padding 0-2, dilation 1-2, output padding, 1-4 members, so uneven tiles,
empty tiles and tiles thinner than the halo), each member's output rows, computed from its window of
input rows (zeros outside the tensor) with padding 0 and cropped, equal the serial op's rows.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from soybean.rules.window import Window
from soybean.tiling import chunk_range

pytestmark = pytest.mark.unit


def _window_rows(x: torch.Tensor, s: int, e: int) -> torch.Tensor:
    out = x.new_zeros(*x.shape[:-1], e - s)
    lo, hi = max(s, 0), min(e, x.shape[-1])
    if hi > lo:
        out[..., lo - s:hi - s] = x[..., lo:hi]
    return out


def _check(w: Window, x: torch.Tensor, ref: torch.Tensor, local: object) -> int:
    checked = 0
    for p in (1, 2, 3, 4):
        for k in range(p):
            a, b = chunk_range(ref.shape[-1], p, k)
            if a == b:
                continue
            s, e = w.members(p)[k]
            out = local(_window_rows(x, s, e))  # type: ignore[operator]
            start, length, rows = w.crop(p, k)
            assert out.shape[-1] == rows and 0 <= start and start + length <= rows, (w, p, k)
            torch.testing.assert_close(out[..., start:start + length], ref[..., a:b], msg=lambda m: f"{w} p={p} k={k}")
            checked += 1
    return checked


def test_conv_and_transposed_windows_are_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for n, k, st, q, dil in itertools.product((5, 12), (1, 2, 3), (1, 2, 3), (0, 1, 2), (1, 2)):
        ext = dil * (k - 1) + 1
        x, wt = torch.randn(1, 1, n, generator=gen), torch.randn(1, 1, k, generator=gen)
        if n + 2 * q >= ext and q <= (k - 1) * dil:
            ref = F.conv1d(x, wt, stride=st, padding=q, dilation=dil)
            w = Window(0, 2, n, ref.shape[-1], "conv", st, q, ext)
            checked += _check(w, x, ref, lambda r: F.conv1d(r, wt, stride=st, dilation=dil))
        for out_pad in range(max(st, dil)):
            if q > dil * (k - 1):
                continue
            ref = F.conv_transpose1d(x, wt, stride=st, padding=q, output_padding=out_pad, dilation=dil)
            w = Window(0, 2, n, ref.shape[-1], "transposed", st, q, ext)
            checked += _check(w, x, ref, lambda r: F.conv_transpose1d(r, wt, stride=st, dilation=dil))
    assert checked > 1000


@pytest.mark.parametrize("n,r", [(5, 2), (7, 3), (4, 1)])
def test_nearest_windows_are_exact(n: int, r: int) -> None:
    x = torch.randn(1, 1, n)
    ref = F.interpolate(x, scale_factor=r, mode="nearest")
    w = Window(0, 2, n, n * r, "nearest", r)
    assert _check(w, x, ref, lambda rows: F.interpolate(rows, scale_factor=r, mode="nearest")) > 0


def test_halo_rows_count_each_direction() -> None:
    """A stride-2 conv (kernel 3, padding 1) of 8 rows on 2 members: member 1 reads one row of member 0
    forward (rows 3..7), nobody reads member 1's rows; backward the gradient of that row goes to member 0."""
    w = Window(0, 0, 8, 4, "conv", 2, 1, 3)
    assert w.members(2) == ((-1, 4), (3, 8))
    assert (w.halo_rows(2), w.sources(2)) == (1, 1)
    assert (w.halo_rows(2, backward=True), w.sources(2, backward=True)) == (1, 1)
