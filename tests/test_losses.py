"""A mean loss's denominator has one home (``ir.losses``): its count equals torch's own mean for every loss
family and target kind, eagerly and as the graph nodes capture adds."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from soybean.ir.losses import class_count, mean_count

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", ["plain", "ignored", "weighted", "weighted_ignored", "probabilities", "positions"])
def test_mean_count_is_torch_s_denominator(case: str) -> None:
    """``sum(t) / mean_count`` equals torch's ``reduction="mean"`` for cross_entropy (sum / count == mean)."""
    torch.manual_seed(0)
    x = torch.randn(7, 5, dtype=torch.float64)
    t: torch.Tensor = torch.randint(0, 5, (7,))
    kw: dict = {}
    if "ignored" in case:
        t[[1, 4]] = -100
    if "weighted" in case:
        kw["weight"] = torch.rand(5, dtype=torch.float64)
    if case == "probabilities":
        t = torch.softmax(torch.randn(7, 5, dtype=torch.float64), -1)
    if case == "positions":
        x, t = torch.randn(3, 5, 4, dtype=torch.float64), torch.randint(0, 5, (3, 4))
    total = F.cross_entropy(x, t, reduction="sum", **kw)
    torch.testing.assert_close(total / mean_count("classes", x.numel(), t, kw), F.cross_entropy(x, t, **kw))
    assert mean_count("numel", x.numel(), t, kw) == x.numel()


def test_class_count_in_a_graph_counts_as_eagerly() -> None:
    """The operations ``class_count`` is given decide where it computes: recorded into a list here (as capture
    adds graph nodes), the result is the eager count."""
    t = torch.tensor([1, -100, 3, 2, -100])
    calls: list[str] = []

    class Ops:
        def ne(self, x: torch.Tensor, v: int) -> torch.Tensor:
            calls.append("ne")
            return x != v

        def sum(self, x: torch.Tensor) -> torch.Tensor:
            calls.append("sum")
            return x.sum()

    assert int(class_count(t, -100, Ops())) == int(class_count(t)) == 3 and calls == ["ne", "sum"]
