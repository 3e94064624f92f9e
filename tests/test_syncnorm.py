"""Synchronised batch norm (``runtime.syncnorm``) against serial batch norm where the statistics nearly cancel.

An input whose per-channel mean is large against its spread (LeViT's 8-row norms after a subsample) makes
``sum x^2 / n - mean^2`` and ``sum g x - mean sum g`` small differences of large sums: computed so, float64 tiles
lost nine digits against serial (every LeViT gradient 1.4e-9 off) and float32 backward lost the dot product.  The
member's tile is split along the batch, unevenly: 5 rows over 2 members; over 3 (tiles of 2, 2 and 1 rows); and 3
rows over 4, one tile empty (its statistics were NaN, and so every member's output).
"""
from __future__ import annotations

import pytest
import torch

from soybean.mesh import Mesh
from soybean.runtime import run_threads, use_groups
from soybean.runtime.syncnorm import sb_batch_norm
from soybean.tiling import chunk_range
from soybean.verify.sweep import SLACK

pytestmark = pytest.mark.sim


def _serial(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = torch.nn.functional.batch_norm(x, None, None, w, b, training=True, eps=1e-5)
    y.backward(g)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-11), (torch.float32, 2e-4)])
@pytest.mark.parametrize("p,rows", [(2, 5), (3, 5), (4, 3)])
def test_sync_batch_norm_is_serial_where_the_mean_dwarfs_the_spread(dtype: torch.dtype, rtol: float, p: int,
                                                                    rows: int) -> None:
    torch.manual_seed(0)
    channels = 6
    x = (1e3 + 1e-1 * torch.randn(rows, channels, 4, dtype=torch.float64)).to(dtype)
    w, b = torch.randn(channels, dtype=dtype), torch.randn(channels, dtype=dtype)
    g = torch.randn(rows, channels, 4, dtype=dtype)
    want = _serial(x.double(), w.double(), b.double(), g.double())  # the exact answer, in float64

    def member(rank: int, groups: list) -> tuple[torch.Tensor, ...]:
        lo, hi = chunk_range(rows, p, rank)
        xt, wt, bt = x[lo:hi].clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        with use_groups(groups):
            y = sb_batch_norm(xt, wt, bt, None, None, True, 0.1, 1e-5, axes=(0,), count=rows * 4)
        y.backward(g[lo:hi])
        return y.detach(), xt.grad, wt.grad, bt.grad

    got = run_threads(Mesh((p,)), member, timeout_s=60)
    y, gx = torch.cat([r[0] for r in got]), torch.cat([r[1] for r in got])
    gw, gb = sum(r[2] for r in got), sum(r[3] for r in got)  # partial: the gradient sync sums them
    serial = _serial(x, w, b, g)  # serial batch norm in ``dtype``: the sweep's ``SLACK`` times its distance
    for name, mine, ref, exact in zip(("y", "dx", "dw", "db"), (y, gx, gw, gb), serial, want):
        scale = float(exact.abs().max())
        err, serial_err = float((mine.double() - exact).abs().max()), float((ref.double() - exact).abs().max())
        assert err <= max(rtol * scale, SLACK * serial_err), \
            f"{name}: {err:.3g} off (serial {serial_err:.3g}) of {scale:.3g}"
