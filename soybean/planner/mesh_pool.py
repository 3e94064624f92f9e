"""The mesh shapes of one planner run searched on several processes at once (``PlanOptions.jobs``).

Each mesh shape's table is built and solved on its own (``planner.solve_plain``, ``solve_on``,
``solve_recompute``): work that shares nothing but the *incumbent*, the best step time found so far, which
prunes a mesh whose lower bound reaches it.  ``each_mesh`` forks ``jobs`` workers, which inherit the capture,
the options and the run's pricing state (nothing is pickled in), each starting with a fresh HiGHS thread scheduler
(``search.highs.fresh_scheduler``), hands them the meshes in order (with few
meshes per worker, one worker from the end of the list, the largest, first), shares the
incumbent through one shared double that a search reads whenever it may prune (so a worker drops a mesh as soon
as another's better plan proves it cannot win), and yields each mesh's outcome as it arrives: its ``planner.Result``
(pickled with its table when it leads when found; else ``light``, without it: a plan that did not lead when
found is worse than one already sent whole, so it cannot be the answer), or the
``SearchError`` its search raised.  One job, or a platform without ``fork``, runs the meshes here, in order.

Exact as the sequential search: a mesh is pruned only by a bound at or above a plan some mesh has found, so the
best plan is the same; which meshes are pruned rather than solved can differ (a worker may start a mesh before
another's better plan arrives).
"""
from __future__ import annotations

import ctypes
import math
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ..mesh import Mesh
from ..search.highs import fresh_scheduler

R = TypeVar("R")

# Below this many graph nodes a mesh's search takes well under a second and a worker's start (fork, its own
# pricing caches) is not repaid: ``jobs`` left to choose runs such models in-process.
PARALLEL_MIN_NODES = 400


def default_jobs(nodes: int, meshes: int) -> int:
    """The workers ``jobs=None`` means: ``SOYBEAN_JOBS`` when set; else this process's cores
    (``os.sched_getaffinity``), at most one per mesh, for a graph of at least ``PARALLEL_MIN_NODES`` nodes on a
    platform that can fork; else 1."""
    if os.environ.get("SOYBEAN_JOBS", "").strip():
        return max(1, int(os.environ["SOYBEAN_JOBS"]))
    if nodes < PARALLEL_MIN_NODES or "fork" not in mp.get_all_start_methods():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, meshes))


# At most this many meshes per worker and one worker starts from the largest (``_forked``): GPT-2 on 8 devices,
# 4 meshes on 2 workers, 4.0 -> 3.4 s; Llama-3-8B on 64 and 1,024 devices (21 and 38 meshes), taken from the end,
# lost the early incumbent: 61 -> 68 s and 111 -> 133 s.
FEW_PER_WORKER = 4


class WorkerError(RuntimeError):
    """A worker failed outside the search (a bug, or killed for memory): its traceback or exit code, and the
    fix."""


Live = Callable[[], "float | None"]  # the incumbent now: the best step time found so far by any mesh, or None


def each_mesh(meshes: Sequence[Mesh], solve: Callable[[Mesh, Live, Callable[[str], None]], R],
              light: Callable[[R], R], value: Callable[[R], float | None], jobs: int,
              say: Callable[[str], None], outcomes: tuple[type[BaseException], ...],
              incumbent: float | None = None,
              after: tuple[Callable[[Callable[[str], None]], Any], Callable[[Any], None]] | None = None,
              finish: Callable[[], None] | None = None,
              ) -> Iterator[tuple[Mesh, R | BaseException]]:
    """``solve(mesh, incumbent, say)`` for every mesh, yielding ``(mesh, outcome)`` (``incumbent()``: the best
    step time found so far, read whenever the search wants it, so a worker learns of another's better plan while it
    searches): the result (``light`` of it
    from a worker) or the exception it raised, when one of ``outcomes`` (a pruned or unfit mesh is an outcome,
    not a failure).  ``value(result)``: the step time a result sets the incumbent to (None: it sets none);
    ``incumbent``: the best found before these meshes; ``say``: progress lines, a worker's passed on here;
    ``after``: ``(work, receive)``: on workers, one worker runs ``work(say)`` (``_forked``'s ``take`` says which and
    when) and this process gets ``receive(its result)`` (the baselines: they fill a core while the most promising
    mesh is searched); in-process, neither is called (the caller runs it).  ``finish()``: run on each worker when
    it has no task left (it stores what the worker learnt: ``route_cache.save``), and waited for up to
    ``FINISH_S``; in-process, not called.  Any other exception propagates (from a worker, as a ``WorkerError``
    carrying its traceback)."""
    if jobs <= 1 or len(meshes) <= 1 or "fork" not in mp.get_all_start_methods():
        best = incumbent

        def now() -> float | None:
            return best

        for m in meshes:
            try:
                r = solve(m, now, say)
            except outcomes as e:
                yield m, e
                continue
            v = value(r)
            best = v if best is None or (v is not None and v < best) else best
            yield m, r
        return
    yield from _forked(meshes, solve, light, value, min(jobs, len(meshes)), say, outcomes, incumbent, after,
                       finish)


# Seconds the main process waits, once every outcome is in, for the workers' ``finish`` before ending them.
FINISH_S = 10.0


