"""Causal attention split along the query sequence (issue 23): each tile's causal mask offset by its first row
(``runtime.attention``), priced with the last rows' extra work (``ir.attention.causal_skew``), or computed in the
zig-zag layout that evens the work (``ir.attention.zigzag_*``, the rule's ``"zigzag"`` variant); recorded in the
plan's ``context_parallel`` rows, and training equal to serial."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from soybean.capture.core import capture
from soybean.ir.attention import _work, causal_skew, zigzag_leaving, zigzag_moves, zigzag_rows, zigzag_skew
from soybean.mesh import Mesh
from soybean.plan import Plan
from soybean.planner.core import plan
from soybean.rules.base import expand, make_opspec
from soybean.runtime.launch import run_threads
from soybean.verify.testing import train_parallel_threads, train_serial
from soybean.tiling import R, Shard

pytestmark = pytest.mark.unit


class CausalAttention(nn.Module):
    """One head of causal self-attention over a batch of one long sequence: only its rows can split it."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, -1)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1)).square().mean()


def test_causal_skew_is_the_busiest_chunks_share_of_the_causal_work() -> None:
    """Rows 0-1 of 4 attend to 1 + 2 keys, rows 2-3 to 3 + 4: the last chunk does 7 of 10, 1.4x an even half."""
    assert causal_skew(4, 4, 2) == pytest.approx(1.4)
    assert causal_skew(4, 4, 1) == 1.0
    assert causal_skew(8, 8, 4) == pytest.approx((7 + 8) * 4 / 36)


@pytest.mark.parametrize("rows", [8, 30, 66, 1000])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8, 13])
def test_the_zigzag_layout_gives_each_member_an_early_and_a_late_chunk(rows: int, parts: int) -> None:
    """``zigzag_moves`` is a partition: every row leaves its contiguous tile for exactly the member whose zig-zag
    chunks (``r`` and ``2p - 1 - r`` of ``2p``) hold it; the work is then nearly even where contiguous tiles are
    not, and the closed-form causal work is the sum it stands for."""
    moves = zigzag_moves(rows, parts)
    for d in range(parts):
        got = sorted(i for s in range(parts) for a, b in moves[s][d] for i in range(a, b))
        assert got == sorted(i for a, b in zigzag_rows(rows, parts, d) for i in range(a, b))
    assert sorted(i for s in range(parts) for d in range(parts) for a, b in moves[s][d]
                  for i in range(a, b)) == list(range(rows))
    assert _work(3, 11, 7) == sum(min(i + 1, 7) for i in range(3, 11))
    if rows >= 1000 and parts <= 8:  # 13 parts: 26 chunks of 39 rows but the last of 25, 2.8% off even
        assert zigzag_skew(rows, rows, parts) < 1.02 and (causal_skew(rows, rows, parts) > 1.4 or parts == 1)
    # the most rows a member sends or receives, in closed form, is what the moves send
    sent = [sum(b - a for d in range(parts) if d != s for a, b in moves[s][d]) for s in range(parts)]
    got = [sum(b - a for s in range(parts) if s != d for a, b in moves[s][d]) for d in range(parts)]
    assert zigzag_leaving(rows, parts) == max(sent + got)


