"""Route walks kept on disk between planner runs, so that a second ``soybean plan`` does not walk again what
a first one walked.

Pricing a candidate table walks every route between two tilings it meets (``reshard.Route.walk``: the steps and
their collectives): ~140 thousand routes for the first 3-axis mesh of Llama-3-8B, 4.4 s of a 5.9 s table build
(1.5 s with the walks known).  A walk is a function of the two tilings and the gradient axes alone (no shape, mesh
size or profile), so the run's ``cost.pricing.PricingCache`` keeps them as plain data (``state``), and this
module stores that data between runs and adopts it into the next run's state before its first table (``load``).

Each process that walked at least ``MIN_NEW`` new routes merges its state into the file when its work is done
(``save``: under a lock, the file's routes adopted first, then written whole and renamed into place), so the
planner's workers each add theirs.  The file's name is a digest of soybean's own source (``code_key``): any change
to the code reads none of an older file (which is removed when more than ``KEEP`` are there).  A file that cannot
be read is ignored and replaced.  It lives beside the capture cache (``capture_cache.cache_root``) and is skipped
with it (``--no-cache``, ``SOYBEAN_NO_CACHE=1``).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import tempfile
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

from ..capture.cache import cache_root, code_digest
from ..cost.pricing import PricingCache

FORMAT = 1  # bump when ``PricingCache.state`` changes form
MIN_NEW = 1000  # a process that walked fewer new routes leaves the file as it is
KEEP = 4  # files of other code versions kept at most (the newest)


@lru_cache(maxsize=1)
def code_key() -> str:
    """A digest of every source file of the soybean package (``capture_cache.code_digest``) and ``FORMAT``: the
    walks' code and their stored form."""
    return hashlib.sha256(f"format {FORMAT} {code_digest()}".encode()).hexdigest()[:32]


def path() -> Path:
    """The file of this code version's walks."""
    return cache_root() / "routes" / f"{code_key()}.pkl"


def _read(p: Path) -> dict | None:
    try:
        with open(p, "rb") as f:
            data = pickle.load(f)
        return data["state"] if data.get("key") == code_key() else None
    except Exception:  # absent, half written by a process killed mid-write, or another form: walk afresh
        return None


def load(pricing: PricingCache) -> int:
    """The stored walks adopted into ``pricing`` (a run's state before its first table); how many routes it holds
    now (``save``'s baseline)."""
    if (state := _read(path())) is not None:
        pricing.adopt(state)
    return pricing.routes()


@contextlib.contextmanager
def _locked(p: Path) -> Iterator[None]:
    """``p``'s lock file held (two processes saving at once merge one after the other)."""
    try:
        import fcntl
    except ImportError:  # no advisory locks here: the last writer's file stands (each is whole)
        yield
        return
    with open(p.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def save(pricing: PricingCache, loaded: int) -> bool:
    """``pricing``'s walks merged into the stored ones, when it walked ``MIN_NEW`` or more routes past ``loaded``
    (what ``load`` returned); whether it wrote.  Never raises for the disk: a cache that cannot be written is
    skipped."""
    if pricing.routes() - loaded < MIN_NEW:
        return False
    p = path()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with _locked(p):
            if (state := _read(p)) is not None:
                pricing.adopt(state)  # another process's walks first: the file only grows
            fd, tmp = tempfile.mkstemp(dir=p.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                pickle.dump({"key": code_key(), "state": pricing.state()}, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, p)
        _prune(p.parent)
        return True
    except OSError:
        return False


def _prune(d: Path) -> None:
    """Files of other code versions beyond the ``KEEP`` newest removed."""
    old = sorted((f for f in d.glob("*.pkl") if f.name != path().name), key=lambda f: f.stat().st_mtime)
    for f in old[:max(0, len(old) - KEEP)]:
        with contextlib.suppress(OSError):
            f.unlink()
            f.with_suffix(".lock").unlink(missing_ok=True)
