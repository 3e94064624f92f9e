"""A directory of checkpoints, committed atomically: the filesystem half of :mod:`.checkpoint`.

Layout of a checkpoint root ``R``::

    R/ckpt-000003/            a committed checkpoint: DCP's files, MANIFEST, extra.pt
    R/ckpt-000004/            the newest committed one: what ``latest`` loads
    R/.partial-ckpt-000005/   a save under way, or one a crash interrupted: never loaded

A save writes every file into ``.partial-ckpt-N`` and then renames it to ``ckpt-N``: the rename is the
commit (atomic on one filesystem), so a crash at any moment leaves either the old set or the old set plus
the new one, never a half-written ``ckpt-N``.  ``MANIFEST`` (JSON) records what the checkpoint holds:
every tensor's full shape and dtype (so a load into another model is refused by name), whether the
optimizer and an ``extra`` were saved, and the size of every file (so a file lost or cut short afterwards
is named, not met as an unpickling error deep inside DCP).

Nothing here talks to other ranks: :mod:`.checkpoint` decides which rank calls what.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

MANIFEST = "MANIFEST"
EXTRA = "extra.pt"
FORMAT = "soybean-checkpoint/1"
_NAME = re.compile(r"^ckpt-(\d{6,})$")
_PARTIAL = re.compile(r"^\.partial-ckpt-(\d{6,})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here; the message names the missing or mismatched piece."""


def name(index: int) -> str:
    return f"ckpt-{index:06d}"


def partial_name(index: int) -> str:
    return f".partial-{name(index)}"


def committed(root: Path) -> list[tuple[int, Path]]:
    """The committed checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return sorted(found)


def partials(root: Path) -> list[Path]:
    """Saves under way or interrupted under ``root``."""
    return sorted(p for p in root.iterdir() if _PARTIAL.match(p.name)) if root.is_dir() else []


def next_index(root: Path) -> int:
    """One more than any checkpoint under ``root``, committed or partial (a partial name is never reused
    while its files may still be written)."""
    used = [i for i, _ in committed(root)]
    used += [int(m.group(1)) for p in partials(root) if (m := _PARTIAL.match(p.name))]
    return max(used, default=0) + 1


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is one checkpoint (a MANIFEST, or DCP's ``.metadata`` of an older save)."""
    return (path / MANIFEST).is_file() or (path / ".metadata").is_file()


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The checkpoint a load of ``root`` reads: ``root`` itself when it is one checkpoint, else the newest
    committed one under it; None when there is none (nothing saved yet, or only interrupted saves)."""
    path = Path(root)
    if is_checkpoint(path) or (_NAME.match(path.name) and path.is_dir()):  # one checkpoint (a damaged one too)
        return path
    found = committed(path)
    return found[-1][1] if found else None


def resolve(root: str | os.PathLike[str]) -> Path:
    """:func:`latest`, or :class:`FileNotFoundError` saying what is there instead."""
    found = latest(root)
    if found is not None:
        return found
    path = Path(root)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: the directory does not exist (nothing was saved there)")
    stale = partials(path)
    if stale:
        raise FileNotFoundError(f"no complete checkpoint in {path}: only interrupted saves ({stale[-1].name}); "
                                "save again, or point at another directory")
    raise FileNotFoundError(f"no checkpoint in {path}: it holds no ckpt-NNNNNN directory")


def _fsync(path: Path) -> None:
    """Flush a file's or a directory's entry to disk (a commit must not reach the disk before its files)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory; the rename is still atomic there
        pass
    finally:
        os.close(fd)


def commit(partial: Path, manifest: dict[str, Any]) -> Path:
    """Write ``partial``'s MANIFEST (with every file's size), flush, and rename it to its committed name."""
    files = {p.name: p.stat().st_size for p in sorted(partial.iterdir()) if p.is_file() and p.name != MANIFEST}
    for f in files:
        _fsync(partial / f)
    (partial / MANIFEST).write_text(json.dumps({**manifest, "format": FORMAT, "files": files}, indent=1))
    _fsync(partial / MANIFEST)
    m = _PARTIAL.match(partial.name)
    assert m is not None, partial
    final = partial.parent / name(int(m.group(1)))
    os.rename(partial, final)
    _fsync(partial.parent)
    return final


def prune(root: Path, keep: int | None, current: Path) -> None:
    """Delete committed checkpoints beyond the newest ``keep`` and interrupted saves other than ``current``'s."""
    for p in partials(root):
        shutil.rmtree(p, ignore_errors=True)
    if keep is None:
        return
    if keep < 1:
        raise ValueError(f"keep={keep}: keep at least the checkpoint just saved (keep >= 1), or None for all")
    for _, p in committed(root)[:-keep]:
        if p != current:
            shutil.rmtree(p, ignore_errors=True)


def read_manifest(ckpt: Path) -> dict[str, Any] | None:
    """``ckpt``'s MANIFEST after checking that every file it lists is there at its size; None for a checkpoint
    written before manifests (DCP's files only)."""
    path = ckpt / MANIFEST
    if not path.is_file():
        if not (ckpt / ".metadata").is_file():
            raise CheckpointError(f"{ckpt} is not a checkpoint: it has neither {MANIFEST} nor DCP's .metadata")
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path} is corrupted ({e}): load an older checkpoint of this directory") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is format {manifest.get('format')!r}; this soybean reads {FORMAT}")
    for f, size in manifest["files"].items():
        p = ckpt / f
        if not p.is_file():
            raise CheckpointError(f"checkpoint {ckpt} is incomplete: {f} is missing ({size} bytes when saved)")
        if p.stat().st_size != size:
            raise CheckpointError(f"checkpoint {ckpt} is corrupted: {f} has {p.stat().st_size} bytes, "
                                  f"{size} when saved")
    return manifest


def check_tensors(ckpt: Path, saved: dict[str, dict[str, Any]], here: dict[str, dict[str, Any]]) -> None:
    """Refuse a checkpoint of another model: the same tensor names with the same full shapes.  A dtype may
    differ (DCP converts on load: a bf16-mixed plan's buffers load into an fp32 one)."""
    missing = sorted(set(here) - set(saved))
    extra = sorted(set(saved) - set(here))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"it lacks {', '.join(missing[:3])}" + (f" and {len(missing) - 3} more" if len(missing) > 3
                                                                 else ""))
        if extra:
            parts.append(f"it has {', '.join(extra[:3])}" + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
                         + " that this model does not")
        raise CheckpointError(f"checkpoint {ckpt} is for another model: {'; '.join(parts)}")
    for k, v in here.items():
        if list(saved[k]["shape"]) != list(v["shape"]):
            raise CheckpointError(f"checkpoint {ckpt} is for another model: {k} has shape {list(saved[k]['shape'])} "
                                  f"there, {list(v['shape'])} here")
