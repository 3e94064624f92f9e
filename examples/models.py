"""Example models for soybean.

Every factory has the signature ``fn(**kwargs) -> (model, example_inputs)``:

* ``model`` is a plain ``torch.nn.Module`` built from ``torch.nn`` /
  ``torch.nn.functional`` only, in training mode;
* ``example_inputs`` is a tuple of tensors whose LAST element is the
  target (regression target or integer labels), so ``model(*example_inputs)``
  returns the scalar training LOSS and a training loop can call
  ``loss.backward()`` directly.  Called without the target, every model
  returns its output (logits / activations) instead.

Factories are deterministic: they call ``torch.manual_seed(seed)`` first,
then build the parameters, then the inputs.  All sizes are keywords with
realistic defaults; pass small values for tests.  Dropout defaults to 0.0
everywhere (and a dropout of 0 inserts no dropout op at all), so a parallel
run can reproduce a serial run exactly.  No model has data-dependent Python
control flow: every branch depends only on constructor arguments, so all of
them capture with ``torch.export.export(model, inputs, strict=False)``.

Image models keep working for images as small as 32x32: a max-pool whose
input would be smaller than its window (known at construction time) is
replaced by ``nn.Identity``, and the classifier heads use adaptive average
pooling, exactly as torchvision does.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["mlp", "alexnet", "vgg16", "resnet", "transformer", "unet", "volume_net", "towers", "inception",
           "FACTORIES"]


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def _scale(n: int, width: float) -> int:
    """Scale a channel / feature count by ``width`` (at least 1)."""
    return max(1, int(round(n * width)))


def _dropout(p: float) -> nn.Module:
    """A dropout layer, or Identity when p == 0 (keeps the graph op-free)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


def _conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _maxpool(size: int, kernel: int = 3, stride: int = 2, padding: int = 0):
    """MaxPool2d(kernel, stride, padding), or Identity when the input (of
    spatial size ``size``) is too small for the window.  Returns the module
    and the output spatial size."""
    if size + 2 * padding < kernel:
        return nn.Identity(), size
    return nn.MaxPool2d(kernel, stride, padding), _conv_out(size, kernel, stride, padding)


class _Classifier(nn.Module):
    """Base for image classifiers: ``forward(images, labels=None)``."""

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None):
        out = self.logits(images)
        if labels is None:
            return out
        return F.cross_entropy(out, labels)


def _image_inputs(batch: int, in_channels: int, image: int, classes: int):
    images = torch.randn(batch, in_channels, image, image)
    labels = torch.randint(0, classes, (batch,))
    return images, labels


# --------------------------------------------------------------------------
# MLP
# --------------------------------------------------------------------------


