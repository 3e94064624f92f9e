"""One error on every rank, never a hang (``soybean.runtime.agree``), on two gloo processes.

- Planning: rank 0's error (an impossible memory budget) is raised on every rank as the same exception, and a
  capture failing on rank 1 alone is raised on rank 0 too, not left waiting for a plan; a custom Function refused
  in pipeline stages (rank 0 checks its backward) is the same ``CustomFunctionError`` on both, and so is a model
  whose rows mix across the batch in microbatches (rank 0 runs the example) the same ``MicrobatchError``.
- Building a rank's part of a pipelined or placed plan: a failure on one rank (a pipeline stage, a placed region)
  is its error on every rank, not a wait in a process group the others never make (the tied weights').
- Steps: a ``loss_fn`` raising on rank 1 only ends both ranks, rank 1 with its own exception and rank 0 with
  ``RankFailedError`` naming rank 1 and that exception, for a plain ``ParallelModule`` and a 2-stage
  ``PipelinedModule``.

Each rank catches its error and returns its text, so the test sees both; a rank left waiting would end the spawn
with its ``TimeoutError`` instead.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from soybean.runtime.launch import spawn

pytestmark = pytest.mark.dist

BOOM = "boom on rank 1"  # the injected failure (on rank 0 in the pipeline-stage test)


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)], nn.Linear(8, 3))
    return model, torch.randn(8, 8)


def _error(e: BaseException) -> tuple[str, str, list[str]]:
    """What a rank saw: the exception's class, message and notes."""
    return type(e).__name__, str(e), list(getattr(e, "__notes__", []))


def _planning_failures(rank: int, world: int) -> dict[str, tuple[str, str, list[str]] | None]:
    """An impossible budget; then a gradient reversal (a custom Function whose backward is not its forward's
    derivative) in pipeline stages, which only export offers: rank 0 checks the backward, every rank refuses; a
    model whose rows mix across the batch in microbatches: rank 0 runs the example, every rank refuses."""
    from test_custom_functions import _Reversed
    from test_microbatches import mixed

    import soybean

    out: dict[str, tuple[str, str, list[str]] | None] = {"budget": None, "function": None, "microbatch": None}
    model, x = _mlp()
    try:
        soybean.parallelize(model, (x,), devices=world, memory_gb=1e-6)
    except Exception as e:
        out["budget"] = _error(e)
    torch.manual_seed(0)
    try:
        soybean.parallelize(_Reversed(), (torch.randn(8, 4),), devices=world, pipeline=2, microbatches=2)
    except Exception as e:
        out["function"] = _error(e)
    model, example = mixed()
    try:
        soybean.parallelize(model, example, devices=world, pipeline=2, microbatches=2)
    except Exception as e:
        out["microbatch"] = _error(e)
    return out


@pytest.fixture(scope="module")
def planning_errors() -> list[dict[str, tuple[str, str, list[str]] | None]]:
    """``_planning_failures`` on two processes (one spawn for both of its cases)."""
    return spawn(_planning_failures, 2, timeout_s=120)


def test_an_impossible_budget_is_rank_0s_error_on_every_rank(planning_errors: list[dict]) -> None:
    got = [r["budget"] for r in planning_errors]
    assert got[0] is not None and got[1] is not None, got
    assert got[0][0] == got[1][0] == "MemoryBudgetError", got
    assert got[0][1] == got[1][1] and got[0][1].startswith("no plan fits the memory budget"), got
    assert any("rank 0" in n for n in got[1][2]), got  # rank 1's copy says whose it is


def test_a_custom_function_refused_in_pipeline_stages_is_the_same_error_on_every_rank(planning_errors: list[dict]
                                                                                      ) -> None:
    got = [r["function"] for r in planning_errors]
    assert got[0] is not None and got[1] is not None, got
    assert got[0][0] == got[1][0] == "CustomFunctionError", got
    assert got[0][1] == got[1][1] and "in pipeline stages" in got[0][1], got


def test_a_model_that_mixes_rows_is_refused_in_microbatches_on_every_rank(planning_errors: list[dict]) -> None:
    got = [r["microbatch"] for r in planning_errors]
    assert got[0] is not None and got[1] is not None, got
    assert got[0][0] == got[1][0] == "MicrobatchError", got
    assert got[0][1] == got[1][1] and "2 microbatches would train another model" in got[0][1], got


