"""``pmodel.eval()``: the program in evaluation mode (``soybean.run.modes``), as the serial model's ``eval()``.

The graph is captured in training mode; before this, ``pmodel.eval()`` changed nothing the program ran: dropout kept
dropping and batch norm kept normalising by the batch (and updating its running statistics) in evaluation, every
evaluation loop's numbers wrong with no error."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from soybean.mesh import Mesh
from soybean.run.modes import EvalModeError, for_eval
from soybean.runtime.launch import run_threads

pytestmark = pytest.mark.sim


def _convnet() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 8, 3), nn.BatchNorm1d(8), nn.ReLU(), nn.Flatten(), nn.Dropout(0.4),
                          nn.Linear(8 * 6, 3)).double()
    return model, torch.randn(8, 4, 8, dtype=torch.float64), torch.randint(0, 3, (8,))


@pytest.mark.parametrize("mode", ["dp", "mp"])
def test_evaluation_mode_is_the_serial_models_on_two_threads(mode: str) -> None:
    """Batch norm split by the batch (``dp``: its training statistics summed across ranks, ``sb_batch_norm``) or not,
    and dropout: ``eval()`` outputs equal the serial model's in evaluation (its running statistics, no dropout), the
    same on every call, the running statistics left alone; back in training the program is training's again."""
    import soybean

    model, x, _ = _convnet()
    with torch.no_grad():  # running statistics unlike any batch's
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    model.eval()
    with torch.no_grad():
        want = model(x)
    model.train()
    plan = soybean.plan(model, (x,), devices=2, mode=mode)

    def rank(r: int, groups: list) -> tuple[torch.Tensor, ...]:
        pm = soybean.parallelize(model, (x,), plan=plan, outputs="full", rank=r, groups=groups)
        pm.eval()
        with torch.no_grad():
            first, second = pm(x), pm(x)
        held = pm.full_tensors()
        pm.train()
        with torch.no_grad():
            trained = pm(x)
        return first, second, trained, held

    for first, second, trained, held in run_threads(Mesh((2,)), rank):
        torch.testing.assert_close(first, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(second, first)
        assert not torch.allclose(trained, want)  # training mode: batch statistics and dropout again
        for k, v in buffers.items():
            assert torch.equal(held[k], v), k  # evaluation updated no running statistic


def test_transformers_attention_dropout_is_off_in_evaluation() -> None:
    """A GPT-2 with dropout everywhere (embeddings, attention, residuals): ``eval()`` is the serial evaluation."""
    tf = pytest.importorskip("transformers")
    import soybean

    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=16, attn_pdrop=0.3,
                        resid_pdrop=0.3, embd_pdrop=0.3)
    model = tf.GPT2LMHeadModel(cfg)
    x = torch.randint(0, 100, (2, 16))
    pm = soybean.parallelize(model, (x,), devices=1)
    model.eval()
    pm.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)


def test_an_op_without_an_evaluation_form_is_refused() -> None:
    graph = torch.fx.Graph()
    x, m, v = graph.placeholder("x"), graph.placeholder("m"), graph.placeholder("v")
    graph.output(graph.call_function(torch.ops.aten.instance_norm.default, (x, None, None, m, v, True, 0.1, 1e-5,
                                                                           False)))
    with pytest.raises(EvalModeError, match="instance_norm.* with running statistics"):
        for_eval(torch.fx.GraphModule(torch.nn.Module(), graph))


def test_attention_on_split_query_rows_drops_nothing_in_evaluation() -> None:
    """Context parallelism's attention (``runtime.attention.sb_sdpa_rows``) carries the captured ``dropout_p`` too."""
    from soybean.runtime.attention import sb_sdpa_rows

    graph = torch.fx.Graph()
    q, k, v = graph.placeholder("q"), graph.placeholder("k"), graph.placeholder("v")
    graph.output(graph.call_function(sb_sdpa_rows, (q, k, v, None, 0.3, True), {"row_axes": (0,), "rows": 8}))
    node = next(n for n in for_eval(torch.fx.GraphModule(torch.nn.Module(), graph)).graph.nodes
                if n.target is sb_sdpa_rows)
    assert node.args[4] == 0.0 and node.args[5] is True and node.kwargs == {"row_axes": (0,), "rows": 8}


def test_recomputed_layers_are_evaluated_without_dropout() -> None:
    """A plan that recomputes layers cuts the program into checkpointed runs (``codegen.recompute``), each a graph
    of its own holding its dropout: evaluation rewrites those too."""
    import soybean
    from examples.models import transformer

    model, (x, y) = transformer(batch=2, seq=8, hidden=32, layers=2, heads=4, dropout=0.3)
    pm = soybean.parallelize(model, (x, y), devices=1, recompute="layers")
    inner = [n for m in pm.program.modules() if isinstance(m, torch.fx.GraphModule) and m is not pm.program
             for n in m.graph.nodes if n.target is torch.ops.aten.dropout.default]
    assert inner  # the dropouts are inside the recomputed runs' graphs
    model.eval()
    pm.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(x, y), model(x, y), rtol=1e-6, atol=1e-6)
    assert all(n.args[2] is True for n in inner)  # the training program is untouched