class MLP(nn.Module):
    """``inp`` Linear(in->hidden), ReLU, then ``layers`` x [Linear(hidden->
    hidden), ReLU] in ``hidden``, then ``out`` Linear(hidden->out).

    ``layers`` counts the hidden->hidden Linear layers only, so ``layers=2``
    means two hidden->hidden layers and ``layers + 2`` Linear layers in
    total (``layers=0``: in -> hidden -> out).
    """

    def __init__(self, in_features: int, hidden: int, out_features: int,
                 layers: int, classification: bool):
        super().__init__()
        self.inp = nn.Linear(in_features, hidden)
        self.hidden = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, out_features)
        self.classification = classification

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        h = F.relu(self.inp(x))
        for layer in self.hidden:
            h = F.relu(layer(h))
        out = self.out(h)
        return out if y is None else self.loss_fn(out, y)

    def loss_fn(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training loss, also for loops that compute it outside the model: ``model.loss_fn(model(x), y)``."""
        if self.classification:
            return F.cross_entropy(out, y)
        return F.mse_loss(out, y)


def mlp(batch: int = 32, hidden: int = 4096, layers: int = 2,
        in_features: int | None = None, out_features: int | None = None,
        classes: int | None = None, seed: int = 0):
    """MLP with ``layers`` hidden->hidden Linear layers (``layers + 2``
    Linear layers in all).  Inputs ``(x, y)``: x is (batch, in_features);
    y is a (batch, out_features) regression target (MSE loss) or, when
    ``classes`` is given, (batch,) integer labels (cross-entropy loss, and
    out_features defaults to ``classes``).  in/out features default to
    ``hidden``."""
    if layers < 0:
        raise ValueError(f"layers must be >= 0, got {layers}")
    in_features = hidden if in_features is None else in_features
    if classes is not None:
        if out_features is not None and out_features != classes:
            raise ValueError("out_features must equal classes when both are given")
        out_features = classes
    out_features = hidden if out_features is None else out_features

    torch.manual_seed(seed)
    model = MLP(in_features, hidden, out_features, layers, classes is not None)
    x = torch.randn(batch, in_features)
    if classes is not None:
        y = torch.randint(0, classes, (batch,))
    else:
        y = torch.randn(batch, out_features)
    return model, (x, y)


def sequential_mlp(batch: int = 2048, hidden: int = 512, layers: int = 2, in_features: int = 256,
                   out_features: int = 64, seed: int = 0):
    """A plain ``nn.Sequential`` of Linear + ReLU returning logits, with no target (the exception to the
    module's rule): what a user's model often is.  Inputs ``(x,)``; a loop computes its loss outside."""
    torch.manual_seed(seed)
    dims = [in_features] + [hidden] * (layers + 1)
    body: list[nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        body += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*body, nn.Linear(hidden, out_features))
    return model, (torch.randn(batch, in_features),)


# --------------------------------------------------------------------------
# AlexNet
# --------------------------------------------------------------------------


class AlexNet(_Classifier):
    """Single-tower AlexNet ("One weird trick", Krizhevsky 2014), the
    torchvision layout: ``features`` (5 convs, 3 max-pools), ``avgpool``
    (adaptive, 6x6), ``classifier`` (FC 4096-4096-classes)."""

    def __init__(self, image: int, classes: int, width: float, dropout: float,
                 in_channels: int = 3):
        super().__init__()
        c1, c2, c3, c4, c5 = (_scale(c, width) for c in (64, 192, 384, 256, 256))
        fc = _scale(4096, width)

        s = _conv_out(image, 11, 4, 2)
        if s < 1:
            raise ValueError(f"image {image} too small for AlexNet")
        pool1, s = _maxpool(s)
        pool2, s = _maxpool(s)  # conv2 (k5, p2) keeps the size
        pool3, s = _maxpool(s)  # conv3-5 (k3, p1) keep the size
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, kernel_size=11, stride=4, padding=2),
            nn.ReLU(inplace=False),
            pool1,
            nn.Conv2d(c1, c2, kernel_size=5, padding=2),
            nn.ReLU(),
            pool2,
            nn.Conv2d(c2, c3, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c3, c4, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c4, c5, kernel_size=3, padding=1),
            nn.ReLU(),
            pool3,
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            _dropout(dropout),
            nn.Linear(c5 * 6 * 6, fc),
            nn.ReLU(),
            _dropout(dropout),
            nn.Linear(fc, fc),
            nn.ReLU(),
            nn.Linear(fc, classes),
        )

    def logits(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def alexnet(batch: int = 128, image: int = 224, classes: int = 1000,
            width: float = 1.0, dropout: float = 0.0, in_channels: int = 3,
            seed: int = 0):
    """AlexNet; inputs ``(images (batch, in_channels, image, image), labels
    (batch,))``, cross-entropy loss.  ``width`` scales every conv channel
    count and FC width (4096)."""
    torch.manual_seed(seed)
    model = AlexNet(image, classes, width, dropout, in_channels)
    return model, _image_inputs(batch, in_channels, image, classes)


# --------------------------------------------------------------------------
# VGG-16
# --------------------------------------------------------------------------

_VGG16_CFG = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
              512, 512, 512, "M", 512, 512, 512, "M"]


class VGG(_Classifier):
    """VGG (Simonyan & Zisserman), torchvision layout without BatchNorm:
    ``features`` (3x3 convs + ReLU, 2x2 max-pools), ``avgpool`` (adaptive,
    7x7), ``classifier`` (FC 4096-4096-classes)."""

    def __init__(self, cfg, image: int, classes: int, width: float,
                 dropout: float, in_channels: int = 3):
        super().__init__()
        layers: list[nn.Module] = []
        c, s = in_channels, image
        for v in cfg:
            if v == "M":
                pool, s = _maxpool(s, kernel=2, stride=2)
                layers.append(pool)
            else:
                out = _scale(v, width)
                layers += [nn.Conv2d(c, out, kernel_size=3, padding=1), nn.ReLU()]
                c = out
        fc = _scale(4096, width)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(c * 7 * 7, fc),
            nn.ReLU(),
            _dropout(dropout),
            nn.Linear(fc, fc),
            nn.ReLU(),
            _dropout(dropout),
            nn.Linear(fc, classes),
        )

    def logits(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def vgg16(batch: int = 64, image: int = 224, classes: int = 1000,
          width: float = 1.0, dropout: float = 0.0, in_channels: int = 3,
          seed: int = 0):
    """VGG-16 (configuration D: 13 convs + 3 FC); inputs ``(images, labels)``,
    cross-entropy loss.  ``width`` scales conv channels and FC width."""
    torch.manual_seed(seed)
    model = VGG(_VGG16_CFG, image, classes, width, dropout, in_channels)
    return model, _image_inputs(batch, in_channels, image, classes)


# --------------------------------------------------------------------------
# ResNet-18 / 34
# --------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN + shortcut (1x1 conv + BN when the shape
    changes), then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        else:
            self.downsample = None

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


_RESNET_BLOCKS = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}


class ResNet(_Classifier):
    """ResNet (He et al.), torchvision layout: ``conv1``/``bn1`` 7x7 stem,
    ``maxpool``, ``layer1``..``layer4`` of basic blocks, ``avgpool``
    (adaptive 1x1), ``fc``.  BatchNorm runs in training mode (batch
    statistics; running-stat buffers are updated)."""

    def __init__(self, depth: int, classes: int, width: float, in_channels: int = 3):
        super().__init__()
        if depth not in _RESNET_BLOCKS:
            raise ValueError(f"depth must be one of {sorted(_RESNET_BLOCKS)}, got {depth}")
        chans = [_scale(c, width) for c in (64, 128, 256, 512)]
        self.conv1 = nn.Conv2d(in_channels, chans[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(chans[0])
        # padding=1 keeps this pool valid for any input size >= 1
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = chans[0]
        for i, (n, c) in enumerate(zip(_RESNET_BLOCKS[depth], chans)):
            blocks = []
            for j in range(n):
                stride = 2 if (j == 0 and i > 0) else 1
                blocks.append(BasicBlock(cin, c, stride))
                cin = c
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def logits(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet(batch: int = 32, image: int = 224, classes: int = 1000,
           depth: int = 18, width: float = 1.0, in_channels: int = 3,
           seed: int = 0):
    """ResNet-18 or -34 (``depth``) with BatchNorm2d in training mode; inputs
    ``(images, labels)``, cross-entropy loss.  ``width`` scales the stage
    channel counts (64/128/256/512)."""
    torch.manual_seed(seed)
    model = ResNet(depth, classes, width, in_channels)
    return model, _image_inputs(batch, in_channels, image, classes)


# --------------------------------------------------------------------------
# GPT-2-style transformer
# --------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head causal self-attention with separate ``q``, ``k``, ``v``
    and output ``o`` projections; SDPA on (B, heads, S, head_dim)."""

    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.heads = heads
        self.head_dim = hidden // heads
        self.dropout = dropout
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x):
        B, S, H = x.shape
        q = self.q(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        p = self.dropout if (self.training and self.dropout > 0) else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(B, S, H)
        return self.o(y)


class FeedForward(nn.Module):
    """``fc1`` (hidden->ffn), GELU, ``fc2`` (ffn->hidden)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-LayerNorm decoder block:
    x + drop(attn(ln1(x))), then x + drop(mlp(ln2(x)))."""

    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = FeedForward(hidden, ffn)
        self.drop1 = _dropout(dropout)
        self.drop2 = _dropout(dropout)

    def forward(self, x):
        x = x + self.drop1(self.attn(self.ln1(x)))
        x = x + self.drop2(self.mlp(self.ln2(x)))
        return x


class Transformer(nn.Module):
    """GPT-2-style decoder stack.

    Module names: ``blocks.{i}.ln1``, ``blocks.{i}.attn.{q,k,v,o}``,
    ``blocks.{i}.ln2``, ``blocks.{i}.mlp.{fc1,fc2}``, ``ln_f``; with a
    vocabulary also ``wte`` (token embedding), ``wpe`` (learned positions,
    ``seq`` of them) and ``lm_head`` (bias-free, weight tied to
    ``wte.weight``).

    Without a vocabulary ``forward(x, target=None)`` takes float activations
    (batch, seq, hidden) and returns ln_f's output, or the MSE against
    ``target``.  With one, ``forward(ids, targets=None)`` returns logits
    (batch, seq, vocab) or the cross-entropy against ``targets``.
    """

    def __init__(self, seq: int, hidden: int, layers: int, heads: int, ffn: int,
                 vocab: int | None, dropout: float):
        super().__init__()
        self.vocab = vocab
        if vocab is not None:
            self.wte = nn.Embedding(vocab, hidden)
            self.wpe = nn.Embedding(seq, hidden)
        self.drop = _dropout(dropout)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        if vocab is not None:
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self._init_weights(layers)
        if vocab is not None:
            self.lm_head.weight = self.wte.weight  # tie after init

    def _init_weights(self, layers: int):
        # GPT-2 initialisation: N(0, 0.02), zero biases, residual output
        # projections scaled by 1/sqrt(2 * layers).
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        std = 0.02 / math.sqrt(2 * max(1, layers))
        for b in self.blocks:
            nn.init.normal_(b.attn.o.weight, mean=0.0, std=std)
            nn.init.normal_(b.mlp.fc2.weight, mean=0.0, std=std)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None):
        if self.vocab is not None:
            S = inputs.shape[1]
            pos = torch.arange(S, device=inputs.device)
            x = self.wte(inputs) + self.wpe(pos)
        else:
            x = inputs
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if self.vocab is None:
            return x if targets is None else F.mse_loss(x, targets)
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def transformer(batch: int = 8, seq: int = 1024, hidden: int = 768,
                layers: int = 12, heads: int = 12, ffn: int | None = None,
                vocab: int | None = None, dropout: float = 0.0, seed: int = 0):
    """GPT-2-style decoder (defaults: GPT-2 small body, 1024 context).

    ``vocab=None``: inputs ``(x, target)``, both float (batch, seq, hidden),
    MSE loss.  Otherwise inputs ``(ids, targets)``, both int64 (batch, seq),
    cross-entropy loss; token embedding + ``seq`` learned positions, LM head
    tied to the token embedding.  ``ffn`` defaults to ``4 * hidden``."""
    ffn = 4 * hidden if ffn is None else ffn
    torch.manual_seed(seed)
    model = Transformer(seq, hidden, layers, heads, ffn, vocab, dropout)
    if vocab is None:
        inputs = (torch.randn(batch, seq, hidden), torch.randn(batch, seq, hidden))
    else:
        inputs = (torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq)))
    return model, inputs


