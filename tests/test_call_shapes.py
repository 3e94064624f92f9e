"""A call with shapes other than the example's (an epoch's last, smaller batch) is one clear error, not a failure
deep in a collective ("all_gather: member 0 of 2 holds 3 along dim 0 ...") nor a plan run on shapes it was not made
for."""
from __future__ import annotations

import pytest
import torch

from soybean.mesh import Mesh
from soybean.runtime.launch import run_threads

pytestmark = pytest.mark.sim


@pytest.mark.parametrize("local_batch", [False, True])
def test_a_batch_of_another_size_is_refused_naming_the_fix(local_batch: bool) -> None:
    import soybean

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(8, 8)
    plan = soybean.plan(model, (x,), devices=2, mode="dp", local_batch=local_batch)

    def rank(r: int, groups: list) -> str:
        pm = soybean.parallelize(model, (x,), plan=plan, outputs="full", rank=r, groups=groups)
        mine = pm.local_slice(x) if local_batch else x  # the example's shape (this rank's rows of it): runs
        with torch.no_grad():
            pm(mine)
        with pytest.raises(ValueError) as e:
            pm(mine[:-1])
        return str(e.value)

    want = (4, 8) if local_batch else (8, 8)
    for why in run_threads(Mesh((2,)), rank):
        assert f"has shape ({want[0] - 1}, 8), but this module was planned for {want}" in why
        assert "drop_last=True" in why and "parallelize again" in why
