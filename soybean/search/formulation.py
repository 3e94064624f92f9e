"""The ILP of a ``Problem`` as arrays: the marginal formulation, with equal strategies of an edge merged.

Variables: ``x[v,s] in {0,1}`` (variable ``v`` takes strategy ``s``) and, per edge ``(u,v)``, ``y[e,r,c] >= 0``
over the edge's row and column classes (``_classes``):

    (one strategy)      sum_s x[v,s] = 1
    (edge marginals)    sum_c y[e,r,c] = sum_{s in r} x[u,s],  sum_r y[e,r,c] = sum_{t in c} x[v,t]
    (memory, optional)  sum_v sum_s m[v,s] x[v,s] <= M
    minimise            sum_v sum_s c[v,s] x[v,s] + sum_e sum_rc K_e[r,c] y[e,r,c]

The marginals imply ``sum_rc y[e,r,c] = 1`` on every edge: each edge's ``y`` is a distribution (``columns``
uses this for its bound).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .problem import Problem


@dataclass(frozen=True)
class Block:
    """One edge's pair columns: ``y[r, c]`` at column ``start + r * cols + c``, its marginal rows at
    ``row``, ``row + 1``, ... (``rows`` of them for the ``u`` side, then ``cols`` for the ``v`` side); ``ri[s]``
    and ``ci[t]`` the class of each of ``u``'s and ``v``'s strategies."""

    edge: tuple[int, int]
    start: int
    row: int
    rows: int
    cols: int
    ri: np.ndarray
    ci: np.ndarray


@dataclass
class Formulation:
    """The LP in column-wise arrays: ``x`` columns first (``x_start[v]``, one per strategy), then ``y``.

    ``rows`` lower/upper bounds; the constraint matrix in coordinate form (``row``, ``col``, ``val``).
    """

    cost: np.ndarray
    offset: float
    row: np.ndarray
    col: np.ndarray
    val: np.ndarray
    row_lo: np.ndarray
    row_hi: np.ndarray
    x_start: np.ndarray        # first x column of each variable; x_start[n] = number of x columns
    blocks: list[Block] = field(default_factory=list)  # the edges with pair columns, in column order

    @property
    def num_col(self) -> int:
        return len(self.cost)

    @property
    def num_row(self) -> int:
        return len(self.row_lo)

    def matrix(self) -> Any:
        """The constraint matrix, compressed by columns (``scipy.sparse.csc_matrix``)."""
        import scipy.sparse as sp

        return sp.csc_matrix((self.val, (self.row, self.col)), shape=(self.num_row, self.num_col))

    def choice(self, values: np.ndarray) -> list[int]:
        """The strategy each variable takes in a solution vector (its largest ``x``)."""
        return [int(np.argmax(values[self.x_start[v]:self.x_start[v + 1]])) for v in range(len(self.x_start) - 1)]

    def values_of(self, choice: list[int]) -> np.ndarray:
        """``choice``'s solution vector (``choice``'s inverse): each variable's ``x`` of its strategy, each edge's pair
        of the two classes taken."""
        out = np.zeros(self.num_col)
        out[self.x_start[:-1] + np.asarray(choice, dtype=np.int64)] = 1.0
        for b in self.blocks:
            u, v = b.edge
            out[b.start + b.ri[choice[u]] * b.cols + b.ci[choice[v]]] = 1.0
        return out

    def integral(self, values: np.ndarray, tol: float = 1e-6) -> bool:
        x = values[:self.x_start[-1]]
        return bool(np.all((x < tol) | (x > 1 - tol)))


def _classes(C: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``C`` with equal rows and equal columns merged: ``(K, ri, ci)`` with ``C[s, t] = K[ri[s], ci[t]]``.

    Strategies of one side that price the edge alike (a matmul's many strategies with one output
    tiling) share its pair variables: ``y`` ranges over classes, and a class's marginal is the sum of
    its members' ``x``.  Exact: an integral ``x`` fixes one class per side and so ``y``; and any
    fractional solution of either form maps to one of the other with the same ``x`` and cost
    (aggregate ``y``, or split it in proportion to the members' ``x``), so the LP bound is unchanged.
    A Llama-3-8B 3-D core has ~1.9 million pair columns before merging."""
    K, ri = _unique_rows(C)
    Kt, ci = _unique_rows(np.ascontiguousarray(K.T))
    return Kt.T, ri, ci


