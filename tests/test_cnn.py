"""ResNet with batch norm in training mode, split by soybean: same loss, gradients, parameters and
running statistics as serial training (``compare`` checks buffers too).

Batch norm runs channel-split while its running statistics are stored whole, so the update an op
makes to its tile must be written back to the stored buffer (``codegen.lower.write_back``); under
data parallelism it runs batch-split with its statistics summed across the split
(``runtime.syncnorm``).  There, float32 gradients through batch norm's backward (per-channel sums
that nearly cancel, taken in another order) differ from serial by ~5e-5 of their scale, beyond the
default ``atol``: the float32 cases allow 1e-4 of the gradients' scale (~9), and in float64 the same
plans agree to 1e-12, which is what the float64 cases check.  The optimal plan on 2
devices splits most convolutions by output channel.
"""
from __future__ import annotations

import pytest
import torch

from examples.models import resnet
from soybean.verify.testing import compare, train_parallel_threads, train_serial

pytestmark = pytest.mark.sim

CASES = [((2,), "dp", torch.float32), ((2,), "auto", torch.float64), ((2, 2), "auto", torch.float32),
         ((2, 2), "dp", torch.float64)]


@pytest.mark.parametrize("mesh,mode,dtype", CASES, ids=[f"{'x'.join(map(str, m))}-{md}-{str(d)[6:]}" for m, md, d in CASES])
def test_resnet_batch_norm_training_equals_serial(mesh: tuple, mode: str, dtype: torch.dtype) -> None:
    model, (images, labels) = resnet(batch=4, image=32, width=0.125, classes=10)
    model, inputs = model.to(dtype), (images.to(dtype), labels)
    serial = train_serial(model, inputs, steps=2)
    assert not torch.equal(serial.buffers["bn1.running_mean"], model.bn1.running_mean)  # statistics move
    par, plan = train_parallel_threads(model, inputs, mesh=mesh, mode=mode, objective="comm", steps=2)
    # float32: 1e-4 of the gradients' scale (see the module docstring); float64: exact to rounding
    bad = compare(serial, par, atol=1e-3) if dtype == torch.float32 else compare(serial, par, rtol=1e-9, atol=1e-11)
    assert not bad, f"plan {plan.params}: " + "; ".join(bad[:5])
    assert set(par.buffers) >= {k for k in serial.buffers if "running" in k}