# --------------------------------------------------------------------------
# Dense prediction on large images and volumes (domain parallelism)
# --------------------------------------------------------------------------


class UNet(nn.Module):
    """A two-level 2-D U-Net: padded 3x3 convolutions with batch norm, max-pool down, transposed-conv
    up, skip concatenation, a 1x1 head; ``forward(image, target=None)``, MSE loss against a
    per-pixel target.  Every spatial op keeps or halves the size, so ``image`` divisible by 4 keeps
    the levels aligned."""

    def __init__(self, in_channels: int, channels: int, classes: int) -> None:
        super().__init__()
        c = channels

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())

        self.enc1, self.enc2, self.mid = block(in_channels, c), block(c, 2 * c), block(2 * c, 4 * c)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2), block(4 * c, 2 * c)
        self.up1, self.dec1 = nn.ConvTranspose2d(2 * c, c, 2, stride=2), block(2 * c, c)
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([e2, self.up2(m)], 1))
        out = self.head(self.dec1(torch.cat([e1, self.up1(d2)], 1)))
        return out if target is None else F.mse_loss(out, target)


def unet(batch: int = 1, image: int = 1024, channels: int = 16, in_channels: int = 3, classes: int = 2,
         seed: int = 0):
    """A two-level U-Net on ``image`` x ``image`` inputs; inputs ``(images, target)`` with a per-pixel
    ``classes``-channel regression target.  Batch 1 by default: only a spatial split divides its work."""
    torch.manual_seed(seed)
    model = UNet(in_channels, channels, classes)
    return model, (torch.randn(batch, in_channels, image, image), torch.randn(batch, classes, image, image))


