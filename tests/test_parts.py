"""One ``Part`` for pipeline stages and placed regions (``soybean.parts.part``): one cut, one serial meaning, one
price of a value crossing groups, one reading of the weights several parts share, one rebuild from a saved plan."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from examples.models import towers, transformer
from soybean.capture.core import capture
from soybean.cost.profiles import load_profile
from soybean.parts.part import crossing_s, run_parts, shared_params, split, value_facts
from soybean.parts.stages import Stage, even_bounds, layers, pieces, split as split_stages

pytestmark = pytest.mark.unit


def _lm() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A decoder whose head is tied to its token embedding, in float64 (a weight read by the first and last part)."""
    model, inputs = transformer(batch=2, seq=6, hidden=12, layers=4, heads=2, vocab=11)
    return model.double(), inputs


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("relay", [True, False])
def test_one_cut_both_schedules_run_as_the_model(relay: bool) -> None:
    """The same assignment of nodes to parts, cut as stages (each takes what the one before returned) or as
    regions (each takes what it reads from where it was made): both run in order to the model's output and
    gradients, exactly; a relayed part takes exactly the previous part's returns, a direct one only values made
    earlier, each once."""
    model, inputs = _lm()
    cap = capture(model, inputs)
    assign = pieces(cap, even_bounds(len(layers(cap)), 3))
    parts = split(cap, assign, "stage" if relay else "region", relay=relay)
    got = run_parts(cap, parts, _state(model), list(inputs))[0]
    want = model(*inputs)
    assert torch.equal(got, want)
    g1 = torch.autograd.grad(got, list(model.parameters()))
    g2 = torch.autograd.grad(want, list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    made: set[str] = set(cap.inputs)
    for k, p in enumerate(parts):
        if relay:
            assert p.takes == (list(cap.inputs) if k == 0 else parts[k - 1].returns)
        else:
            assert set(p.takes) <= made and len(set(p.takes)) == len(p.takes)
        made |= set(p.returns)
    assert parts[-1].final and not any(p.final for p in parts[:-1])
    # the stages the pipeline cuts are this very cut, with their layers
    stages = split_stages(cap, even_bounds(len(layers(cap)), 3))
    assert all(isinstance(st, Stage) for st in stages)
    if relay:
        assert [(st.takes, st.returns, st.cap.fingerprint) for st in stages] == [
            (p.takes, p.returns, p.cap.fingerprint) for p in parts]


def test_a_weight_two_parts_read_is_shared_and_a_node_in_no_part_that_reads_one_refused() -> None:
    """A tied embedding and head: the weight is read by the first and the last part, is in both parts' captures
    and in no other; a node left out of every part that reads a part's value is refused (only what reads no part's
    value is copied into its readers)."""
    model, inputs = _lm()
    cap = capture(model, inputs)
    assign = pieces(cap, even_bounds(len(layers(cap)), 3))
    shared = shared_params(cap, assign)
    assert list(shared) == ["wte.weight"] and shared["wte.weight"] == [0, 2]
    parts = split(cap, assign, relay=True)
    assert [("wte.weight" in p.trained) for p in parts] == [True, False, True]
    with pytest.raises(ValueError, match="in no part"):
        split(cap, [assign[0], assign[1][:1], assign[2]])


def test_a_crossing_is_priced_by_its_messages() -> None:
    """One price for a value crossing groups: a stage's group hands the next one message per rank each way (its
    gradient back); a group of 1 hands a region on 4 devices 3 messages from its one rank, nothing back."""
    model, inputs = towers(layers=2, width=16, batch=4)
    cap = capture(model, (inputs[0],))
    facts = value_facts(cap)
    name = next(n for n, (_, grad) in facts.items() if grad)
    nbytes = facts[name][0]
    gloo = load_profile("cpu-gloo")
    assert crossing_s(facts, [name], [0, 1], [2, 3], gloo, "schedule") == pytest.approx(
        2 * (gloo.alpha + nbytes * gloo.beta))
    alpha, beta = gloo.ab(0, "p2p", m=float(nbytes))
    assert crossing_s(facts, [name], [0], [0, 1, 2, 3], gloo, "p2p") == pytest.approx(3 * (alpha + nbytes * beta))
    assert crossing_s(facts, [name, "not a tensor"], [0], [1], gloo, "p2p") == pytest.approx(
        2 * (alpha + nbytes * beta))
    with pytest.raises(ValueError, match="unknown link"):
        crossing_s(facts, [name], [0], [1], gloo, "pigeon")
    again = value_facts(cap)  # computed per call: no cache kept between calls
    assert again == facts and again is not facts
