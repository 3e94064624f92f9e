"""Hugging Face ``transformers`` models as soybean model references: ``hf:gpt2``, ``hf:t5``, ``hf:vit``, ``hf:whisper``.

``hf:NAME`` names any ``model_type`` that ``transformers.AutoConfig`` knows.  The model is built from
its config class with random weights: nothing is downloaded.  Keywords (``--arg key=value`` on the
command line, ``**kwargs`` here) are config overrides, except for these, which soybean reads:

* ``task``: which head and inputs (``TASKS``); default: the model type's own (``default_task``);
* ``batch`` (default 8), ``seq`` (default: the config's ``max_position_embeddings``, at most 1024):
  the shape of the example token ids and labels (images and audio take their config's sizes);
* ``seed`` (default 0): ``torch.manual_seed`` before the weights and the example batch are drawn;
* ``meta`` (default False): build weights and inputs on the meta device, so that ``soybean plan``
  can plan full-size configs without allocating them;
* ``raw`` (default False): the model as ``transformers`` builds it and its first input alone, returning its
  ``ModelOutput`` (logits), as a user's loop that computes the loss itself calls it.

Examples: ``hf:gpt2 n_layer=2 n_embd=128 n_head=4``; ``hf:t5 num_layers=2 d_model=64``;
``hf:vit task=image-classification``.

Every dropout-like probability of the config (a float field whose name contains ``drop``:
``resid_pdrop``, ``hidden_dropout_prob``, ``layerdrop``...), every SpecAugment mask probability
(``mask_time_prob``...) and the router jitter (``router_jitter_noise``) is set to 0 unless overridden, so a
parallel run reproduces the serial one exactly;
``use_cache=False`` (training has no KV cache); attention uses ``attn_implementation="sdpa"`` where the
class supports it (one ``scaled_dot_product_attention`` op, which soybean has a rule for).  Special token
ids of the config outside a shrunken ``vocab_size`` (GPT-2's ``bos``/``eos`` 50256 with ``vocab_size=128``)
are moved inside it (``in_vocab``).

The tasks (``TASKS``) and the inputs each model takes with its labels:

* ``causal-lm`` (``GPT2LMHeadModel``, ``LlamaForCausalLM``...), ``masked-lm`` (``BertForMaskedLM``...):
  ``input_ids``, ``labels`` (batch x seq token ids);
* ``seq2seq`` (``T5ForConditionalGeneration``, ``BartForConditionalGeneration``...): ``input_ids`` and
  ``labels``, from which the model makes its own ``decoder_input_ids`` (shifted right);
* ``image-classification`` (``ViTForImageClassification``...): ``pixel_values`` (batch x channels x
  the config's ``image_size``), ``labels`` (one class each);
* ``audio-classification`` (``Wav2Vec2ForSequenceClassification``, ``WhisperForAudioClassification``...):
  raw ``input_values`` (batch x 1,600 samples) or ``input_features`` (Whisper's and AST's mel frames),
  ``labels``;
* ``speech-seq2seq`` (``WhisperForConditionalGeneration``...): ``input_features``, ``labels``.

soybean trains a model that returns its loss, so the model is wrapped in :class:`LossOnly`, whose
``forward`` takes those inputs positionally and returns the model's own loss (for causal LMs the shifted
cross-entropy).  Parameter names gain the prefix ``model.``.

A model whose capture unrolls a recurrence over the sequence (RWKV, Mamba's slow path: one set of ops per
token) is refused before capture when its unrolled graph would exceed ``MAX_UNROLLED`` ops
(``check_unrolled``), with the fix: a shorter ``seq``.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

INSTALL_HINT = "Hugging Face models need transformers: pip install -e '.[hf]'"

# model_type -> the transformers class with a language-modelling head (others: the task's Auto mapping)
HEADS: dict[str, str] = {"gpt2": "GPT2LMHeadModel", "bert": "BertForMaskedLM", "llama": "LlamaForCausalLM"}


def _transformers() -> ModuleType:
    """The ``transformers`` module, or a ``ValueError`` saying how to install it."""
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise ValueError(INSTALL_HINT) from None


Inputs = dict[str, torch.Tensor]
InputsFn = Callable[[Any, int, int, torch.device], Inputs]


def _ids(config: Any, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    vocab = int(config.vocab_size)
    return torch.randint(min(3, vocab - 1), vocab, (batch, seq), device=device)


def _text(config: Any, batch: int, seq: int, device: torch.device) -> Inputs:
    return {"input_ids": _ids(config, batch, seq, device), "labels": _ids(config, batch, seq, device)}


def _image_size(config: Any) -> tuple[int, int]:
    size = getattr(getattr(config, "vision_config", config), "image_size", 224)
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _classes(config: Any, batch: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, int(getattr(config, "num_labels", 2)), (batch,), device=device)


def _image(config: Any, batch: int, seq: int, device: torch.device) -> Inputs:
    h, w = _image_size(config)
    channels = int(getattr(getattr(config, "vision_config", config), "num_channels", 3))
    return {"pixel_values": torch.randn(batch, channels, h, w, device=device),
            "labels": _classes(config, batch, device)}


AUDIO_SAMPLES = 1600  # raw waveform samples of an audio example (0.1 s at 16 kHz)


def _audio_features(config: Any, batch: int, device: torch.device) -> Inputs:
    """The audio inputs a model takes: mel frames for Whisper-like encoders (``max_source_positions`` x 2
    frames of ``num_mel_bins``) and the Audio Spectrogram Transformer (``max_length`` x ``num_mel_bins``),
    else a raw waveform."""
    if config.model_type == "audio-spectrogram-transformer":
        return {"input_values": torch.randn(batch, config.max_length, config.num_mel_bins, device=device)}
    if hasattr(config, "num_mel_bins") and hasattr(config, "max_source_positions"):
        frames = 2 * int(config.max_source_positions)
        return {"input_features": torch.randn(batch, config.num_mel_bins, frames, device=device)}
    return {"input_values": torch.randn(batch, AUDIO_SAMPLES, device=device)}


def _audio(config: Any, batch: int, seq: int, device: torch.device) -> Inputs:
    return {**_audio_features(config, batch, device), "labels": _classes(config, batch, device)}


def _speech(config: Any, batch: int, seq: int, device: torch.device) -> Inputs:
    return {**_audio_features(config, batch, device), "labels": _ids(config, batch, seq, device)}


@dataclass(frozen=True)
class Task:
    """A head: the ``transformers`` Auto mapping that names its class per model type, and its example inputs."""

    mapping: str
    inputs: InputsFn


TASKS: dict[str, Task] = {
    "causal-lm": Task("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", _text),
    "masked-lm": Task("MODEL_FOR_MASKED_LM_MAPPING_NAMES", _text),
    "seq2seq": Task("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", _text),
    "image-classification": Task("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", _image),
    "audio-classification": Task("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", _audio),
    "speech-seq2seq": Task("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", _speech),
}


def task_classes(task: str) -> dict[str, str]:
    """``model_type -> class name`` of a task's head in ``transformers``."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: use one of {', '.join(TASKS)}")
    from transformers.models.auto import modeling_auto

    return dict(getattr(modeling_auto, TASKS[task].mapping))