def _boom(*args: object, **kwargs: object) -> None:
    raise ValueError(BOOM)


def _capture_fails(rank: int, world: int) -> dict[str, tuple[str, str, list[str]] | None]:
    """Rank 1's model wider than rank 0's (every rank must be told, not run rank 0's graph on its own weights); then
    rank 1's capture failing alone: rank 0 captures and sends its graph, rank 1 cannot read it and its own capture
    fails."""
    import soybean
    import soybean.api
    import soybean.capture.cache

    out: dict[str, tuple[str, str, list[str]] | None] = {"other model": None, "capture": None}
    model, x = _mlp()
    if rank == 1:
        model[4] = nn.Linear(8, 5)
    try:
        soybean.parallelize(model, (x,), devices=world)
    except Exception as e:
        out["other model"] = _error(e)
    if rank == 1:  # this process's capture and its reading of rank 0's graph fail, the other's not
        soybean.api.capture = _boom  # type: ignore[assignment]
        soybean.capture.cache.loads = _boom  # type: ignore[assignment]
    model, x = _mlp()
    try:
        soybean.parallelize(model, (x,), devices=world)
    except Exception as e:
        out["capture"] = _error(e)
    return out


def test_a_capture_failing_on_rank_1_only_is_raised_on_rank_0_too() -> None:
    """(And a rank holding another model than rank 0's is named on every rank: ranks lower the graph rank 0
    captured, ``api._captured_once``.)"""
    runs = spawn(_capture_fails, 2, timeout_s=120)
    other = [r["other model"] for r in runs]
    assert other[0] is not None and other[0][:2] == other[1][:2], other  # every rank: the same error
    assert other[0][0] == "ValueError" and "rank(s) [1] hold another model" in other[0][1], other
    got = [r["capture"] for r in runs]
    assert got[1] is not None and BOOM in got[1][1], got
    assert got[0] is not None and got[0][:2] == got[1][:2], got  # the same exception, rebuilt on rank 0
    assert any("rank 1" in n for n in got[0][2]), got


def _loss_fails_on_rank_1(out: object, target: torch.Tensor | None = None) -> torch.Tensor:
    if dist.get_rank() == 1:
        raise ValueError(BOOM)
    assert isinstance(out, torch.Tensor) or hasattr(out, "float")
    return nn.functional.mse_loss(out.float(), target) if target is not None else out.float().sum()  # type: ignore


def _step_fails(rank: int, world: int, pipeline: int | None) -> tuple[str, str, list[str]] | None:
    import soybean

    torch.set_num_threads(1)
    model, x = _mlp()
    y = torch.randn(8, 3)
    extra = {"pipeline": pipeline, "microbatches": 2, "schedule": "gpipe"} if pipeline else {"mode": "mp"}
    pm = soybean.parallelize(model, (x,), devices=world, **extra)
    try:
        for _ in range(3):  # a rank that finished its step meets the failure at the next one's collectives
            pm.train_step(x, loss_fn=_loss_fails_on_rank_1, target=y)
    except Exception as e:
        return _error(e)
    return None


@pytest.mark.parametrize("pipeline", [None, 2], ids=["parallel", "pipelined"])
def test_a_step_failing_on_rank_1_ends_every_rank_naming_it(pipeline: int | None) -> None:
    got = spawn(_step_fails, 2, pipeline, timeout_s=120)
    assert got[1] is not None and got[1][:2] == ("ValueError", BOOM), got  # rank 1: its own exception
    assert any("rank 1" in n for n in got[1][2]), got
    assert got[0] is not None and got[0][0] == "RankFailedError", got
    assert got[0][1].startswith(f"rank 1 failed: ValueError: {BOOM}"), got


class _SlicedFailsOnRank1(nn.Module):
    """``examples.models.mlp`` (its loss inside) whose forward raises on rank 1 when given a slice of the batch: in
    the bench's ``ddp`` variant, not in soybean's (which run the captured program on the whole batch)."""

    def __init__(self, inner: nn.Module, batch: int) -> None:
        super().__init__()
        self.inner, self.batch = inner, batch

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.batch and dist.is_initialized() and dist.get_rank() == 1:
            raise ValueError(BOOM)
        return self.inner(x, y)