def test_a_variant_owns_the_dims_it_splits() -> None:
    """``expand``: the zig-zag variant appears on one axis only, never with another axis splitting the same rows;
    with heads on the other axis it composes.  Non-causal attention has only the ring variant."""
    q = torch.randn(1, 2, 8, 4)
    op = make_opspec(torch.ops.aten.scaled_dot_product_attention.default, (q, q, q), {"is_causal": True},
                     torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    zz = [s for s in expand(op, Mesh((2, 2))) if s.variant == "zigzag"]
    assert zz and all(sum(pl == Shard(2) for pl in s.inputs[0]) == 1 for s in zz)
    assert (Shard(1), Shard(2)) in [s.inputs[0] for s in zz]
    plain = make_opspec(torch.ops.aten.scaled_dot_product_attention.default, (q, q, q), {},
                        torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert {s.variant for s in expand(plain, Mesh((2,)))} == {"", "ring"}  # no causal work to even out


def _zigzag(p: Plan) -> Plan:
    """``p`` with every causal attention whose rows one axis splits (its keys whole there) computed in the zig-zag
    layout."""
    for name, node in p.nodes.items():
        if name.startswith("scaled_dot_product_attention"):
            rows = [a for a, pl in enumerate(node["in"][0]) if pl == "S(2)"]  # the query's rows
            if len(rows) == 1 and node["in"][1][rows[0]] == "R":
                node["variant"] = "zigzag"
    return p


class _Passes:
    """A group that logs the bytes each neighbour exchange brings me (``halo``, as priced) and each all-to-all of
    rows moves in or out of me (``all_to_all``), and delegates them."""

    def __init__(self, inner: object, log: list[tuple[str, float]]) -> None:
        self.inner, self.log = inner, log
        self.size, self.index = inner.size, inner.index  # type: ignore[attr-defined]

    def exchange(self, sends: dict, recv_shapes: dict, like: torch.Tensor) -> dict:
        got = self.inner.exchange(sends, recv_shapes, like)  # type: ignore[attr-defined]
        self.log.append(("halo", float(sum(t.numel() * t.element_size() for t in got.values()))))
        return got

    def all_to_all_rows(self, t: torch.Tensor, send: tuple, recv: tuple) -> torch.Tensor:
        row = t[:1].numel() * t.element_size()
        self.log.append(("all_to_all", float(max(sum(send) - send[self.index], sum(recv) - recv[self.index]) * row)))
        return self.inner.all_to_all_rows(t, send, recv)  # type: ignore[attr-defined]


def _busiest(logs: list[list[tuple[str, float]]]) -> list[tuple[str, float]]:
    """The members' logged calls, aligned: each call's kind and its largest bytes (the busiest member's)."""
    return [(col[0][0], max(m for _, m in col)) for col in zip(*logs)]


def _priced_moves(op: object, st: object, mesh: Mesh) -> list[tuple[str, float]]:
    """``op_comm_calls``' calls as ``_Passes`` logs them: an all-to-all's message times ``(p - 1) / p`` (what
    leaves the busiest member), a neighbour exchange's message whole."""
    from soybean.cost.collectives import op_comm_calls

    return [(c.kind, c.bytes * ((mesh.shape[c.axis] - 1) / mesh.shape[c.axis] if c.kind == "all_to_all" else 1))
            for c in op_comm_calls(op, st, [True, True, True], mesh)]


def _trains_as_serial(model: nn.Module, x: torch.Tensor, p: Plan) -> None:
    """Three AdamW steps under ``p`` (every rank a thread) equal serial training in float64."""
    serial = train_serial(model, (x,), steps=3)
    par, _ = train_parallel_threads(model, (x,), plan=p, steps=3)
    torch.testing.assert_close(torch.tensor(par.losses), torch.tensor(serial.losses), rtol=1e-10, atol=1e-12)
    for k, v in serial.params.items():
        torch.testing.assert_close(par.params[k], v, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_zigzag_rows_move_the_bytes_priced(parts: int) -> None:
    """The zig-zag variant on ``parts`` members, 30 rows (uneven), GQA heads: the all-to-alls it runs forward and
    backward move, in order and for the busiest member, the bytes ``sdpa_comm`` prices (its message times
    ``(p - 1) / p``), and its result and gradients are the serial op's."""
    from soybean.runtime.attention import sb_sdpa_rows
    from soybean.runtime.context import use_groups
    from soybean.tiling import chunk_range

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 30, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    cot = torch.randn_like(out)
    want_grads = torch.autograd.grad(out, (q, k, v), cot)
    op = make_opspec(torch.ops.aten.scaled_dot_product_attention.default, (q, k, v),
                     {"is_causal": True, "enable_gqa": True}, out)
    mesh = Mesh((parts,))
    st = next(s for s in expand(op, mesh) if s.variant == "zigzag")
    priced = _priced_moves(op, st, mesh)
    logs: list[list[tuple[str, float]]] = [[] for _ in range(parts)]
    tiles: list = [None] * parts

    def member(rank: int, groups: list) -> None:
        a, b = chunk_range(30, parts, rank)
        mine = q[:, :, a:b].detach().requires_grad_(True)
        kk, vv = k.detach().requires_grad_(True), v.detach().requires_grad_(True)
        with use_groups([_Passes(groups[0], logs[rank])]):
            o = sb_sdpa_rows(mine, kk, vv, is_causal=True, enable_gqa=True, row_axes=(0,), rows=30, zigzag=True)
            o.backward(cot[:, :, a:b])
        tiles[rank] = (o.detach(), mine.grad, kk.grad, vv.grad)

    run_threads(mesh, member)
    ran = _busiest(logs)
    assert [kind for kind, _ in ran] == [kind for kind, _ in priced] == ["all_to_all"] * len(priced)
    assert [m for _, m in ran] == pytest.approx([m for _, m in priced])
    torch.testing.assert_close(torch.cat([t[0] for t in tiles], 2), out.detach())
    torch.testing.assert_close(torch.cat([t[1] for t in tiles], 2), want_grads[0])
    torch.testing.assert_close(sum(t[2] for t in tiles), want_grads[1])
    torch.testing.assert_close(sum(t[3] for t in tiles), want_grads[2])


@pytest.mark.parametrize("causal,rows,keys,heads,kv_heads,parts", [
    (True, 30, 30, 4, 2, 2), (True, 30, 30, 4, 2, 3), (False, 30, 22, 2, 2, 4), (True, 66, 66, 1, 1, 4),
    (True, 7, 7, 2, 1, 1)])
def test_ring_attention_is_the_serial_op_and_passes_the_bytes_priced(
        causal: bool, rows: int, keys: int, heads: int, kv_heads: int, parts: int) -> None:
    """Ring attention (``runtime.ring``) on ``parts`` members, float64, uneven chunks, grouped-query heads, in
    contiguous chunks and (causal) in the zig-zag layout: every member's output rows and its gradients of its query,
    key and value tiles are the serial op's (the backward's passes bring each block's key and value gradients
    home: the adjoint of the forward's passes), and the passes and moves the members run, forward and backward,
    are the ones ``sdpa_comm`` prices, in order, with its bytes for the busiest."""
    from soybean.runtime.attention import sb_sdpa_rows
    from soybean.runtime.context import use_groups
    from soybean.tiling import chunk_range

    torch.manual_seed(0)
    q = torch.randn(2, heads, rows, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, keys, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, keys, 6, dtype=torch.float64, requires_grad=True)
    kw = {"is_causal": causal, "enable_gqa": True}
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    cot = torch.randn_like(out)
    want = (out.detach(), *torch.autograd.grad(out, (q, k, v), cot))
    op = make_opspec(torch.ops.aten.scaled_dot_product_attention.default, (q, k, v), kw, out)
    mesh = Mesh((parts,))
    for variant in ("ring", "ring_zigzag") if causal else ("ring",):
        st = next(s for s in expand(op, mesh) if s.variant == variant)
        priced = _priced_moves(op, st, mesh)
        logs: list[list[tuple[str, float]]] = [[] for _ in range(parts)]
        tiles: list = [None] * parts

        def member(rank: int, groups: list, logs: list = logs, tiles: list = tiles, variant: str = variant) -> None:
            (a, b), (c, d) = chunk_range(rows, parts, rank), chunk_range(keys, parts, rank)
            mine = [q[:, :, a:b], k[:, :, c:d], v[:, :, c:d]]
            mine = [t.detach().requires_grad_(True) for t in mine]
            with use_groups([_Passes(groups[0], logs[rank])]):
                o = sb_sdpa_rows(*mine, **kw, row_axes=(0,), rows=rows, ring=True, keys=keys,
                                 zigzag=variant == "ring_zigzag")
                o.backward(cot[:, :, a:b])
            tiles[rank] = (o.detach(), *(t.grad for t in mine))

        run_threads(mesh, member)
        ran = _busiest(logs)
        assert [kind for kind, _ in ran] == [kind for kind, _ in priced]
        assert [m for _, m in ran] == pytest.approx([m for _, m in priced])
        for i, w in enumerate(want):
            torch.testing.assert_close(torch.cat([t[i] for t in tiles], 2), w)


def test_ring_passes_are_priced_behind_the_block_they_follow() -> None:
    """On 4 members: each forward pass of a key/value block runs behind ``1 / 4`` of the op's forward, each backward
    one behind ``2.5 / 4`` of it, the gradients' passes behind nothing; the op's communication is priced as
    ``max(0, pass - hidden) + blocking`` summed, less than the same passes blocking."""
    from soybean.cost.collectives import Cost, op_call_cost, op_comm_calls, op_comm_costs
    from soybean.cost.compute import op_seconds
    from soybean.cost.profiles import load_profile

    q, k, v = (torch.empty(1, h, 4096, 128, dtype=torch.bfloat16, device="meta") for h in (32, 8, 8))
    out = torch.empty(1, 32, 4096, 128, dtype=torch.bfloat16, device="meta")
    op = make_opspec(torch.ops.aten.scaled_dot_product_attention.default, (q, k, v),
                     {"is_causal": True, "enable_gqa": True}, out)
    mesh, prof = Mesh((4,)), load_profile("h100-nvlink")
    st = next(s for s in expand(op, mesh) if s.variant == "ring")
    grads = [True, True, True]
    calls = op_comm_calls(op, st, grads, mesh)
    assert [c.behind for c in calls] == [0.25] * 3 + [2.5 / 4, 0.0] * 3 + [0.0]
    assert [c.bytes for c in calls[3:5]] == [calls[0].bytes, 2 * calls[0].bytes]  # float32 gradients of bf16
    fwd = float(op_seconds(op, [st], [False] * 3, mesh, prof)[0])
    costs = [op_call_cost(c, mesh, prof, fwd) for c in calls]
    blocking = [op_call_cost(c._replace(behind=0.0), mesh, prof, fwd) for c in calls]
    priced = op_comm_costs(op, [st], grads, mesh, prof, compute=np.array([fwd]))
    assert priced[0, 1] == pytest.approx(sum(c.seconds for c in costs))
    assert priced[0, 0] == pytest.approx(sum(c.bytes for c in costs))
    assert sum(c.seconds for c in costs) < sum(c.seconds for c in blocking)
    assert costs[0] == Cost(blocking[0].bytes, max(0.0, blocking[0].seconds - prof.blocking_s - fwd / 4)
                            + prof.blocking_s)


def _ring_case(causal: bool) -> tuple:
    """Queries (4 heads, 29 rows: uneven on 2), keys and values (2 heads) and an output gradient, float64."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, h, 29, 8, dtype=torch.float64, generator=g) for h in (4, 2, 2))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return q, k, v, torch.randn(out.shape, dtype=torch.float64, generator=g)


def _ring_rank(rank: int, world: int) -> dict:
    """One gloo rank: ring attention on its tiles (``TorchGroup``: each pass started before the block's compute),
    causal in both layouts and not; its output rows and gradients."""
    from soybean.runtime import torch_groups, use_groups
    from soybean.runtime.attention import sb_sdpa_rows
    from soybean.tiling import chunk_range

    torch.set_num_threads(1)
    got = {}
    with use_groups(torch_groups(Mesh((world,)))):
        for causal, zigzag in ((True, False), (True, True), (False, False)):
            q, k, v, cot = _ring_case(causal)
            a, b = chunk_range(29, world, rank)
            mine = [t[:, :, a:b].clone().requires_grad_(True) for t in (q, k, v)]
            o = sb_sdpa_rows(*mine, is_causal=causal, enable_gqa=True, row_axes=(0,), rows=29, ring=True, keys=29,
                             zigzag=zigzag)
            o.backward(cot[:, :, a:b])
            got[causal, zigzag] = (o.detach(), *(t.grad for t in mine))
    return got


@pytest.mark.dist
def test_ring_attention_overlapping_its_passes_is_the_serial_op_on_gloo() -> None:
    """Ring attention on 2 gloo processes, where each pass runs while the block before it computes
    (``TorchGroup.exchange_start``): causal in contiguous and zig-zag chunks and not, uneven, grouped-query heads;
    the output and every gradient are the serial op's in float64."""
    from soybean.runtime.launch import spawn

    ranks = spawn(_ring_rank, 2, timeout_s=300)
    for (causal, zigzag) in ranks[0]:
        q, k, v, cot = (t.requires_grad_(True) if i < 3 else t for i, t in enumerate(_ring_case(causal)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        want = (out.detach(), *torch.autograd.grad(out, (q, k, v), cot))
        for i, w in enumerate(want):
            torch.testing.assert_close(torch.cat([r[causal, zigzag][i] for r in ranks], 2), w)


@pytest.mark.sim
@pytest.mark.parametrize("variant", ["ring", "ring_zigzag"])
@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)])
def test_ring_attention_trains_as_serial(mesh: tuple[int, ...], variant: str) -> None:
    """``context_parallel_method="ring"``: the plan splits the causal attention's queries, keys and values along
    the sequence (``method: ring``; on 2x2 on one axis, ``context_parallel=2``), ``explain`` shows its passes, and a
    few AdamW steps equal serial training in float64 (66 tokens: uneven on 4), run in contiguous chunks and in the
    zig-zag layout (the plan's node set to that variant)."""
    from soybean.report.explain import explain

    torch.manual_seed(0)
    model = CausalAttention().double()
    x = torch.randn(1, 66, 16, dtype=torch.float64)
    cap = capture(model, (x,))
    p = plan(None, (), captured=cap, devices=math.prod(mesh), mesh=mesh, objective="comm", baselines=False,
             context_parallel=2 if len(mesh) > 1 else "auto", context_parallel_method="ring")
    assert [r["method"] for r in p.context_parallel] == ["ring"]
    p.nodes["scaled_dot_product_attention"]["variant"] = variant
    if len(mesh) == 1:  # (``explain`` rebuilds the table without the options: on 2x2 under ``comm`` it lacks the
        # one-axis split ``context_parallel=2`` forced)
        assert ("ring_kv[axis 0]", "backward") in {(c.step, c.phase) for r in explain(cap, p).rows
                                                   for c in r.collectives}
    _trains_as_serial(model, x, p)


def test_a_plan_whose_variant_its_rule_lacks_is_refused() -> None:
    """A plan edited to run an op as a variant its rule does not list for those tilings (zig-zag rows with the keys
    split) is refused by name, not run wrong."""
    model = CausalAttention().double()
    x = torch.randn(1, 66, 16, dtype=torch.float64)
    cap = capture(model, (x,))
    p = plan(None, (), captured=cap, devices=2, objective="comm", baselines=False, context_parallel_method="ring")
    p.nodes["scaled_dot_product_attention"]["variant"] = "zigzag"
    with pytest.raises(ValueError, match="scaled_dot_product_attention as 'zigzag'"):
        train_parallel_threads(model, (x,), plan=p, steps=1)


@pytest.mark.sim
@pytest.mark.parametrize("mesh", [(2,), (3,), (4,), (2, 2)])
def test_zigzag_rows_train_as_serial(mesh: tuple[int, ...]) -> None:
    """The plans of ``test_query_rows_split_train_as_serial`` with the rows split on one axis computed in the
    zig-zag layout (66 rows: uneven on 3 and 4; on 2x2 the rows split 2 ways, ``context_parallel=2``): a few AdamW
    steps equal serial training in float64; the plan records the layout."""
    torch.manual_seed(0)
    model = CausalAttention().double()
    x = torch.randn(1, 66, 16, dtype=torch.float64)
    cap = capture(model, (x,))
    p = _zigzag(plan(None, (), captured=cap, devices=math.prod(mesh), mesh=mesh, objective="comm", baselines=False,
                     context_parallel=2 if len(mesh) > 1 else "auto", context_parallel_method="all_gather_kv"))
    assert any(n.get("variant") == "zigzag" for n in p.nodes.values())
    _trains_as_serial(model, x, p)


def test_the_planner_prices_zigzag_against_contiguous_rows() -> None:
    """One head of width 64 over 4,096 causal tokens on 4 CPU processes (``cpu-gloo``): the planner splits the
    rows 4 ways in the zig-zag layout (the contiguous split's last member would do 7/4 of an even share); the
    plan, its JSON and ``explain`` say so (at 2,048 the causal half of the work, which is all the kernels do, is
    too little for the skew to pay for the rows' moves).  Over 512 tokens split 2 ways the planner keeps contiguous rows: their
    skew of 1.5 costs less there than moving half the rows each way twice."""
    from soybean.report.explain import explain

    model = CausalAttention(64)
    cap = capture(model, (torch.randn(1, 4096, 64),))
    p = plan(None, (), captured=cap, devices=4, mesh=(4,), baselines=False)
    assert [r["layout"] for r in p.context_parallel] == ["zigzag"] and p.to_dict()["nodes"][
        "scaled_dot_product_attention"]["variant"] == "zigzag"
    steps = {(c.step, c.phase) for r in explain(cap, p).rows for c in r.collectives}
    assert {("zigzag_rows[axis 0]", "forward"), ("zigzag_rows[axis 0]", "backward")} <= steps
    back = Plan.from_dict(p.to_dict())
    assert back.node_variant("scaled_dot_product_attention") == "zigzag"
    short = capture(CausalAttention(64), (torch.randn(1, 512, 64),))
    assert [r["layout"] for r in plan(None, (), captured=short, devices=2, baselines=False,
                                      context_parallel=2).context_parallel] == ["contiguous"]


@pytest.mark.sim
@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_query_rows_split_train_as_serial(mesh: tuple[int, ...]) -> None:
    """Batch 1 x 66 tokens (uneven on 4), float64, under the plan that minimises communication: the attention's query
    rows are split (``context_parallel`` rows of the plan), and a few AdamW steps equal serial training."""
    torch.manual_seed(0)
    model = CausalAttention().double()
    x = torch.randn(1, 66, 16, dtype=torch.float64)
    cap = capture(model, (x,))
    p = plan(None, (), captured=cap, devices=len(mesh) * 2 if len(mesh) > 1 else 2, mesh=mesh, objective="comm",
             baselines=False, context_parallel_method="all_gather_kv")
    assert p.context_parallel and all(r["method"] == "all_gather_kv" for r in p.context_parallel)
    assert max(r["degree"] for r in p.context_parallel) >= 2 and "context_parallel" in p.to_dict()
    _trains_as_serial(model, x, p)


_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, batch=1, seq=256)


# Issue 23's 1,024-token point: a tiny Llama whose attention is most of its work (2 heads of 64, one K/V head, so
# its heads split 2 ways at most).
_LONG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=128, batch=1, seq=1536)


@pytest.mark.sim
def test_auto_splits_a_long_causal_llama_along_the_sequence_on_2x2() -> None:
    """Issue 23's point: the tiny Llama above at batch 1 x 1,536 tokens on a 2x2 mesh under ``auto`` (the default
    ``time`` objective, ``cpu-gloo`` profile): the planner splits both attention ops along the sequence on one axis,
    and three AdamW steps with every rank a thread equal serial training (every loss, gradient and parameter,
    judged against the float64 run: transformers computes the rotary embedding in float32 whatever the model's
    dtype).  At 1,024 tokens the causal half of the scores, all the kernels compute, is too little for the split
    to pay."""
    pytest.importorskip("transformers")
    from soybean.models import load
    from soybean.verify.sweep import differences, exact_serial

    model, inputs = load("hf:llama", _LONG)
    cap = capture(model, inputs)
    p = plan(None, (), captured=cap, devices=4, mesh=(2, 2), baselines=False)
    assert len(p.context_parallel) == 2 and all(r["degree"] >= 2 for r in p.context_parallel)
    serial = train_serial(model, inputs, steps=3, lr=1e-4)
    par, _ = train_parallel_threads(model, inputs, plan=p, steps=3, lr=1e-4)
    assert not differences(serial, exact_serial(model, inputs, serial, lr=1e-4), par, lr=1e-4)


def _llama_rank(rank: int, world: int, config: dict, context_parallel: object, mesh: tuple | None) -> tuple:
    """One gloo rank: the tiny Llama of ``config`` parallelized with ``context_parallel`` on ``mesh``, trained; its
    trace and plan's rows."""
    import soybean
    from soybean.models import load
    from soybean.verify.testing import train_parallel

    torch.set_num_threads(1)
    model, inputs = load("hf:llama", config)
    pm = soybean.parallelize(model, inputs, devices=world, mesh=mesh, context_parallel=context_parallel)
    return train_parallel(pm, model, inputs, 3, 1e-4), pm.plan.context_parallel


@pytest.mark.dist
@pytest.mark.parametrize("config,world,context_parallel,mesh", [(_LLAMA, 2, 2, None), (_LLAMA, 4, 2, (2, 2))],
                         ids=["256-tokens-2-procs-cp2", "256-tokens-2x2-cp2"])
def test_a_causal_llama_split_along_the_sequence_trains_as_serial_on_gloo(
        config: dict, world: int, context_parallel: object, mesh: tuple | None) -> None:
    """Issue 23's first acceptance point on gloo: a tiny causal Llama (transformers) at batch 1 x 256 tokens with
    ``context_parallel=2`` splits both attention ops' query sequence 2 ways (keys and values gathered), on 2
    processes and on 4 (mesh 2x2: the sequence split on one axis, a process subgroup).  Three AdamW steps equal
    serial training (every loss, gradient and parameter, judged against the float64 run).

    That ``auto`` chooses the split at 1 x 1,536 tokens on 2x2, and that plan trains as serial, is
    ``test_auto_splits_a_long_causal_llama_along_the_sequence_on_2x2`` (every rank a thread): run here too on 4
    processes it proved nothing more than these two and cost three times both."""
    pytest.importorskip("transformers")
    from soybean.models import load
    from soybean.runtime.launch import spawn
    from soybean.verify.sweep import differences, exact_serial

    par, rows = spawn(_llama_rank, world, config, context_parallel, mesh, timeout_s=600)[0]
    assert len(rows) == 2 and all(r["degree"] == 2 and r["method"] == "all_gather_kv" for r in rows), rows
    model, inputs = load("hf:llama", config)
    serial = train_serial(model, inputs, steps=3, lr=1e-4)
    assert not differences(serial, exact_serial(model, inputs, serial, lr=1e-4), par, lr=1e-4)


def test_context_parallel_none_forbids_and_n_forces_the_split() -> None:
    """``none``: no attention op splits its rows even where the objective would; ``N`` on a mesh with no N-way
    axes: that mesh is refused with a message naming the option."""
    torch.manual_seed(0)
    model = CausalAttention().double()
    cap = capture(model, (torch.randn(1, 66, 16, dtype=torch.float64),))
    assert not plan(None, (), captured=cap, devices=2, objective="comm", context_parallel="none",
                    baselines=False).context_parallel
    assert plan(None, (), captured=cap, devices=2, context_parallel=2, baselines=False).context_parallel
    with pytest.raises(Exception, match="--context-parallel 2"):
        plan(None, (), captured=cap, devices=3, mesh=(3,), context_parallel=2, baselines=False)
    with pytest.raises(ValueError, match="--context-parallel"):
        plan(None, (), captured=cap, devices=2, context_parallel=1, baselines=False)


def test_cp_tp_fsdp_is_torchtitans_long_context_layout_and_never_beats_the_plan() -> None:
    """The ``cp_tp_fsdp`` baseline of a causal model on 2 nodes of 2: the input's sequence split across nodes (axis
    0, the batch whole) and every attention op's query rows there, every weight split inside a node and
    FSDP-sharded across; it is priced (not infeasible) on
    a mesh the planner searched, and the plan is never slower.  A model without causal attention has none."""
    pytest.importorskip("transformers")
    from soybean.planner import baselines
    from soybean.cost.profiles import load_profile
    from soybean.models import load
    from soybean.rules.attention import row_axes

    model, inputs = load("hf:llama", {**_LLAMA, "seq": 64})
    cap = capture(model, inputs)
    lay = baselines.layouts(cap, 4, gpus_per_node=2)["cp_tp_fsdp"]
    assert tuple(lay.mesh.shape) == (2, 2) and lay.gather == (0,)
    assert cap.inputs and all(lay.domains[n] == [(Shard(1), R)] for n in cap.inputs) and lay.sequence_axes == (0,)
    g = lay.table(cap, load_profile(None), "time", 2)
    sdpa = [v for v in g.vars if v.name.startswith("scaled_dot_product_attention")]
    assert len(sdpa) == 2 and all(row_axes(v.op, st) == (0,) for v in sdpa for st in v.strategies)
    p = plan(None, (), captured=cap, devices=4, gpus_per_node=2)
    cp = p.baselines["cp_tp_fsdp"]
    assert "infeasible" not in cp and tuple(cp["mesh"]) in {tuple(m["mesh"]) for m in p.meshes}
    assert p.cost["step_time_s"] <= cp["step_time_s"] * (1 + 1e-9)
    dense = capture(nn.Sequential(nn.Linear(8, 8)), (torch.randn(4, 8),))
    assert "cp_tp_fsdp" not in baselines.layouts(dense, 4, gpus_per_node=2)