def default_task(model_type: str, config: Any) -> str:
    """The head a model type is trained with by default: an encoder-decoder's sequence-to-sequence head, a
    decoder's causal one, an encoder's masked one (its pretraining), then images, audio, speech."""
    order = ["causal-lm", "masked-lm", "seq2seq", "image-classification", "audio-classification", "speech-seq2seq"]
    if getattr(config, "is_encoder_decoder", False):
        order = ["seq2seq", "speech-seq2seq", *order]
    elif not getattr(config, "is_decoder", False):
        order = ["masked-lm", *order]
    for task in order:
        if model_type in task_classes(task):
            return task
    raise ValueError(f"hf:{model_type} has no head soybean builds (tasks: {', '.join(TASKS)}): "
                     "parallelize the model from your own code")


def head_class(model_type: str, config: Any, task: str | None = None) -> type[nn.Module]:
    """The class of ``model_type``'s head for ``task`` (default ``default_task``; ``HEADS`` for its language model)."""
    tf = _transformers()
    task = task or default_task(model_type, config)
    if model_type in HEADS and task in ("causal-lm", "masked-lm") and task == default_task(model_type, config):
        return getattr(tf, HEADS[model_type])
    classes = task_classes(task)
    if model_type not in classes:
        raise ValueError(f"hf:{model_type} has no {task} head in transformers "
                         f"(it has: {', '.join(t for t in TASKS if model_type in task_classes(t)) or 'none'})")
    name = classes[model_type]
    return getattr(tf, name if isinstance(name, str) else name[0])  # several classes: the first is the task's own


class LossOnly(nn.Module):
    """A Hugging Face model with labels that returns only its loss tensor.

    soybean captures and trains ``module(*inputs)`` as the loss; a ``ModelOutput`` is not a tensor.
    ``names``: the keyword each positional input is passed to the model as.
    """

    def __init__(self, model: nn.Module, names: tuple[str, ...] = ("input_ids", "labels")) -> None:
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, inputs))).loss


# Config fields set to 0 unless overridden: randomness a serial run cannot reproduce in parallel.
RANDOM_FIELDS = ("drop", "mask_time_prob", "mask_feature_prob", "jitter_noise")


def in_vocab(defaults: dict[str, Any], vocab: int, keep: set[str]) -> dict[str, int]:
    """Special token ids (``*_token_id``) of the config outside ``[0, vocab)``, moved inside it: the pad id to
    0, the others to the top of the vocabulary, distinct (a ``None`` id breaks models that shift labels)."""
    out: dict[str, int] = {}
    top = vocab - 1
    for k, v in defaults.items():
        if k.endswith("_token_id") and k not in keep and isinstance(v, int) and not 0 <= v < vocab:
            if k == "pad_token_id":
                out[k] = 0
            else:
                out[k], top = max(top, 1), top - 1
    return out


