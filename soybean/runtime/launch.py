"""Starting ranks: real processes (:func:`spawn`, :func:`init_from_env`) or threads (:func:`run_threads`).

Whatever goes wrong, these return or raise within their time limit: a rank that
raises is reported with its traceback while the others are killed, a rank that
dies silently is reported with its exit code, and a run that exceeds
``timeout_s`` raises :class:`TimeoutError`.
"""
from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..mesh import Mesh
from .comm import Group, ThreadWorld
from .context import use_groups
from .timeouts import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, collective_timeout, group_timeout

__all__ = ["spawn", "init_from_env", "run_threads", "default_backend", "free_port", "collective_timeout",
           "group_timeout", "DEFAULT_TIMEOUT_S"]

# A rank that exited without posting a result may still have it in the pipe; wait this long.
_DEAD_GRACE_S = 1.0

def default_backend() -> str:
    """``"cpu:gloo,cuda:nccl"`` when CUDA is available, else ``"gloo"``.

    The two-device form makes torch route each collective by the tensor's device:
    NCCL for CUDA tensors, gloo for CPU tensors (plain ``"nccl"`` rejects CPU tensors).
    """
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_process_group(backend: str, rank: int, world_size: int, local_rank: int, timeout_s: float,
                        hosted: bool = False) -> None:
    """The default process group: from torchrun's agent store, from the store ``spawn``'s parent holds
    (``hosted``: ``MASTER_PORT`` names it), else by ``env://``."""
    if "nccl" in backend and torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())  # one GPU per rank
        # NCCL collectives are asynchronous: without its watchdog tearing the process down, a rank whose peer
        # died waits forever inside a kernel whatever the timeout.  On by default in recent torch; a user's
        # own setting is kept.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    timeout = datetime.timedelta(seconds=timeout_s)
    # The groups made later (``group_timeout``: stages, mesh axes) wait as long as the default group.
    os.environ[TIMEOUT_ENV] = repr(float(timeout_s))
    elastic = not hosted and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if hosted or elastic:  # a store someone else holds: spawn's caller, or torchrun's agent
        store: dist.Store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                          is_master=False, timeout=timeout)
        if elastic:
            # Under torchrun every attempt of an elastic restart reaches the same agent store, and env:// reads
            # its keys without telling attempts apart: a restarted rank can read the address a dead peer published
            # in the attempt before and fail to connect ("Gloo connectFullMesh failed ... Connection refused").
            # Keys of our own per attempt keep the attempts apart (and every group made later, which uses this
            # store).
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"soybean/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/attempt-{attempt}", store)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        return
    dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=timeout)


# ---- torchrun ---------------------------------------------------------------------


def init_from_env(backend: str | None = None, timeout_s: float | None = None) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment; returns ``(rank, world_size)``.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
    ``backend=None`` means :func:`default_backend`; ``timeout_s``: how long a collective waits for a peer
    (:func:`collective_timeout`: 300 s unless ``$SOYBEAN_TIMEOUT_S`` says otherwise).  A second call is a no-op.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env: {', '.join(missing)} not set; start the program with torchrun")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _init_process_group(backend or default_backend(), rank, world, int(os.environ.get("LOCAL_RANK", rank)),
                        collective_timeout(timeout_s))
    atexit.register(_teardown)
    return rank, world