class VolumeNet(nn.Module):
    """A 3-D convolutional net for volumes: a strided 3-D conv, dilated 3-D convs, average pooling,
    nearest upsampling back to full resolution, a 1x1x1 head; ``forward(volume, target=None)``, MSE loss."""

    def __init__(self, in_channels: int, channels: int) -> None:
        super().__init__()
        c = channels
        self.stem = nn.Conv3d(in_channels, c, 3, stride=2, padding=1)
        self.dil1 = nn.Conv3d(c, c, 3, padding=2, dilation=2)
        self.dil2 = nn.Conv3d(c, 2 * c, 3, padding=1)
        self.head = nn.Conv3d(2 * c, in_channels, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None):
        h = F.relu(self.stem(x))
        h = F.relu(self.dil1(h)) + h
        h = F.avg_pool3d(F.relu(self.dil2(h)), 3, stride=1, padding=1)
        out = self.head(F.interpolate(h, scale_factor=2, mode="nearest"))
        return out if target is None else F.mse_loss(out, target)


def volume_net(batch: int = 1, volume: int = 128, channels: int = 8, in_channels: int = 1, seed: int = 0):
    """A 3-D conv net on ``volume``^3 inputs (even ``volume``); inputs ``(volume, target)``, same shape."""
    torch.manual_seed(seed)
    model = VolumeNet(in_channels, channels)
    shape = (batch, in_channels, volume, volume, volume)
    return model, (torch.randn(shape), torch.randn(shape))


