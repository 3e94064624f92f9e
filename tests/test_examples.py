"""The example model factories build, train one step, and export."""

import pytest
import torch

from examples.models import FACTORIES, alexnet, inception, mlp, resnet, towers, transformer, unet, vgg16, volume_net

pytestmark = pytest.mark.unit

TINY = {
    "mlp": dict(batch=4, hidden=16, layers=2, in_features=8, out_features=6),
    "mlp_cls": dict(batch=4, hidden=16, layers=0, classes=5),
    "alexnet": dict(batch=2, image=32, classes=10, width=0.0625),
    "vgg16": dict(batch=2, image=32, classes=10, width=0.0625),
    "resnet18": dict(batch=2, image=32, classes=10, depth=18, width=0.125),
    "resnet34": dict(batch=2, image=32, classes=10, depth=34, width=0.0625),
    "transformer": dict(batch=2, seq=8, hidden=16, layers=2, heads=4),
    "transformer_lm": dict(batch=2, seq=8, hidden=16, layers=2, heads=4, vocab=50),
    "unet": dict(batch=1, image=16, channels=2),
    "volume_net": dict(batch=1, volume=8, channels=2),
    "towers": dict(batch=2, width=8, layers=2),
    "inception": dict(batch=2, image=8, width=0.1, blocks=2),
}
FACTORY_OF = {
    "mlp": mlp, "mlp_cls": mlp, "alexnet": alexnet, "vgg16": vgg16,
    "resnet18": resnet, "resnet34": resnet,
    "transformer": transformer, "transformer_lm": transformer, "unet": unet, "volume_net": volume_net,
    "towers": towers, "inception": inception,
}


def test_factories_registry():
    assert set(FACTORIES) == {"mlp", "alexnet", "vgg16", "resnet", "transformer", "unet", "volume_net", "llama3",
                              "towers", "inception"}


@pytest.mark.parametrize("name", sorted(TINY))
def test_forward_backward(name):
    model, inputs = FACTORY_OF[name](**TINY[name])
    assert isinstance(inputs, tuple)
    loss = model(*inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", sorted(TINY))
def test_export(name):
    model, inputs = FACTORY_OF[name](**TINY[name])
    ep = torch.export.export(model, inputs, strict=False)
    out = ep.module()(*inputs)
    assert out.dim() == 0 and torch.isfinite(out)


@pytest.mark.parametrize("name", sorted(TINY))
def test_deterministic(name):
    m1, in1 = FACTORY_OF[name](**TINY[name])
    m2, in2 = FACTORY_OF[name](**TINY[name])
    for a, b in zip(in1, in2):
        assert torch.equal(a, b)
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert torch.equal(m1(*in1), m2(*in2))
    m3, in3 = FACTORY_OF[name](**TINY[name], seed=1)
    assert not torch.equal(in1[0], in3[0])


def test_without_target_returns_output():
    model, (x, _) = transformer(**TINY["transformer"])
    assert model(x).shape == x.shape
    model, (ids, _) = transformer(**TINY["transformer_lm"])
    assert model(ids).shape == (2, 8, 50)
    model, (imgs, _) = alexnet(**TINY["alexnet"])
    assert model(imgs).shape == (2, 10)
    model, (x, _) = mlp(**TINY["mlp"])
    assert model(x).shape == (4, 6)


def test_mlp_layer_count():
    model, _ = mlp(hidden=8, layers=3, in_features=4, out_features=2)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 3 + 2
    assert len(model.hidden) == 3


def test_transformer_tied_head_and_names():
    model, _ = transformer(**TINY["transformer_lm"])
    assert model.lm_head.weight is model.wte.weight
    names = dict(model.named_parameters())
    assert "lm_head.weight" not in names  # deduplicated: one shared parameter
    assert "wte.weight" in names
    modules = dict(model.named_modules())
    for n in ("blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v", "blocks.0.attn.o",
              "blocks.0.mlp.fc1", "blocks.0.mlp.fc2", "blocks.1.ln1", "ln_f"):
        assert isinstance(modules[n], (torch.nn.Linear, torch.nn.LayerNorm)), n
    assert modules["blocks.0.mlp.fc1"].out_features == 4 * 16


def test_resnet_batchnorm_buffers():
    model, inputs = resnet(**TINY["resnet18"])
    buffers = dict(model.named_buffers())
    assert "bn1.running_mean" in buffers and "bn1.running_var" in buffers
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    before = buffers["bn1.running_mean"].clone()
    model(*inputs)
    assert not torch.equal(before, model.bn1.running_mean)  # training-mode BN


def test_dropout_defaults_to_zero():
    for name, kwargs in TINY.items():
        model, _ = FACTORY_OF[name](**kwargs)
        assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules()), name
    model, _ = transformer(**TINY["transformer"], dropout=0.1)
    assert any(isinstance(m, torch.nn.Dropout) for m in model.modules())


@pytest.mark.parametrize("image", [32, 64, 224])
def test_alexnet_vgg_image_sizes(image):
    for fn in (alexnet, vgg16):
        model, inputs = fn(batch=1, image=image, classes=3, width=1 / 64)
        assert torch.isfinite(model(*inputs))