_WEIGHTS = np.random.default_rng(0).random(1 << 16) + 0.5


def _unique_rows(C: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of ``C`` and each row's index into them.  Rows are told apart by a random
    weighted sum (equal rows sum alike), checked exactly; a collision falls back to sorting the rows,
    ten times slower."""
    if C.shape[1] <= len(_WEIGHTS):
        h = (C * _WEIGHTS[:C.shape[1]]).sum(axis=1)
        _, first, inv = np.unique(h, return_index=True, return_inverse=True)
        K = C[first]
        if np.array_equal(K[inv], C):
            return K, inv.reshape(-1)
    K, inv = np.unique(C, axis=0, return_inverse=True)
    return K, inv.reshape(-1)


def _separable(C: np.ndarray) -> bool:
    """``C[s, t] = f(s) + g(t)`` exactly: the edge then needs no pair variables."""
    return bool(np.array_equal(C, C[:, :1] + (C[:1, :] - C[0, 0])))


def formulate(p: Problem) -> Formulation:
    """The arrays of ``p``'s ILP (module docstring), vectorised per edge."""
    sizes = np.array([len(c) for c in p.unary], dtype=np.int64)
    x_start = np.concatenate([[0], np.cumsum(sizes)])
    nx = int(x_start[-1])
    cost_parts = [np.concatenate([np.asarray(c, dtype=float) for c in p.unary])] if p.n else [np.zeros(0)]
    x_cost = cost_parts[0]
    rows_r = [np.repeat(np.arange(p.n), sizes)]            # one-strategy rows: every x with coefficient 1
    rows_c = [np.arange(nx)]
    rows_v = [np.ones(nx)]
    lo = [np.ones(p.n)]
    hi = [np.ones(p.n)]
    nrow, ncol, offset = p.n, nx, 0.0
    blocks: list[Block] = []
    for (u, v), C in p.edges.items():
        C, ri, ci = _classes(C)
        a, b = C.shape
        if a == 1 or b == 1 or _separable(C):  # the edge is linear in the two sides' choices
            x_cost[x_start[v]:x_start[v + 1]] += (C[0] - C[0, 0])[ci]
            x_cost[x_start[u]:x_start[u + 1]] += C[:, 0][ri]
            continue
        base = float(C.min())  # constant offset keeps the LP well scaled
        offset += base
        y = ncol + np.arange(a * b)                        # y[r, c] at column ncol + r * b + c
        cost_parts.append((C - base).ravel())
        ru, rv = nrow + np.arange(a), nrow + a + np.arange(b)
        r_idx, c_idx = np.divmod(np.arange(a * b), b)
        # sum_c y[r,c] - sum_{s in r} x[u,s] = 0  and  sum_r y[r,c] - sum_{t in c} x[v,t] = 0
        rows_r += [ru[r_idx], rv[c_idx], ru[ri], rv[ci]]
        rows_c += [y, y, x_start[u] + np.arange(len(ri)), x_start[v] + np.arange(len(ci))]
        rows_v += [np.ones(a * b), np.ones(a * b), -np.ones(len(ri)), -np.ones(len(ci))]
        lo.append(np.zeros(a + b))
        hi.append(np.zeros(a + b))
        blocks.append(Block((u, v), ncol, nrow, a, b, ri, ci))
        nrow += a + b
        ncol += a * b
    if nx:  # each variable's least cost as a constant, as each edge's: a layout every plan of which pays a forbidden
        # resharding (``graph.PINNED``, 1e30) has it in the offset, not in costs HiGHS reads as infinite (Cohere 2's
        # data-parallel baseline: "error (Unknown)" where it is infeasible).  Every variable has a strategy.
        least = np.minimum.reduceat(x_cost, x_start[:-1])
        x_cost -= np.repeat(least, sizes)
        offset += float(least.sum())
    if p.budget is not None and p.memory is not None:
        rows_r.append(np.full(nx, nrow))
        rows_c.append(np.arange(nx))
        rows_v.append(np.concatenate([np.asarray(m, dtype=float) for m in p.memory]))
        lo.append(np.array([-np.inf]))
        hi.append(np.array([float(p.budget)]))
        nrow += 1
    return Formulation(np.concatenate(cost_parts), offset, np.concatenate(rows_r), np.concatenate(rows_c),
                       np.concatenate(rows_v), np.concatenate(lo), np.concatenate(hi), x_start, blocks)


