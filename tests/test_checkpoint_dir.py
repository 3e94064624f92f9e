"""Checkpoints in one process (one device, no process group): what a resumed run needs, and what a crash or a
wrong directory does to a load.

A run that saves (model, optimizer, step), is interrupted and resumes from the checkpoint must compute the very
losses of the run that never stopped; a save that dies before its commit leaves the previous checkpoint what a
load reads; a checkpoint that lost a file, one cut short and one of another model are refused naming the piece.
The multi-rank cases (other plans, other world sizes, torchrun restarts) are in ``test_dist_checkpoint.py`` and
``test_faults.py``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import soybean
from soybean.runtime import checkpoint as ckpt
from soybean.runtime import checkpoint_dir as store
from soybean.runtime.checkpoint_dir import CheckpointError

pytestmark = pytest.mark.sim


def _model(seed: int = 0, hidden: int = 12) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 3))
    pm = soybean.parallelize(model, (torch.randn(4, 6),), devices=1)
    return pm, torch.optim.AdamW(pm.parameters(), lr=0.05)


def _step(pm: Any, opt: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
    loss = F.cross_entropy(pm(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_resumed_run_is_the_uninterrupted_run(tmp_path: Path) -> None:
    """Save after step 2 with the optimizer and the step; a fresh model (other initial weights) and a fresh
    AdamW resume from it and compute steps 3..5 bit for bit as the run that went on."""
    pm, opt = _model()
    for s in range(3):
        _step(pm, opt, s)
    assert soybean.latest_checkpoint(tmp_path) is None
    saved_rng = torch.get_rng_state()
    saved = pm.save_sharded(tmp_path, optimizer=opt, extra={"step": 2, "rng": saved_rng})
    assert saved == tmp_path / "ckpt-000001" and soybean.latest_checkpoint(tmp_path) == saved
    assert {p.name for p in saved.iterdir()} >= {store.MANIFEST, store.EXTRA, ".metadata"}
    want = [_step(pm, opt, s) for s in range(3, 6)]
    other, opt2 = _model(seed=7)
    extra = other.load_sharded(tmp_path, optimizer=opt2)
    assert extra["step"] == 2 and torch.equal(extra["rng"], saved_rng)
    assert [_step(other, opt2, s) for s in range(3, 6)] == want
    # without the optimizer the moments restart from zero: the same weights, other losses (the test can fail)
    third, opt3 = _model(seed=7)
    third.load_sharded(tmp_path)
    assert [_step(third, opt3, s) for s in range(3, 6)] != want


def test_keep_and_indices(tmp_path: Path) -> None:
    """``keep`` leaves the newest; indices only grow, past an interrupted save's; one checkpoint loads by path."""
    pm, opt = _model()
    paths = [pm.save_sharded(tmp_path, extra={"i": i}, keep=2) for i in range(4)]
    assert [p.name for p in paths] == [store.name(i) for i in range(1, 5)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.name(3), store.name(4)]
    (tmp_path / store.partial_name(9)).mkdir()  # a save that died
    assert pm.save_sharded(tmp_path, keep=2).name == store.name(10)
    assert not (tmp_path / store.partial_name(9)).exists()  # cleared by the next commit
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.name(4), store.name(10)]
    assert pm.load_sharded(tmp_path / store.name(4)) == {"i": 3}  # one checkpoint, named
    with pytest.raises(CheckpointError, match="one checkpoint, not a directory"):
        pm.save_sharded(tmp_path / store.name(4))
    with pytest.raises(ValueError, match="keep at least"):
        pm.save_sharded(tmp_path, keep=0)


