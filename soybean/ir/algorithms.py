"""Collective algorithms: their names and their cost (rounds and bytes), the planner's half.

The algorithms run in ``runtime.algorithms``; this module only prices them and imports no runtime.

One collective, several ways to move its bytes.  With ``p`` members, a message of ``m`` bytes (the
kinds table's: the buffer for all-reduce, broadcast and reduce; the full result for all-gather; the full
input for reduce-scatter), ``alpha`` seconds per message round and ``beta`` seconds per byte a member
sends, every algorithm takes ``rounds * alpha + bytes * beta`` (``terms`` gives both), where ``bytes`` is
what the busiest member sends over the rounds (a member sends to two neighbours at once in one round; the
links are full duplex):

==============  ==========================  =============================================================
collective      algorithm                   rounds, bytes
==============  ==========================  =============================================================
broadcast,      lp (chain, k chunks)        ``p - 2 + k``, ``(p - 2 + k) m / k``  (Linear Pipelining,
reduce                                      arXiv 1611.04255: nearly independent of ``p`` for large ``m``)
                tree (binomial, MST)        ``L``, ``L m``  with ``L = ceil(log2 p)``
                ring (scatter + all-gather) ``2 (p - 1)``, ``2 (p - 1) / p m``  (van de Geijn; reduce:
                                            reduce-scatter + gather)
all_reduce      lp (reduce down the chain,  ``2 p - 3 + k``, ``(2 p - 3 + k) 2 m / k``  (``p = 2``: ``k + 1``,
                broadcast back, overlapped) ``(k + 1) m / k``)
                ring                        ``2 (p - 1)``, ``2 (p - 1) / p m``
                tree (recursive doubling)   ``l``, ``l m``  with ``l = log2 p``; otherwise ``p`` folds onto a
                                            power of two first: ``floor(log2 p) + 2`` rounds
all_gather,     lp (every block down the    ``p - 1``, ``(p - 1) d m / p``  with ``d = 2`` sends a round
reduce_scatter  chain both ways)            (``p = 2``: 1)
                ring                        ``p - 1``, ``(p - 1) / p m``
                tree (binomial gather +     ``2 L``, ``((p - 1) / p + L) m``  (reduce-scatter: binomial
                broadcast)                  reduce + scatter)
==============  ==========================  =============================================================

``backend`` is ``torch.distributed``'s own call (NCCL picks its ring or tree itself; gloo its own); the
cost model prices it with the ring formula and the profile's figures for that collective.  For ``lp``
the chunk count minimising ``(L + k)(alpha + c beta m / k)`` is ``k* = sqrt(L c beta m / alpha)`` (the
paper's ``sqrt((p - 2) beta n / alpha)`` for broadcast), rounded to the better neighbour (``lp_chunks``).
"""
from __future__ import annotations

import numpy as np

__all__ = ["ADJOINT", "ALGORITHMS", "BACKEND", "BACKEND_ALGO", "COLLECTIVES", "MAX_CHUNKS", "P2P", "Algo", "check",
           "lp_chunks", "terms"]

BACKEND = "backend"
P2P = ("lp", "ring", "tree")                      # the algorithms soybean runs on point-to-point messages
ALGORITHMS = (BACKEND, *P2P)
COLLECTIVES = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter")
ADJOINT = {"broadcast": "reduce", "reduce": "broadcast", "all_gather": "reduce_scatter",
           "reduce_scatter": "all_gather", "all_reduce": None}
MAX_CHUNKS = 64  # one round costs a Python call: past this the rounds' latency outweighs any pipelining
Algo = tuple[str, int]                            # (algorithm, lp chunk count) as a generated program passes it
BACKEND_ALGO: Algo = (BACKEND, 1)


def check(algorithm: str) -> str:
    """``algorithm`` if it is one soybean runs, else a ``ValueError`` naming the choices."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown collective algorithm {algorithm!r}: choose from {', '.join(ALGORITHMS)}")
    return algorithm


# ---- the cost of each algorithm (module docstring) -----------------------------------------


def _log2(p: np.ndarray) -> np.ndarray:
    return np.ceil(np.log2(np.maximum(p, 1)))


def _lp_shape(collective: str, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(L, c)`` of an lp collective: rounds ``L + k``, each sending ``c m / k`` bytes."""
    if collective == "all_reduce":
        return np.where(p <= 2, 1.0, 2 * p - 3), np.where(p <= 2, 1.0, 2.0)
    return np.maximum(p - 2, 0.0), np.ones_like(p)


def lp_chunks(collective: str, m: np.ndarray | float, p: np.ndarray | int, alpha: float, beta: float | np.ndarray,
              elements: np.ndarray | int | None = None) -> np.ndarray:
    """The chunk count ``k`` in ``[1, MAX_CHUNKS]`` (and at most ``elements``) that minimises the lp cost."""
    m_, p_ = np.asarray(m, dtype=float), np.asarray(p, dtype=float)
    L, c = _lp_shape(collective, p_)
    k = np.sqrt(L * c * beta * m_ / alpha) if alpha > 0 else np.full_like(m_, float(MAX_CHUNKS))
    hi = np.full_like(k, float(MAX_CHUNKS)) if elements is None else np.clip(np.asarray(elements, float), 1, MAX_CHUNKS)
    lo_k, hi_k = np.clip(np.floor(k), 1, hi), np.clip(np.ceil(k), 1, hi)
    cost = lambda kk: (L + kk) * (alpha + c * beta * m_ / kk)  # noqa: E731
    return np.where(cost(lo_k) <= cost(hi_k), lo_k, hi_k).astype(np.int64)


def terms(collective: str, algorithm: str, m: np.ndarray | float, p: np.ndarray | int,
          chunks: np.ndarray | int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``(rounds, bytes)`` of one collective (module docstring's table): it takes ``rounds alpha + bytes beta``.
    Elementwise over arrays of ``m`` and ``p``; nothing on a group of one."""
    m_, p_ = np.asarray(m, dtype=float), np.asarray(p, dtype=float)
    k = np.asarray(chunks, dtype=float)
    L = _log2(p_)
    if algorithm == BACKEND or algorithm == "ring":
        f = 2.0 if collective == "all_reduce" else 1.0
        if collective in ("broadcast", "reduce"):
            rounds, sent = (L, L * m_) if algorithm == BACKEND else (2 * (p_ - 1), 2 * (p_ - 1) / p_ * m_)
        else:
            rounds, sent = f * (p_ - 1), f * (p_ - 1) / p_ * m_
    elif algorithm == "lp":
        if collective in ("all_gather", "reduce_scatter"):
            rounds, sent = p_ - 1, (p_ - 1) * np.where(p_ <= 2, 1.0, 2.0) * m_ / p_
        else:
            Lp, c = _lp_shape(collective, p_)
            rounds, sent = Lp + k, (Lp + k) * c * m_ / k
    elif algorithm == "tree":
        if collective == "all_reduce":
            pof2 = np.exp2(np.floor(np.log2(np.maximum(p_, 1))))
            rounds = np.floor(np.log2(np.maximum(p_, 1))) + np.where(pof2 < p_, 2.0, 0.0)
            sent = rounds * m_
        elif collective in ("all_gather", "reduce_scatter"):
            rounds, sent = 2 * L, ((p_ - 1) / p_ + L) * m_
        else:
            rounds, sent = L, L * m_
    else:
        raise ValueError(check(algorithm))
    on = p_ > 1
    return np.where(on, rounds, 0.0), np.where(on, sent, 0.0)