def _teardown() -> None:
    """At exit, the process group this module made is destroyed, its pending sums first: each ``TorchGroup``
    waits for its own (``comm.wait_in_flight``), registered after this, so run before it.

    A training script under torchrun seldom destroys it; left to the interpreter's finalisation, the group and
    its store were torn down with a worker thread still joinable and the rank aborted after its last step
    ("terminate called without an active exception"), failing a torchrun run that had finished.  A peer already
    gone is no error at exit."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # the other ranks may have left: nothing to finish
        pass


# ---- local processes --------------------------------------------------------------


# What the fork server imports once for every rank it starts: torch, and the compiler each rank runs
# (``parallelize`` imports ``soybean.api`` on its first call, and capture ``torch.export``'s tracer, which
# ``torch.export`` imports on its first call: 0.5-1 s a rank between them); these only where the caller has imported
# them (its ranks most likely will), with every module of a Hugging Face model it has loaded (``_loaded``).
_PRELOAD = ("torch", "torch.distributed", "soybean", "soybean.runtime.launch", "soybean.api", "torch.export._trace")
_PRELOAD_IF_LOADED = ("transformers", "torch._dynamo", "torch.distributed.pipelining", "accelerate")
_PRELOAD_PACKAGES = ("transformers.models.",)


def _loaded() -> list[str]:
    """The modules of ``_PRELOAD_IF_LOADED`` and under ``_PRELOAD_PACKAGES`` that this process has imported, in
    the order it imported them (a package before its modules)."""
    return [m for m in list(sys.modules) if m in _PRELOAD_IF_LOADED or m.startswith(_PRELOAD_PACKAGES)]


def _context() -> Any:
    """How ranks start: from a fork server, a process that imported torch and soybean once and forks a rank from
    that state (a rank ready in ~0.05 s, where a fresh interpreter spends ~2 s importing torch and soybean, more
    with transformers: most of a short run).  The server itself never runs a torch op or touches CUDA, so a fork of
    it is as clean as a fresh process; each rank still imports the caller's main module and runs with the caller's
    environment as it is at the call (``_worker``).  ``spawn`` where there is no fork server (Windows).

    The server starts at the first call and imports what that call's process has loaded (``_loaded``); a rank
    imports anything else it needs itself (transformers' model modules the caller loads later).  Measured on the
    suite (``py-spy`` over every process): ranks spent 169 s importing, 107 s of it ``soybean.api`` and
    ``torch.export._trace``, 95 s transformers' model modules."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Read when the server starts (the first call): later calls find it running.
    ctx.set_forkserver_preload([*_PRELOAD, *_loaded()])
    return ctx


def _worker(fn: Callable[..., Any], rank: int, nproc: int, port: int, backend: str, timeout_s: float,
            args: tuple, results: Any, environ: dict[str, str] | None = None) -> None:
    """Body of one spawned rank: the caller's environment (a fork server's rank inherits the server's), init, run
    ``fn``, post ``(rank, ok, payload)``."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc))
    try:
        _init_process_group(backend, rank, nproc, rank, timeout_s, hosted=True)
        # Plain pickle copies tensors by value; the queue's own pickler would share
        # them through file descriptors that die with this process.
        payload = pickle.dumps(fn(rank, nproc, *args))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        results.close()
        results.join_thread()  # flush the report, then skip teardown that could block on dead peers
        os._exit(1)
    results.put((rank, True, payload))
    dist.destroy_process_group()


def _stop(procs: list[Any]) -> None:
    """Terminate every still-running rank (SIGTERM, then SIGKILL)."""
    procs = [p for p in procs if p.pid is not None]  # start() may have failed part-way
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


def spawn(fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = 120.0, backend: str = "gloo",
          collective_timeout_s: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``nproc`` new processes (``_context``); return their results by rank.

    Each process gets ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``,
    and an initialised default process group.  The rendezvous store is this process's, bound to a port the OS
    picks as it binds (``MASTER_PORT`` names it): a port found free and bound later by rank 0 (``free_port``) could
    be taken in between by another job's sockets on a busy box ("spawn: rank 0 of 2 failed" when two gloo runs
    started at once).
    ``fn`` must be importable (module level) and its results picklable.  A failing
    rank raises ``RuntimeError`` with its traceback; exceeding ``timeout_s`` raises
    ``TimeoutError``; either way the other ranks are killed.  ``collective_timeout_s``: how long a collective
    waits for a peer (default ``timeout_s``).
    """
    ctx = _context()
    results_q = ctx.Queue()
    waits = timeout_s if collective_timeout_s is None else collective_timeout_s
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=waits),
                          wait_for_workers=False)
    port = store.port
    environ = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(fn, r, nproc, port, backend, waits, args, results_q, environ),
                         name=f"soybean-rank{r}") for r in range(nproc)]
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    dead_since: dict[int, float] = {}
    try:
        for p in procs:
            p.start()
        while len(results) < nproc:
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = sorted(set(range(nproc)) - set(results))
                raise TimeoutError(f"spawn: ranks {waiting} of {nproc} did not finish within {timeout_s:g} s")
            try:
                rank, ok, payload = results_q.get(timeout=min(0.1, left))
            except queue_mod.Empty:
                _check_dead(procs, results, dead_since)
                continue
            if not ok:
                raise RuntimeError(f"spawn: rank {rank} of {nproc} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
        for p in procs:  # ranks are done; give them a moment to exit cleanly
            p.join(max(0.0, min(5.0, deadline - time.monotonic())))
    finally:
        _stop(procs)
        results_q.close()
        results_q.cancel_join_thread()
        del store  # held until every rank is gone: their groups' keys live in it
    return [results[r] for r in range(nproc)]


def _check_dead(procs: list[Any], results: dict[int, Any], dead_since: dict[int, float]) -> None:
    """Raise for a rank that exited without a result (after a grace period for its report)."""
    now = time.monotonic()
    for r, p in enumerate(procs):
        if r in results or p.exitcode is None:
            continue
        if now - dead_since.setdefault(r, now) > _DEAD_GRACE_S:
            raise RuntimeError(f"spawn: rank {r} of {len(procs)} exited with code {p.exitcode} without a result")


# ---- threads ----------------------------------------------------------------------


def run_threads(mesh: Mesh, fn: Callable[[int, list[Group]], Any], timeout_s: float = 60.0) -> list[Any]:
    """Run ``fn(rank, groups)`` for every rank of ``mesh`` as threads sharing a :class:`ThreadWorld`.

    Each thread runs inside ``use_groups(groups)``, so ``sb_*`` calls work.  Returns
    the results by rank; the first exception raised on any rank is re-raised (with
    a note naming the rank) after the others were woken from their collectives.
    """
    world = ThreadWorld(mesh, timeout_s)
    results: list[Any] = [None] * mesh.size
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def body(rank: int) -> None:
        groups = world.groups(rank)
        try:
            with use_groups(groups):
                results[rank] = fn(rank, groups)
        except BaseException as e:  # reported to the caller below
            with lock:
                errors.append((rank, e))
            world.abort(f"rank {rank} failed with {type(e).__name__}: {e}")

    threads = [threading.Thread(target=body, args=(r,), name=f"soybean-rank{r}", daemon=True) for r in range(mesh.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        rank, err = errors[0]
        if sys.version_info >= (3, 11):  # add_note is new in 3.11; on 3.10 the error goes as it is
            err.add_note(f"(raised on rank {rank} of mesh {mesh})")
        raise err
    return results