class _Crash(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["writing shards", "before the commit"])
def test_crash_mid_save_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      where: str) -> None:
    """A save that dies while DCP writes its files, or after they are written but before the rename: the
    directory still loads the previous checkpoint, with its values, and the next save succeeds."""
    pm, opt = _model()
    _step(pm, opt, 0)
    pm.save_sharded(tmp_path, optimizer=opt, extra={"step": 0})
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    _step(pm, opt, 1)
    if where == "writing shards":
        real = ckpt.dcp.save

        def dying_save(state: dict, checkpoint_id: str, **kw: Any) -> Any:
            real(state, checkpoint_id=checkpoint_id, **kw)
            (Path(checkpoint_id) / ".metadata").unlink()  # DCP's last file never written
            raise _Crash

        monkeypatch.setattr(ckpt.dcp, "save", dying_save)
    else:
        monkeypatch.setattr(ckpt.store, "commit", lambda *a, **k: (_ for _ in ()).throw(_Crash()))
    with pytest.raises(_Crash):
        pm.save_sharded(tmp_path, optimizer=opt, extra={"step": 1})
    monkeypatch.undo()
    assert [p.name for p in store.partials(tmp_path)] == [store.partial_name(2)]
    fresh, opt2 = _model(seed=3)
    assert fresh.load_sharded(tmp_path, optimizer=opt2) == {"step": 0}
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())
    assert pm.save_sharded(tmp_path, optimizer=opt).name == store.name(3)


def test_damaged_and_foreign_checkpoints_are_named(tmp_path: Path) -> None:
    pm, opt = _model()
    _step(pm, opt, 0)
    path = pm.save_sharded(tmp_path, optimizer=opt)
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"corrupted: {shard.name} has {len(data) // 2} bytes, {len(data)}"):
        pm.load_sharded(tmp_path)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"incomplete: {shard.name} is missing"):
        pm.load_sharded(tmp_path)
    shard.write_bytes(data)
    (path / store.MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="MANIFEST is corrupted"):
        pm.load_sharded(tmp_path)
    (path / store.MANIFEST).unlink()
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        pm.load_sharded(path)

    good = pm.save_sharded(tmp_path / "b", optimizer=opt)
    wider, wopt = _model(hidden=16)
    with pytest.raises(CheckpointError, match=r"another model: 0.weight has shape \[12, 6\] there, \[16, 6\] here"):
        wider.load_sharded(good)
    torch.manual_seed(0)
    deeper = soybean.parallelize(nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3), nn.Linear(3, 3)),
                                 (torch.randn(4, 6),), devices=1)
    with pytest.raises(CheckpointError, match="another model: it lacks 3.bias, 3.weight"):
        deeper.load_sharded(good)
    sgd = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match="holds AdamW's state, not SGD's"):
        pm.load_sharded(good, optimizer=sgd)
    bare = pm.save_sharded(tmp_path / "c")
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        pm.load_sharded(bare, optimizer=opt)
    manifest = json.loads((bare / store.MANIFEST).read_text())
    (bare / store.MANIFEST).write_text(json.dumps({**manifest, "format": "soybean-checkpoint/0"}))
    with pytest.raises(CheckpointError, match="this soybean reads soybean-checkpoint/1"):
        pm.load_sharded(bare)


def test_nothing_to_load(tmp_path: Path) -> None:
    pm, _ = _model()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        pm.load_sharded(tmp_path / "none")
    with pytest.raises(FileNotFoundError, match="holds no ckpt-NNNNNN"):
        pm.load_sharded(tmp_path)
    (tmp_path / store.partial_name(1)).mkdir()
    with pytest.raises(FileNotFoundError, match=r"only interrupted saves \(.partial-ckpt-000001\)"):
        pm.load_sharded(tmp_path)
    assert soybean.latest_checkpoint(tmp_path) is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_older_checkpoint_still_loads(tmp_path: Path) -> None:
    """A checkpoint of DCP's files alone (what ``save_sharded`` wrote before manifests) loads the model."""
    pm, opt = _model()
    _step(pm, opt, 0)
    ckpt.dcp.save(ckpt.sharded_state_dict(pm), checkpoint_id=str(tmp_path / "old"), no_dist=True)
    fresh, _ = _model(seed=5)
    assert fresh.load_sharded(tmp_path / "old") is None
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in pm.state_dict().items())