def sliced_fails_on_rank_1(batch: int = 8, hidden: int = 16) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The bench's model factory for the test below."""
    from examples.models import mlp

    model, inputs = mlp(batch=batch, hidden=hidden, layers=1)
    return _SlicedFailsOnRank1(model, batch), inputs


def test_the_bench_reports_a_variant_failing_on_one_rank_and_measures_the_others() -> None:
    """``ddp`` fails on rank 1 while rank 0 waits in its gradient all-reduce: reported failed with rank 1's error,
    and ``soybean_dp`` is still measured (in a group started again without ``ddp``)."""
    from soybean.bench.harness import BenchConfig, run_bench

    cfg = BenchConfig(model=f"{__name__}:sliced_fails_on_rank_1", devices=2, steps=2, warmup=1, timeout_s=240,
                      variants=("ddp", "soybean_dp"), rounds=0, agree_grace_s=1.0)
    report = run_bench(cfg)
    assert report["step_s"]["ddp"] is None, report["reasons"]
    assert report["reasons"]["ddp"] == f"ValueError: {BOOM} (rank 1)", report["reasons"]
    assert report["step_s"]["soybean_dp"] is not None, report["reasons"]


def _stage_fails_on_rank_0(rank: int, world: int) -> tuple[str, str, list[str]] | None:
    """GPT-2 (input and output embeddings tied: a group of the tie's holders is made after the stages) in 2 stages,
    torch's ``PipelineStage`` failing on rank 0 alone."""
    import torch.distributed.pipelining as pipelining

    import soybean
    from soybean.models import archs

    torch.set_num_threads(1)
    if rank == 0:
        pipelining.PipelineStage = _boom  # type: ignore[assignment,misc]
    model, kwargs = archs.build(archs.BY_NAME["gpt2"])
    kwargs.pop("labels")
    try:
        soybean.parallelize(model, kwargs, devices=world, pipeline=2, microbatches=2)
    except Exception as e:
        return _error(e)
    return None


def test_a_pipeline_stage_failing_on_one_rank_is_its_error_on_every_rank() -> None:
    """Each rank builds only its own stage, between the groups every rank makes: rank 0's stage failing there left
    rank 1 waiting to make the tied embeddings' group until the timeout.  Every group is made first now, and the
    failure is rank 0's error on both."""
    pytest.importorskip("transformers")
    got = spawn(_stage_fails_on_rank_0, 2, timeout_s=180)
    assert got[0] is not None and got[0][:2] == ("ValueError", BOOM), got
    assert got[1] is not None and got[1][:2] == got[0][:2], got
    assert any("rank 0" in n for n in got[1][2]), got


def _placed_fails_on_rank_0(rank: int, world: int) -> tuple[str, str, list[str]] | None:
    """``tests.test_placement``'s tied towers placed 1 + 1 (a weight both towers read: its gradient's group is made
    after every region's program), rank 0 failing after its regions are built (``value_facts``)."""
    import soybean
    import soybean.run.placed as placed
    from soybean.capture.core import capture
    from soybean.options import options
    from soybean.parts.placement_plan import plan_placement
    from tests.test_placement import _tied_inputs, _TiedTowers

    torch.set_num_threads(1)
    model = _TiedTowers().double()
    ids, _ = _tied_inputs()
    p = plan_placement(capture(model, (ids,)), world, options(None, devices=world), sizes=(1, 1))
    if rank == 0:
        placed.value_facts = _boom  # type: ignore[assignment]
    try:
        soybean.parallelize(model, (ids,), devices=world, plan=p)
    except Exception as e:
        return _error(e)
    return None


def test_a_placed_region_failing_on_one_rank_is_its_error_on_every_rank() -> None:
    """The placed module's tied weights' groups come after the work one rank may fail in alone: a failure there left
    the other rank waiting to make the group; it now meets it at an exchange first."""
    got = spawn(_placed_fails_on_rank_0, 2, timeout_s=180)
    assert got[0] is not None and got[0][:2] == ("ValueError", BOOM), got
    assert got[1] is not None and got[1][:2] == got[0][:2], got
    assert any("rank 0" in n for n in got[1][2]), got