# ---- a Llama-3 written as torchtitan writes it ------------------------------------------------------------------
# Rotary embeddings by complex multiplication (a complex64 ``freqs_cis`` table, ``view_as_complex`` on queries and
# keys), grouped-query attention by expand + reshape, SwiGLU feed-forward, RMSNorm, the loss outside the model.
# With ``fused_qkv`` the attention keeps one ``wqkv`` weight and presents it, through state-dict hooks, as the
# ``wq``/``wk``/``wv`` a checkpoint of the unfused model holds.  Like every model here, it returns its loss when
# given the labels.


def _freqs_cis(head_dim: int, seq: int, theta: float = 500000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # (seq, head_dim / 2) complex64


def _rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """``x`` (batch, seq, heads, head_dim) rotated pairwise by the positions' angles."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(xc * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3)
    return rotated.type_as(x)


class Llama3Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, fused_qkv: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        sizes = (heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim)
        self.sizes, self.fused = sizes, fused_qkv
        if fused_qkv:
            self.wqkv = nn.Linear(dim, sum(sizes), bias=False)
            self.register_state_dict_post_hook(_split_qkv)
            self.register_load_state_dict_pre_hook(_fuse_qkv)
        else:
            self.wq, self.wk, self.wv = (nn.Linear(dim, n, bias=False) for n in sizes)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        if self.fused:
            q, k, v = self.wqkv(x).split(self.sizes, dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = _rotate(q.view(b, s, -1, self.head_dim), freqs_cis)
        k = _rotate(k.view(b, s, -1, self.head_dim), freqs_cis)
        v = v.view(b, s, -1, self.head_dim)
        rep = self.heads // self.kv_heads
        k = k.unsqueeze(3).expand(b, s, self.kv_heads, rep, self.head_dim).reshape(b, s, -1, self.head_dim)
        v = v.unsqueeze(3).expand(b, s, self.kv_heads, rep, self.head_dim).reshape(b, s, -1, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def _split_qkv(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post hook: ``wqkv`` presented as ``wq``, ``wk``, ``wv``."""
    fused = state.pop(prefix + "wqkv.weight")
    for name, part in zip(("wq", "wk", "wv"), fused.split(list(module.sizes), dim=0)):
        state[f"{prefix}{name}.weight"] = part


def _fuse_qkv(module: nn.Module, state: dict, prefix: str, *args: object) -> None:
    """Load-state-dict pre hook: ``wq``, ``wk``, ``wv`` made into ``wqkv``."""
    names = [f"{prefix}{n}.weight" for n in ("wq", "wk", "wv")]
    if all(n in state for n in names):
        state[prefix + "wqkv.weight"] = torch.cat([state.pop(n) for n in names], dim=0)


class Llama3Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int, fused_qkv: bool) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)
        self.attention = Llama3Attention(dim, heads, kv_heads, fused_qkv)
        self.w1, self.w2, self.w3 = nn.Linear(dim, ffn, bias=False), nn.Linear(ffn, dim, bias=False), \
            nn.Linear(dim, ffn, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs_cis)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama3(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, ffn: int, seq: int,
                 fused_qkv: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Llama3Block(dim, heads, kv_heads, ffn, fused_qkv) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", _freqs_cis(dim // heads, seq), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs_cis)
        logits = self.output(self.norm(h))
        return logits if labels is None else self.loss_fn(logits, labels)

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """torchtitan's loss, computed outside the model by its trainer (``--loss outside``)."""
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def llama3(batch: int = 2, seq: int = 64, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4,
           kv_heads: int = 2, ffn: int = 160, fused_qkv: bool = False, seed: int = 0):
    """A Llama-3 in torchtitan's style (``Llama3``); ``example_inputs`` are ``(tokens, labels)``; its trainer's loss
    computed outside the model is ``Llama3.loss_fn``."""
    torch.manual_seed(seed)
    model = Llama3(vocab, dim, layers, heads, kv_heads, ffn, seq, fused_qkv)
    tokens = torch.randint(0, vocab, (batch, seq))
    return model, (tokens, torch.randint(0, vocab, (batch, seq)))



# --------------------------------------------------------------------------
# parallel branches (DLPlacer's case): towers and Inception-style blocks
# --------------------------------------------------------------------------


class Towers(nn.Module):
    """``towers`` independent stacks of ``layers`` (Linear ``width`` -> ``width`` + tanh) reading the same input,
    concatenated into a linear head: the branches DLPlacer places on their own devices."""

    def __init__(self, towers: int, layers: int, width: int, classes: int):
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())))
            for _ in range(towers))
        self.head = nn.Linear(towers * width, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        out = self.head(torch.cat([t(x) for t in self.towers], dim=-1))
        return out if y is None else self.loss_fn(out, y)

    def loss_fn(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training loss, also for loops that compute it outside the model: ``model.loss_fn(model(x), y)``."""
        return F.cross_entropy(out, y)


def towers(batch: int = 8, width: int = 512, layers: int = 16, towers: int = 2, classes: int = 10, seed: int = 0):
    """Two (``towers``) independent stacks of ``layers`` Linear+tanh layers of ``width``, concatenated into a
    classifier head.  Inputs ``(x, y)``: x is (batch, width), y (batch,) labels."""
    torch.manual_seed(seed)
    model = Towers(towers, layers, width, classes)
    return model, (torch.randn(batch, width), torch.randint(0, classes, (batch,)))


class _InceptionBlock(nn.Module):
    """Four branches of different widths on one input, concatenated on channels (Inception-v1/v3's block): 1x1;
    1x1 then 3x3; 1x1 then two 3x3 (a 5x5's factorisation, v3); 3x3 max-pool then 1x1."""

    def __init__(self, cin: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, cp: int):
        super().__init__()

        def conv(a: int, b: int, k: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(a, b, k, padding=k // 2), nn.ReLU())

        self.b1 = conv(cin, c1, 1)
        self.b3 = nn.Sequential(conv(cin, c3r, 1), conv(c3r, c3, 3))
        self.b5 = nn.Sequential(conv(cin, c5r, 1), conv(c5r, c5, 3), conv(c5, c5, 3))
        self.bp = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), conv(cin, cp, 1))
        self.out_channels = c1 + c3 + c5 + cp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], dim=1)


class Inception(nn.Module):
    """A stem convolution, ``blocks`` Inception blocks (``_InceptionBlock``, GoogLeNet's 3a/3b widths scaled by
    ``width``) and a classifier."""

    def __init__(self, blocks: int, width: float, classes: int, in_channels: int = 3):
        super().__init__()
        stem = _scale(64, width)
        self.stem = nn.Sequential(nn.Conv2d(in_channels, stem, 3, padding=1), nn.ReLU())
        mods, c = [], stem
        widths = [(64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64)]
        for i in range(blocks):
            w = [_scale(n, width) for n in widths[i % 2]]
            block = _InceptionBlock(c, *w)
            mods.append(block)
            c = block.out_channels
        self.blocks = nn.Sequential(*mods)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        h = self.blocks(self.stem(x)).mean(dim=(2, 3))
        out = self.fc(h)
        return out if y is None else self.loss_fn(out, y)

    def loss_fn(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training loss, also for loops that compute it outside the model: ``model.loss_fn(model(x), y)``."""
        return F.cross_entropy(out, y)


def inception(batch: int = 8, image: int = 28, blocks: int = 2, width: float = 1.0, classes: int = 10,
              in_channels: int = 3, seed: int = 0):
    """Inception-style network (``Inception``): four branches of different widths per block.  Inputs ``(x,
    y)``: x is (batch, in_channels, image, image), y (batch,) labels."""
    torch.manual_seed(seed)
    model = Inception(blocks, width, classes, in_channels)
    return model, (torch.randn(batch, in_channels, image, image), torch.randint(0, classes, (batch,)))

FACTORIES = {
    "mlp": mlp,
    "alexnet": alexnet,
    "vgg16": vgg16,
    "resnet": resnet,
    "transformer": transformer,
    "unet": unet,
    "volume_net": volume_net,
    "llama3": llama3,
    "towers": towers,
    "inception": inception,
}
