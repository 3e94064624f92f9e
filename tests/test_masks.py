"""A causal mask too large to build, read from its parts (``masks.mask_meaning``,
``capture.passes.fold_constant_masks``): transformers exports its causal mask as a comparison of key and query
positions; at long context it is folded into ``is_causal`` without being evaluated, and a mask that is not causal
stays."""
from __future__ import annotations

import pytest
import torch

from soybean.capture import core as C
from soybean.capture.passes import fold_constant_masks
from soybean.capture.passes.masks import ALL, CAUSAL, _compare

pytestmark = pytest.mark.unit

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _attention(cap: C.Captured) -> list[tuple[bool, object]]:
    """(has a mask, is_causal) of every attention op."""
    return [(n.args[3] is not None, n.args[5] if len(n.args) > 5 else None) for n in cap.graph.nodes
            if n.op == "call_function" and n.target is SDPA]


def test_positions_compared_read_as_causal_only_when_they_are() -> None:
    """``key <= query`` over ascending positions is causal, in either operand order and with strict ``<`` shifted
    by one; unsorted keys, the reverse relation, or equal positions that are not all one value are not read."""
    q = torch.arange(6).reshape(1, 1, 6, 1)
    k = torch.arange(6).reshape(1, 1, 1, 6)
    shape = (2, 1, 6, 6)
    assert _compare("le", k, q, shape) == CAUSAL and _compare("ge", q, k, shape) == CAUSAL
    assert _compare("lt", k, q + 1, shape) == CAUSAL and _compare("gt", q + 1, k, shape) == CAUSAL
    assert _compare("lt", k, q, shape) is None  # strictly before: the diagonal masked
    assert _compare("ge", k, q, shape) is None  # key >= query: the upper triangle
    assert _compare("le", k[..., [1, 0, 2, 3, 4, 5]], q, shape) is None  # keys out of order
    assert _compare("le", k * 2, q * 2 + 1, shape) == CAUSAL  # other positions, the same order: causal
    assert _compare("le", k * 2, q * 2 + 2, shape) is None  # one key too many for each row
    assert _compare("eq", q * 0 + 3, k * 0 + 3, shape) == ALL and _compare("eq", q * 0, k * 0 + 1, shape) is None
    assert _compare("eq", q, k, shape) is None


@pytest.mark.parametrize("name,cfg", [
    ("llama", dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=100)),
    ("gpt2", dict(n_layer=1, n_embd=64, n_head=4, vocab_size=100)),
    ("qwen2", dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=100)),
    ("mistral", dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=100, sliding_window=4))])
def test_a_mask_too_large_to_build_folds_as_the_built_one_does(name: str, cfg: dict,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With the size limit below the scores (so the mask is read from its parts) capture gives every attention op
    the mask or ``is_causal`` that evaluating the mask gives: causal for Llama, GPT-2 and Qwen2; Mistral's sliding
    window is not causal and stays."""
    pytest.importorskip("transformers")
    from soybean.models import load

    model, inputs = load("hf:" + name, dict(cfg, seq=16, batch=2))
    built = _attention(C.capture(model, inputs))
    monkeypatch.setattr(fold_constant_masks, "MAX_FOLDED_MASK", 100)  # scores 2 x 4 x 16 x 16; the positions 2 x 16
    assert _attention(C.capture(model, inputs)) == built
    assert all(causal for _, causal in built) != (name == "mistral")


def test_llama_at_128k_tokens_captures_causal_attention() -> None:
    """Issue 23's long-context point: a Llama-3-8B layer at 131,072 tokens (meta device, batch 8) captures its
    attention as ``is_causal`` (the mask would be 8 x 128K x 128K booleans), so the causal splits apply."""
    pytest.importorskip("transformers")
    from soybean.models import load

    model, inputs = load("hf:llama", dict(meta=True, num_hidden_layers=1, hidden_size=4096, num_attention_heads=32,
                                          num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                          seq=131072, max_position_embeddings=131072, batch=8))
    assert _attention(C.capture(model, inputs)) == [(False, True)]


@pytest.mark.parametrize("limit", [None, 100])
def test_a_mask_every_layer_reads_is_judged_once(limit: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer's attention reads the one mask value: its meaning is decided once per scores' shape, built or
    read from its parts (each layer judging Llama-3-8B's 8,192 x 8,192 mask again was 4 s of a capture), and every
    layer still gets it."""
    pytest.importorskip("transformers")
    from soybean.capture.passes import masks
    from soybean.models import load

    if limit is not None:
        monkeypatch.setattr(fold_constant_masks, "MAX_FOLDED_MASK", limit)
    calls: list[str] = []
    for name, f in (("judged", masks.judged), ("mask_meaning", masks.mask_meaning)):
        monkeypatch.setattr(fold_constant_masks, name, lambda *a, _f=f, _n=name, **k: calls.append(_n) or _f(*a, **k))
    model, inputs = load("hf:llama", dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, vocab_size=100, seq=16,
                                          batch=2))
    assert _attention(C.capture(model, inputs)) == [(False, True)] * 3
    assert calls == ["judged" if limit is None else "mask_meaning"]
