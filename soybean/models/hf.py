"""Hugging Face ``transformers`` models as soybean model references: ``hf:gpt2``, ``hf:bert``, ``hf:llama``.

``hf:NAME`` names any ``model_type`` that ``transformers.AutoConfig`` knows.  The model is built from
its config class with random weights: nothing is downloaded.  Keywords (``--arg key=value`` on the
command line, ``**kwargs`` here) are config overrides, except for these, which soybean reads:

* ``batch`` (default 8), ``seq`` (default: the config's ``max_position_embeddings``, at most 1024):
  the shape of the example ``input_ids`` and ``labels``;
* ``seed`` (default 0): ``torch.manual_seed`` before the weights and the example batch are drawn;
* ``meta`` (default False): build weights and inputs on the meta device, so that ``soybean plan``
  can plan GPT-2-medium-sized configs without allocating them.

Examples: ``hf:gpt2 n_layer=2 n_embd=128 n_head=4``; ``hf:llama num_hidden_layers=2
hidden_size=64 num_attention_heads=4 num_key_value_heads=2 intermediate_size=128``.

Every dropout-like probability of the config (a float field whose name contains ``drop``:
``resid_pdrop``, ``hidden_dropout_prob``, ``layerdrop``...) is set to 0 unless overridden, so a
parallel run reproduces the serial one exactly; ``use_cache=False`` (training has no KV cache); attention uses
``attn_implementation="sdpa"`` where the class supports it (one ``scaled_dot_product_attention``
op, which soybean has a rule for).  Token ids of the config outside a shrunken ``vocab_size``
(GPT-2's ``bos``/``eos`` 50256 with ``vocab_size=128``) become ``None``.

The head is the language-modelling one: ``GPT2LMHeadModel``, ``BertForMaskedLM``,
``LlamaForCausalLM``, and for other types the class ``AutoModelForMaskedLM`` (encoders such as
RoBERTa, pretrained that way), else ``AutoModelForCausalLM`` maps the config to (causal first
when the config says ``is_decoder``).  soybean trains a model that returns its loss, so
the model is wrapped in :class:`LossOnly`, whose ``forward(input_ids, labels)`` returns
``model(input_ids=input_ids, labels=labels).loss``: the model computes its own (shifted, for
causal LMs) cross-entropy.  Parameter names gain the prefix ``model.``.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

INSTALL_HINT = "Hugging Face models need transformers: pip install -e '.[hf]'"

# model_type -> the transformers class with a language-modelling head (others: the Auto classes)
HEADS: dict[str, str] = {"gpt2": "GPT2LMHeadModel", "bert": "BertForMaskedLM", "llama": "LlamaForCausalLM"}


def _transformers() -> ModuleType:
    """The ``transformers`` module, or a ``ValueError`` saying how to install it."""
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise ValueError(INSTALL_HINT) from None


class LossOnly(nn.Module):
    """A Hugging Face model with labels that returns only its loss tensor.

    soybean captures and trains ``module(*inputs)`` as the loss; a ``ModelOutput`` is not a tensor.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def make_config(model_type: str, overrides: dict[str, Any]) -> Any:
    """The config of ``model_type`` with ``overrides``, dropout 0, no KV cache, in-range token ids.

    Overrides go to the config's constructor, so derived fields (Llama's ``head_dim``) follow them.
    """
    tf = _transformers()
    defaults = tf.AutoConfig.for_model(model_type).to_dict()
    kwargs = {k: 0.0 for k, v in defaults.items() if isinstance(v, float) and "drop" in k}  # dropout, pdrop, layerdrop
    kwargs.update(use_cache=False, **overrides)
    vocab = kwargs.get("vocab_size", defaults.get("vocab_size"))
    if isinstance(vocab, int):
        kwargs.update({k: None for k, v in defaults.items()
                       if k.endswith("_token_id") and k not in overrides and isinstance(v, int) and not 0 <= v < vocab})
    return tf.AutoConfig.for_model(model_type, **kwargs)


def head_class(model_type: str, config: Any) -> type[nn.Module]:
    """The language-modelling class for ``model_type`` (``HEADS``, else the masked or causal Auto mapping)."""
    tf = _transformers()
    if model_type in HEADS:
        return getattr(tf, HEADS[model_type])
    autos = ("AutoModelForCausalLM", "AutoModelForMaskedLM")
    for auto in autos if getattr(config, "is_decoder", False) else autos[::-1]:
        mapping = getattr(tf, auto)._model_mapping
        if type(config) in mapping:
            return mapping[type(config)]
    raise ValueError(f"hf:{model_type} has no causal or masked language-modelling head in transformers")


def build(model_type: str, *, batch: int = 8, seq: int | None = None, seed: int = 0, meta: bool = False,
          **overrides: Any) -> tuple[nn.Module, tuple]:
    """``(LossOnly(model), (input_ids, labels))`` for ``hf:model_type`` with random weights."""
    config = make_config(model_type, overrides)
    cls = head_class(model_type, config)
    if getattr(cls, "_supports_sdpa", False):
        config._attn_implementation = "sdpa"  # what from_pretrained(attn_implementation="sdpa") sets
    vocab = int(config.vocab_size)
    if seq is None:
        seq = min(1024, int(getattr(config, "max_position_embeddings", 1024) or 1024))
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = LossOnly(cls(config))
        model.train()
        input_ids = torch.randint(0, vocab, (batch, seq))
        labels = torch.randint(0, vocab, (batch, seq))
    return model, (input_ids, labels)


def factory(model_type: str) -> Callable[..., tuple[nn.Module, tuple]]:
    """A model-reference factory: ``fn(**kwargs) -> (model, example_inputs)`` for ``hf:model_type``."""
    if model_type not in _transformers().CONFIG_MAPPING:
        raise ValueError(f"hf:{model_type}: transformers has no model type {model_type!r} "
                         "(try hf:gpt2, hf:bert or hf:llama)")

    def fn(**kwargs: Any) -> tuple[nn.Module, tuple]:
        return build(model_type, **kwargs)

    fn.__name__ = f"hf_{model_type}"
    fn.__doc__ = f"hf:{model_type} with random weights (see soybean.hf)."
    return fn