def _forked(meshes: Sequence[Mesh], solve: Callable[[Mesh, Live, Callable[[str], None]], R],
            light: Callable[[R], R], value: Callable[[R], float | None], jobs: int, say: Callable[[str], None],
            outcomes: tuple[type[BaseException], ...], incumbent: float | None,
            after: tuple[Callable[[Callable[[str], None]], Any], Callable[[Any], None]] | None,
            finish: Callable[[], None] | None = None) -> Iterator[tuple[Mesh, Any]]:
    ctx = mp.get_context("fork")
    best = ctx.Value("d", math.inf if incumbent is None else incumbent)  # shared; inf: none yet
    # The meshes not yet taken are meshes[lo..hi]; ``after`` is still to run while ``left_after``.
    ends = ctx.Array("i", [0, len(meshes) - 1, int(after is not None)])
    out: Any = ctx.Queue()

    # Few meshes per worker: the largest table is the run's critical path, so one worker starts there (longest
    # first); many: the small meshes first set the incumbent that prunes the rest, in order.
    from_end = len(meshes) <= FEW_PER_WORKER * jobs

    def take(worker: int) -> int | None:
        """The next task of ``worker``: ``after`` (-1), once, first on worker 1 (a long task at the start, while
        worker 0 searches the first meshes, rather than at the end, where it would leave the other worker idle);
        with few meshes, worker 0 takes them from the end of the list (the most axes, the largest tables) and the
        others from the front, else all from the front; then None."""
        with ends.get_lock():
            lo, hi, left_after = ends[0], ends[1], ends[2]
            if left_after and worker == 1:
                ends[2] = 0
                return -1
            if lo <= hi:
                if worker == 0 and from_end:
                    ends[1] = hi - 1
                    return hi
                ends[0] = lo + 1
                return lo
            if left_after:
                ends[2] = 0
                return -1
            return None

    def live() -> float | None:
        with best.get_lock():
            return None if math.isinf(best.value) else best.value

    def work(worker: int) -> bool:
        """The worker's tasks; False when one failed."""
        while (i := take(worker)) is not None:
            def tell(line: str, i: int = i) -> None:
                out.put((i, "say", line))

            try:
                if i < 0:
                    assert after is not None
                    out.put((i, "after", after[0](tell)))
                    continue
                r = solve(meshes[i], live, tell)
            except outcomes as e:
                out.put((i, "raised", _portable(e)))
                continue
            except BaseException:  # a bug: the main process raises it with this traceback
                out.put((i, "failed", traceback.format_exc()))
                return False
            v, leads = value(r), True
            if v is not None:
                with best.get_lock():
                    leads = v <= best.value
                    best.value = min(best.value, v)
            out.put((i, "done", r if leads else light(r)))  # only a plan that leads may be the answer
        return True

    parent = os.getpid()

    def run(worker: int) -> None:
        try:
            _die_with(parent)
            fresh_scheduler()  # the fork copied HiGHS's scheduler (if this process ran it) without its threads
            if work(worker) and finish is not None:
                out.close()
                out.join_thread()  # the outcomes sent before the worker's own epilogue
                finish()
        finally:
            out.close()
            out.join_thread()  # every message flushed before the process ends
            os._exit(0)  # no atexit handlers or finalisers of the parent's objects: they are the parent's

    procs = [ctx.Process(target=run, args=(k,), daemon=True) for k in range(jobs)]
    for p in procs:
        p.start()
    left = len(meshes) + (after is not None)
    try:
        while left:
            try:
                i, kind, payload = out.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or all(p.exitcode is not None for p in procs):
                    code = dead[0].exitcode if dead else 0
                    raise WorkerError(f"a planner worker ended before its mesh was searched (exit code {code}; "
                                      "-9: killed, most often for memory): plan with --jobs 1 (jobs=1)") from None
                continue
            if kind == "failed":
                raise WorkerError(f"a planner worker failed on mesh {meshes[i]}:\n{payload}")
            if isinstance(payload, WorkerError):  # an outcome that could not be sent (``_portable``)
                raise payload
            if kind == "say":
                say(payload)
                continue
            left -= 1
            if kind == "after":
                assert after is not None
                after[1](payload)
                continue
            yield meshes[i], payload
        end = time.monotonic() + FINISH_S
        for p in procs:  # every outcome is in: the workers' ``finish`` gets its time
            p.join(max(0.0, end - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()


# Linux's ``prctl`` option: the signal a process gets when the thread that forked it ends.
PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    """End this worker when ``parent`` ends, however it ends: a parent killed (a timeout's SIGKILL, the kernel's
    out-of-memory killer) never runs ``_forked``'s ``finally``, and its workers would search on, orphaned, holding a
    core and gigabytes each until their meshes ran out (Llama-3-70B: 48 CPU-minutes after its bench's timeout).
    On Linux the kernel sends SIGKILL at the parent's death (``prctl(PR_SET_PDEATHSIG)``; the forking thread is the
    one that joins the workers, so it outlives them); elsewhere a daemon thread checks the parent every second.
    A parent already gone before either was set ends the worker at once."""
    if not (sys.platform.startswith("linux") and _death_signal()):
        _watch(parent)
    if os.getppid() != parent:
        os._exit(1)


def _death_signal() -> bool:
    """Ask the kernel for SIGKILL at the parent's death; False when it cannot be asked or refuses."""
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    def check() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=check, daemon=True).start()


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling (the planner's outcomes define how), else a ``WorkerError`` with its
    message: an outcome the main process cannot read back is a bug to report, not a mesh to skip."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return WorkerError(f"{type(e).__name__} could not be sent from a worker: {e}")