def make_config(model_type: str, overrides: dict[str, Any], *, use_cache: bool | None = False) -> Any:
    """The config of ``model_type`` with ``overrides``, dropout 0, in-range token ids; ``use_cache`` set unless
    None (the config's own default).

    Overrides go to the constructor, so derived fields (Llama's ``head_dim``) follow them."""
    tf = _transformers()
    defaults = tf.AutoConfig.for_model(model_type).to_dict()
    kwargs: dict[str, Any] = {k: 0.0 for k, v in defaults.items()
                              if isinstance(v, float) and any(f in k for f in RANDOM_FIELDS)}
    if use_cache is not None:
        kwargs["use_cache"] = use_cache
    kwargs.update(overrides)
    vocab = kwargs.get("vocab_size", defaults.get("vocab_size"))
    if isinstance(vocab, int):
        kwargs.update(in_vocab(defaults, vocab, set(overrides)))
    return tf.AutoConfig.for_model(model_type, **kwargs)


def for_task(config: Any, task: str) -> Any:
    """``config`` made complete for ``task``: a sequence-to-sequence model shifts its labels right to make the
    decoder's inputs, starting from ``decoder_start_token_id``, which some default configs lack (T5's: its
    checkpoints set it to the pad id, 0)."""
    if task in ("seq2seq", "speech-seq2seq") and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    return config


def example(task: str, config: Any, batch: int, seq: int, meta: bool = False) -> Inputs:
    """The example inputs (with labels) of ``task`` for ``config``, by keyword."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: use one of {', '.join(TASKS)}")
    return TASKS[task].inputs(config, batch, seq, torch.device("meta" if meta else "cpu"))


# A recurrence unrolled over the sequence adds ops per token; past this many ops (estimated from the config:
# layers x sequence x ops per step) capture is refused with the fix, rather than taking minutes.
MAX_UNROLLED = 20_000
# Model types whose capture (on a CPU, without their CUDA kernels) unrolls a Python loop over tokens, and the ops
# each layer adds per token (measured: the captured graph's growth from 8 to 16 tokens, per layer).  Mamba-2
# scans in chunks (a fixed number of ops) and is not listed.
UNROLLED_OPS_PER_STEP = {"rwkv": 33, "mamba": 9, "falcon_mamba": 9}


def check_unrolled(model_type: str, config: Any, seq: int) -> None:
    """Refuse, fast and with the fix, a model whose capture would unroll ``seq`` steps of a recurrence per layer
    into more than ``MAX_UNROLLED`` ops."""
    per = UNROLLED_OPS_PER_STEP.get(model_type)
    if per is None:
        return
    layers = int(getattr(config, "num_hidden_layers", 1))
    ops = layers * seq * per
    if ops > MAX_UNROLLED:
        fit = max(1, MAX_UNROLLED // (layers * per))
        raise ValueError(f"hf:{model_type} runs a recurrence one token at a time: capturing {layers} layers x {seq} "
                         f"tokens unrolls about {ops:,} ops (over {MAX_UNROLLED:,}). Fix: --arg seq={fit} or less")


def build(model_type: str, *, task: str | None = None, batch: int = 8, seq: int | None = None, seed: int = 0,
          meta: bool = False, raw: bool = False, **overrides: Any) -> tuple[nn.Module, tuple]:
    """``(LossOnly(model), inputs)`` for ``hf:model_type`` with random weights, inputs in ``LossOnly``'s order.
    ``raw``: the model itself and its first input alone (``model(input_ids)``), as a user's own loop calls it: it
    returns the model's ``ModelOutput`` (logits, no loss)."""
    config = make_config(model_type, overrides)
    task = task or default_task(model_type, config)
    cls = head_class(model_type, config, task)
    for_task(config, task)
    if getattr(cls, "_supports_sdpa", False):
        config._attn_implementation = "sdpa"  # what from_pretrained(attn_implementation="sdpa") sets
    if seq is None:
        seq = min(1024, int(getattr(config, "max_position_embeddings", 1024) or 1024))
    check_unrolled(model_type, config, seq)
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        try:
            model = cls(config)
        except Exception as e:  # transformers' own failure on this config: say which fields it lacked
            unset = [k for k, v in config.to_dict().items()
                     if v is None and not k.endswith("token_id")
                     and any(w in k for w in ("dim", "size", "heads", "layers", "expert", "num_", "n_"))]
            fix = (f"its config leaves {', '.join(unset)} unset: give {'them' if len(unset) > 1 else 'it'} with "
                   f"--arg {unset[0]}=N" if unset else "give the config fields it needs with --arg key=value")
            raise ValueError(f"hf:{model_type}: transformers could not build {cls.__name__} from this config "
                             f"({type(e).__name__}: {e}); {fix}") from None
        model.train()
    inputs = example(task, config, batch, seq, meta)
    if raw:
        return model, (next(iter(inputs.values())),)
    return LossOnly(model, tuple(inputs)), tuple(inputs.values())


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
