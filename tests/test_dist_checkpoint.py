"""A sharded checkpoint written under one plan loads under another (gloo, 2 ranks).

Hidden size 9 over 2 ranks: the split weights and biases are uneven tiles (5 and 4 rows), the
case where DCP's shard offsets and sizes must follow soybean's chunking.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples.models import mlp
from soybean.runtime.launch import spawn

pytestmark = pytest.mark.dist


HIDDEN = 9  # odd: over 2 ranks every split dim is cut 5 + 4


def _save_then_load(rank: int, world: int, path: str) -> tuple[bool, bool, list[tuple[int, ...]]]:
    """Save under MP (uneven tiles); load under DP (replicated) and under a fresh MP (uneven again).

    Returns whether each load reproduced the saved full tensors, and this rank's saved tile shapes.
    """
    import soybean

    model, (x, y) = mlp(batch=8, hidden=HIDDEN, layers=1)
    a = soybean.parallelize(model, (x, y), devices=world, mode="mp")  # weights and biases split
    for p in a.parameters():
        with torch.no_grad():
            p.add_(1.0)  # something the serial model does not have
    want = a.full_state_dict()
    a.save_sharded(path)
    loaded = []
    for mode, seed in (("dp", 3), ("mp", 4)):  # replicated, then split again into uneven tiles
        other, _ = mlp(batch=8, hidden=HIDDEN, layers=1, seed=seed)
        b = soybean.parallelize(other, (x, y), devices=world, mode=mode)
        b.load_sharded(path)
        got = b.full_state_dict()
        loaded.append(all(torch.equal(got[k], v) for k, v in want.items()))
    return loaded[0], loaded[1], [tuple(p.shape) for p in a.parameters()]


@pytest.mark.dist
def test_checkpoint_loads_under_another_plan(tmp_path: Path) -> None:
    """Both loads equal the saved tensors on both ranks, and the saved tiles really were uneven."""
    results = spawn(_save_then_load, 2, str(tmp_path / "ckpt"), timeout_s=120)
    assert [r[:2] for r in results] == [(True, True), (True, True)]
    shapes0, shapes1 = results[0][2], results[1][2]
    assert any(s0 != s1 for s0, s1 in zip(shapes0, shapes1, strict=True)), f"even tiles: {shapes0}"
