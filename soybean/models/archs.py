"""The architecture suite: Hugging Face architectures as users load them, at tiny sizes.

Each ``Arch`` is a ``transformers`` model type with the head of a task (``hf.TASKS``), built from its
config class with random weights and the config's own defaults (``use_cache`` as loaded, attention
implementation as loaded) except:

* sizes shrunk (``tiny_overrides``: hidden 64, 4 heads of 16, 2 layers, vocabulary 128, 4 experts...),
  plus what an architecture needs for those sizes to agree (``Arch.overrides``);
* randomness a parallel run cannot reproduce set to 0 (dropout, SpecAugment masks: ``hf.make_config``).

``build(arch)`` returns the model and its example keywords (with labels, so the model returns its own loss):
the call a training loop makes, ``model(**kwargs).loss``.  ``scripts/arch_sweep.py`` trains each as
``soybean.parallelize`` runs it and compares with the model trained alone; the test suite checks every rule
the suite's graphs use (``soybean.verify.check``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import hf

# Size fields of transformers configs, by the names configs give them, and their tiny values.
TINY: dict[str, int] = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "n_embed": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "num_decoder_layers": 2, "n_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "num_heads": 4, "num_key_value_heads": 2, "num_kv_heads": 2, "head_dim": 16, "d_kv": 16,
    "intermediate_size": 128, "n_inner": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "d_ff": 128,
    "ffn_dim": 128, "ffn_hidden_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "vocab_size": 128, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "max_position_embeddings": 64, "n_positions": 64, "max_source_positions": 16, "max_target_positions": 64,
    "image_size": 32, "patch_size": 8, "num_mel_bins": 16,
}


def tiny_overrides(model_type: str, extra: dict[str, Any]) -> dict[str, Any]:
    """``TINY`` for the size fields ``model_type``'s config has (set, not ``None``), then ``extra``."""
    defaults = hf._transformers().AutoConfig.for_model(model_type).to_dict()
    out = {k: v for k, v in TINY.items() if defaults.get(k) is not None}
    out.update(extra)
    return out


@dataclass(frozen=True)
class Arch:
    """One architecture of the suite."""

    name: str                 # how the suite names it (the model type, or model type + variant)
    family: str               # decoder | moe | ssm | encoder | encoder-decoder | vision | audio
    model_type: str           # transformers' model_type
    task: str = "causal-lm"   # hf.TASKS
    overrides: dict[str, Any] = field(default_factory=dict)  # beyond ``TINY``: what the tiny sizes need
    seq: int = 9              # tokens per example (odd: uneven tiles on 2 and 4 devices)
    batch: int = 2

    def config(self) -> Any:
        return hf.make_config(self.model_type, tiny_overrides(self.model_type, self.overrides), use_cache=None)


def build(arch: Arch, seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``(model, kwargs)``: the architecture's model with random weights, in training mode, and its example
    batch with labels, by keyword."""
    config = hf.for_task(arch.config(), arch.task)
    cls = hf.head_class(arch.model_type, config, arch.task)
    torch.manual_seed(seed)
    model = cls(config)
    model.train()
    return model, hf.example(arch.task, config, arch.batch, arch.seq)


def _rope(dim: int = 8) -> dict[str, Any]:
    return {"rotary_dim": dim}


# DeepSeek-V3's multi-head latent attention at tiny sizes (low-rank q and kv, rotary and plain halves of a head).
_MLA = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
        "head_dim": 8, "n_group": 1, "topk_group": 1, "num_key_value_heads": 4}
# DeepSeek-V3.2's sparse attention (and GLM's): MLA with a lightning indexer of 4 heads keeping 4 keys, one dense layer
# and one sparse.
_DSA = {**_MLA, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 4, "qk_head_dim": 16,
        "mlp_layer_types": ["dense", "sparse"], "layer_types": ["indexed_attention", "indexed_attention"]}
# SegFormer's and PVTv2's hierarchical encoders at two tiny stages (one block each, lists per stage).
_STAGES = {"num_encoder_blocks": 2, "depths": [1, 1], "sr_ratios": [2, 1], "hidden_sizes": [16, 32],
           "patch_sizes": [7, 3], "strides": [4, 2], "num_attention_heads": [1, 2], "mlp_ratios": [2, 2],
           "image_size": 32}
# A two-layer waveform feature extractor (strides 5 x 4) and a small positional convolution.
_WAVE = {"conv_dim": [16, 16], "conv_stride": [5, 4], "conv_kernel": [10, 8], "num_conv_pos_embeddings": 8,
         "num_conv_pos_embedding_groups": 4}


# The suite.  ``overrides`` only make the tiny sizes consistent (a rotary dim within a head, a window or
# chunk within the sequence); everything else is the config's default.
ARCHS: list[Arch] = [
    # decoder-only language models
    Arch("gpt2", "decoder", "gpt2"),
    Arch("gpt_neo", "decoder", "gpt_neo", overrides={"attention_types": [[["global", "local"], 1]],
                                                      "window_size": 4}),
    Arch("gpt_neox", "decoder", "gpt_neox"),
    Arch("gptj", "decoder", "gptj", overrides=_rope()),
    Arch("codegen", "decoder", "codegen", overrides=_rope()),
    Arch("bloom", "decoder", "bloom"),
    Arch("opt", "decoder", "opt", overrides={"word_embed_proj_dim": 64}),
    Arch("llama", "decoder", "llama"),
    Arch("mistral", "decoder", "mistral", overrides={"sliding_window": 4}),
    Arch("qwen2", "decoder", "qwen2"),
    Arch("qwen3", "decoder", "qwen3"),
    Arch("gemma", "decoder", "gemma"),
    Arch("gemma2", "decoder", "gemma2", overrides={"sliding_window": 4}),
    Arch("gemma3_text", "decoder", "gemma3_text", overrides={"sliding_window": 4}),
    Arch("starcoder2", "decoder", "starcoder2", overrides={"sliding_window": 4}),
    Arch("olmo", "decoder", "olmo"),
    Arch("olmo2", "decoder", "olmo2"),
    Arch("olmo3", "decoder", "olmo3", overrides={"sliding_window": 4}),
    Arch("cohere", "decoder", "cohere"),
    Arch("cohere2", "decoder", "cohere2", overrides={"sliding_window": 4}),
    Arch("phi", "decoder", "phi"),
    Arch("phi3", "decoder", "phi3"),
    Arch("falcon", "decoder", "falcon"),
    Arch("stablelm", "decoder", "stablelm"),
    Arch("persimmon", "decoder", "persimmon"),
    Arch("glm", "decoder", "glm"),
    Arch("glm4", "decoder", "glm4"),
    Arch("granite", "decoder", "granite"),
    Arch("gpt_bigcode", "decoder", "gpt_bigcode"),
    Arch("xglm", "decoder", "xglm"),
    Arch("biogpt", "decoder", "biogpt"),
    Arch("mpt", "decoder", "mpt"),
    Arch("helium", "decoder", "helium"),
    Arch("smollm3", "decoder", "smollm3"),
    Arch("nemotron", "decoder", "nemotron", overrides={"partial_rotary_factor": 0.5, "num_key_value_heads": 2}),
    Arch("deepseek_v3_dense", "decoder", "deepseek_v3", overrides={**_MLA, "first_k_dense_replace": 2}),
    Arch("youtu", "decoder", "youtu", overrides=_MLA),
    # hybrids whose ``layer_types`` name each layer: one of each kind in the two tiny layers
    Arch("qwen3_5_text", "decoder", "qwen3_5_text",
         overrides={"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}),
    Arch("gemma3n_text", "decoder", "gemma3n_text",
         overrides={"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
                    "intermediate_size": [128, 128], "num_kv_shared_layers": 0, "laurel_rank": 8,
                    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 128,
                    "activation_sparsity_pattern": [0.0, 0.0]}),
    # mixture of experts (routing runs replicated until issue 22; training must still equal serial)
    Arch("mixtral", "moe", "mixtral"),
    Arch("qwen2_moe", "moe", "qwen2_moe"),
    Arch("granitemoe", "moe", "granitemoe"),
    Arch("olmoe", "moe", "olmoe"),
    Arch("jetmoe", "moe", "jetmoe", overrides={"kv_channels": 16}),  # a head's width; its routing sizes are data
    Arch("deepseek_v3", "moe", "deepseek_v3", overrides={**_MLA, "first_k_dense_replace": 1}),
    Arch("gpt_oss", "moe", "gpt_oss", overrides={"sliding_window": 4}),
    Arch("qwen3_next", "moe", "qwen3_next",
         overrides={"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16, "full_attention_interval": 2}),
    Arch("dots1", "moe", "dots1", overrides={"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                                             "first_k_dense_replace": 1, "max_window_layers": 2,
                                             "layer_types": ["full_attention", "full_attention"]}),
    Arch("lfm2_moe", "moe", "lfm2_moe", overrides={"layer_types": ["conv", "full_attention"], "num_dense_layers": 1}),
    Arch("kimi_linear", "moe", "kimi_linear",
         overrides={**_MLA, "q_lora_rank": None, "qk_head_dim": 16,
                    "layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"],
                    "linear_head_dim": 16, "linear_num_heads": 4,
                    "num_experts_per_token": 2}),
    Arch("granitemoehybrid", "moe", "granitemoehybrid",
         overrides={"layer_types": ["mamba", "attention"], "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_n_groups": 1,
                    "mamba_chunk_size": 4, "mamba_d_state": 16, "shared_intermediate_size": 32}),
    # state-space and recurrent
    Arch("mamba", "ssm", "mamba"),
    Arch("mamba2", "ssm", "mamba2", overrides={"num_heads": 8, "head_dim": 16, "n_groups": 1, "chunk_size": 4,
                                                "state_size": 16, "expand": 2}),
    Arch("falcon_mamba", "ssm", "falcon_mamba"),
    Arch("rwkv", "ssm", "rwkv", overrides={"attention_hidden_size": 64, "context_length": 64}),
    Arch("zamba2", "ssm", "zamba2",
         overrides={"layers_block_type": ["mamba", "hybrid"], "hybrid_layer_ids": [1], "mamba_headdim": 16,
                    "n_mamba_heads": 8, "mamba_d_state": 16, "chunk_size": 4, "attention_hidden_size": 128,
                    "attention_head_dim": 32, "adapter_rank": 8, "kv_channels": 16}),
    # encoders (masked language models)
    Arch("bert", "encoder", "bert", "masked-lm"),
    Arch("roberta", "encoder", "roberta", "masked-lm"),
    Arch("distilbert", "encoder", "distilbert", "masked-lm", overrides={"dim": 64, "hidden_dim": 128, "n_heads": 4}),
    Arch("albert", "encoder", "albert", "masked-lm", overrides={"embedding_size": 32}),
    Arch("electra", "encoder", "electra", "masked-lm", overrides={"embedding_size": 32}),
    Arch("deberta", "encoder", "deberta", "masked-lm"),
    Arch("deberta-v2", "encoder", "deberta-v2", "masked-lm"),
    Arch("modernbert", "encoder", "modernbert", "masked-lm", overrides={"local_attention": 4,
                                                                        "global_attn_every_n_layers": 2}),
    Arch("xlm-roberta", "encoder", "xlm-roberta", "masked-lm"),
    Arch("mpnet", "encoder", "mpnet", "masked-lm"),
    Arch("roformer", "encoder", "roformer", "masked-lm", overrides={"embedding_size": 64}),
    Arch("esm", "encoder", "esm", "masked-lm", overrides={"vocab_size": 128, "pad_token_id": 1, "mask_token_id": 2}),
    Arch("convbert", "encoder", "convbert", "masked-lm", overrides={"embedding_size": 64}),
    # YOSO's attention is a custom autograd.Function whose backward is an approximation, not its forward's
    # derivative: exported whole it would train otherwise, so ``parallelize`` captures it in pieces.
    Arch("yoso", "encoder", "yoso", "masked-lm"),
    # I-BERT (quantization off, as loaded): torch.export cannot capture it (a branch on its activations' range) and
    # its pieces read ``x.data``: captured by dynamo in pieces.
    Arch("ibert", "encoder", "ibert", "masked-lm"),
    # encoder-decoders
    Arch("t5", "encoder-decoder", "t5", "seq2seq"),
    Arch("bart", "encoder-decoder", "bart", "seq2seq"),
    Arch("mbart", "encoder-decoder", "mbart", "seq2seq"),
    Arch("pegasus", "encoder-decoder", "pegasus", "seq2seq"),
    Arch("marian", "encoder-decoder", "marian", "seq2seq", overrides={"decoder_vocab_size": 128}),
    Arch("mt5", "encoder-decoder", "mt5", "seq2seq"),
    Arch("umt5", "encoder-decoder", "umt5", "seq2seq"),
    Arch("m2m_100", "encoder-decoder", "m2m_100", "seq2seq"),
    Arch("blenderbot", "encoder-decoder", "blenderbot", "seq2seq"),
    # T5Gemma's encoder and decoder are whole Gemma 2 configs of their own: tiny, with one layer of each kind.
    Arch("t5gemma", "encoder-decoder", "t5gemma", "seq2seq",
         overrides={"vocab_size": 128, **{side: {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
                                                 "num_hidden_layers": 2, "num_attention_heads": 4,
                                                 "num_key_value_heads": 2, "head_dim": 16,
                                                 "max_position_embeddings": 64, "sliding_window": 4,
                                                 "layer_types": ["sliding_attention", "full_attention"],
                                                 "dropout_rate": 0.0, "attention_dropout": 0.0}
                                          for side in ("encoder", "decoder")}}),
    # torch.export cannot capture these three (a mask built only when not compiling; a branch on a tensor's
    # value): captured by dynamo in pieces (``soybean.run.pieces``).  Sizes that reach what they add: a sparse (routed
    # experts) layer in each stack, a local radius within the sequence, an attention window within it.  (LongT5
    # with transient-global attention fails under torch.compile itself, with torch's own "eager" backend too.)
    Arch("switch_transformers", "moe", "switch_transformers", "seq2seq",
         overrides={"num_sparse_encoder_layers": 1, "num_sparse_decoder_layers": 1}),
    Arch("longt5", "encoder-decoder", "longt5", "seq2seq", overrides={"local_radius": 2}),
    Arch("led", "encoder-decoder", "led", "seq2seq",
         overrides={"attention_window": 4, "max_encoder_position_embeddings": 64,
                    "max_decoder_position_embeddings": 64}),
    Arch("whisper", "encoder-decoder", "whisper", "speech-seq2seq"),
    # vision
    Arch("vit", "vision", "vit", "image-classification"),
    Arch("deit", "vision", "deit", "image-classification"),
    Arch("beit", "vision", "beit", "image-classification"),
    Arch("swin", "vision", "swin", "image-classification", overrides={"embed_dim": 16, "depths": [1, 1],
                                                                      "num_heads": [2, 4], "window_size": 2,
                                                                      "patch_size": 4}),
    Arch("convnext", "vision", "convnext", "image-classification", overrides={"hidden_sizes": [16, 32],
                                                                              "depths": [1, 1], "num_stages": 2}),
    Arch("dinov2", "vision", "dinov2", "image-classification"),
    Arch("resnet", "vision", "resnet", "image-classification", overrides={"hidden_sizes": [16, 32], "depths": [1, 1],
                                                                          "embedding_size": 16}),
    # LeViT normalises each attention's queries over batch x 4 subsampled tokens: at batch 2 (8 rows) its float32
    # gradients there are 64% off the float64 ones serially, so a parallel run cannot be judged; float64 is exact.
    Arch("levit", "vision", "levit", "image-classification",
         overrides={"hidden_sizes": [16, 32, 48], "num_attention_heads": [2, 2, 2], "depths": [1, 1, 1],
                    "key_dim": [8, 8, 8], "image_size": 64, "patch_size": 16}, batch=8),
    Arch("siglip", "vision", "siglip", "image-classification",
         overrides={"vision_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                      "num_attention_heads": 4, "image_size": 32, "patch_size": 8}}),
    Arch("clip", "vision", "clip", "image-classification",
         overrides={"vision_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                      "num_attention_heads": 4, "image_size": 32, "patch_size": 8}}),
    # audio
    Arch("wav2vec2", "audio", "wav2vec2", "audio-classification",
         overrides=_WAVE),
    Arch("hubert", "audio", "hubert", "audio-classification",
         overrides=_WAVE),
    Arch("wavlm", "audio", "wavlm", "audio-classification",
         overrides=_WAVE),
    Arch("whisper_classifier", "audio", "whisper", "audio-classification"),
    Arch("audio-spectrogram-transformer", "audio", "audio-spectrogram-transformer", "audio-classification",
         overrides={"max_length": 32, "patch_size": 8, "frequency_stride": 8, "time_stride": 8}),
    # model types a 2026-12-02 probe of transformers' registry found unswept: the structures not yet in the suite
    Arch("qwen3_moe", "moe", "qwen3_moe"),
    Arch("llama4_text", "moe", "llama4_text"),
    Arch("diffllama", "decoder", "diffllama"),
    Arch("xlnet", "decoder", "xlnet"),
    Arch("big_bird", "encoder", "big_bird", task="masked-lm"),
    Arch("fnet", "encoder", "fnet", task="masked-lm"),
    Arch("bigbird_pegasus", "encoder-decoder", "bigbird_pegasus", task="seq2seq"),
    Arch("layoutlm", "encoder", "layoutlm", task="masked-lm"),
]

# More of transformers' model types, each as it is loaded (tiny sizes, the config's defaults otherwise): swept by
# ``scripts/arch_sweep.py`` with the suite (every column), not by the unit tests' per-architecture rule check, which
# would take minutes more for architectures whose ops the suite's already check (most are a Llama, a BERT or a ResNet
# with other names and norms) or whose state-space kernels are slow to check (Falcon-H1: 157 s).  The vision models
# with batch norm run at batch 8: at batch 2 their float32 training is too ill-conditioned to judge a parallel run by
# (float64: equal to serial at batch 2).
WIDER: list[Arch] = [
    Arch("apertus", "decoder", "apertus"),
    Arch("arcee", "decoder", "arcee"),
    Arch("bert-generation", "decoder", "bert-generation"),
    Arch("bitnet", "decoder", "bitnet"),
    Arch("cpmant", "decoder", "cpmant"),
    Arch("ctrl", "decoder", "ctrl"),
    Arch("doge", "decoder", "doge"),
    Arch("ernie4_5", "decoder", "ernie4_5"),
    Arch("exaone", "decoder", "exaone"),
    Arch("exaone4", "decoder", "exaone4"),
    Arch("gpt_neox_japanese", "decoder", "gpt_neox_japanese"),
    Arch("granite_swa", "decoder", "granite_swa"),
    Arch("hyperclovax", "decoder", "hyperclovax"),
    Arch("internlm3", "decoder", "internlm3"),
    Arch("iquestcoder", "decoder", "iquestcoder"),
    Arch("jais2", "decoder", "jais2"),
    Arch("laguna", "decoder", "laguna"),
    Arch("mellum", "decoder", "mellum"),
    Arch("modernbert-decoder", "decoder", "modernbert-decoder"),
    Arch("nanochat", "decoder", "nanochat"),
    Arch("openai-gpt", "decoder", "openai-gpt"),
    Arch("seed_oss", "decoder", "seed_oss"),
    Arch("trocr", "decoder", "trocr"),
    Arch("vaultgemma", "decoder", "vaultgemma"),
    Arch("afmoe", "moe", "afmoe"),
    Arch("cohere2_moe", "moe", "cohere2_moe"),
    Arch("ernie4_5_moe", "moe", "ernie4_5_moe"),
    Arch("exaone_moe", "moe", "exaone_moe"),
    Arch("flex_olmo", "moe", "flex_olmo"),
    Arch("glm4_moe", "moe", "glm4_moe"),
    Arch("glm4_moe_lite", "moe", "glm4_moe_lite"),
    Arch("granitemoe_swa", "moe", "granitemoe_swa"),
    Arch("granitemoeshared", "moe", "granitemoeshared"),
    Arch("minimax", "moe", "minimax"),
    Arch("minimax_m2", "moe", "minimax_m2"),
    Arch("phimoe", "moe", "phimoe"),
    Arch("sarvam_moe", "moe", "sarvam_moe"),
    Arch("solar_open", "moe", "solar_open"),
    Arch("falcon_h1", "ssm", "falcon_h1"),
    Arch("lfm2", "ssm", "lfm2"),
    Arch("nemotron_h", "ssm", "nemotron_h"),
    Arch("olmo_hybrid", "ssm", "olmo_hybrid"),
    Arch("camembert", "encoder", "camembert", task="masked-lm"),
    Arch("data2vec-text", "encoder", "data2vec-text", task="masked-lm"),
    Arch("ernie", "encoder", "ernie", task="masked-lm"),
    Arch("eurobert", "encoder", "eurobert", task="masked-lm"),
    Arch("funnel", "encoder", "funnel", task="masked-lm"),
    Arch("gte", "encoder", "gte", task="masked-lm"),
    Arch("longformer", "encoder", "longformer", task="masked-lm"),
    Arch("megatron-bert", "encoder", "megatron-bert", task="masked-lm"),
    Arch("mra", "encoder", "mra", task="masked-lm"),
    Arch("nomic_bert", "encoder", "nomic_bert", task="masked-lm"),
    Arch("nystromformer", "encoder", "nystromformer", task="masked-lm"),
    Arch("rembert", "encoder", "rembert", task="masked-lm"),
    Arch("roberta-prelayernorm", "encoder", "roberta-prelayernorm", task="masked-lm"),
    Arch("roc_bert", "encoder", "roc_bert", task="masked-lm"),
    Arch("xlm-roberta-xl", "encoder", "xlm-roberta-xl", task="masked-lm"),
    Arch("blenderbot-small", "encoder-decoder", "blenderbot-small", task="seq2seq"),
    Arch("fsmt", "encoder-decoder", "fsmt", task="seq2seq"),
    Arch("mvp", "encoder-decoder", "mvp", task="seq2seq"),
    Arch("nllb-moe", "encoder-decoder", "nllb-moe", task="seq2seq"),
    Arch("pegasus_x", "encoder-decoder", "pegasus_x", task="seq2seq"),
    Arch("plbart", "encoder-decoder", "plbart", task="seq2seq"),
    Arch("prophetnet", "encoder-decoder", "prophetnet", task="seq2seq"),
    Arch("bit", "vision", "bit", task="image-classification"),
    Arch("data2vec-vision", "vision", "data2vec-vision", task="image-classification"),
    Arch("dinov2_with_registers", "vision", "dinov2_with_registers", task="image-classification"),
    Arch("focalnet", "vision", "focalnet", task="image-classification"),
    Arch("hgnet_v2", "vision", "hgnet_v2", task="image-classification", batch=8),
    Arch("ijepa", "vision", "ijepa", task="image-classification"),
    Arch("mobilenet_v1", "vision", "mobilenet_v1", task="image-classification"),
    Arch("mobilenet_v2", "vision", "mobilenet_v2", task="image-classification"),
    Arch("mobilevit", "vision", "mobilevit", task="image-classification", batch=8),
    Arch("poolformer", "vision", "poolformer", task="image-classification"),
    Arch("regnet", "vision", "regnet", task="image-classification", batch=8),
    Arch("swiftformer", "vision", "swiftformer", task="image-classification", batch=8),
    Arch("vit_msn", "vision", "vit_msn", task="image-classification"),
    Arch("data2vec-audio", "audio", "data2vec-audio", task="audio-classification"),
    Arch("sew", "audio", "sew", task="audio-classification"),
    Arch("sew-d", "audio", "sew-d", task="audio-classification"),
    Arch("unispeech", "audio", "unispeech", task="audio-classification"),
    Arch("unispeech-sat", "audio", "unispeech-sat", task="audio-classification"),
    Arch("wav2vec2-conformer", "audio", "wav2vec2-conformer", task="audio-classification"),
    # model types whose tiny config needs sizes made consistent (layer kinds within two layers, lists per stage)
    Arch("deepseek_v2", "moe", "deepseek_v2",
         overrides={**_MLA, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                    "n_shared_experts": 1}),
    Arch("minicpm3", "decoder", "minicpm3",
         overrides=_MLA),
    Arch("hunyuan_v1_dense", "decoder", "hunyuan_v1_dense",
         overrides={"head_dim": 16}),
    Arch("hunyuan_v1_moe", "moe", "hunyuan_v1_moe",
         overrides={"head_dim": 16, "num_experts": 4, "moe_topk": 2}),
    Arch("dbrx", "moe", "dbrx",
         overrides={"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                    "ffn_config": {"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 128}, "d_model": 64,
                    "n_heads": 4, "n_layers": 2, "max_seq_len": 64}),
    Arch("jamba", "ssm", "jamba",
         overrides={"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
                    "num_experts": 4, "mamba_dt_rank": 8, "mamba_d_state": 8}),
    Arch("bamba", "ssm", "bamba",
         overrides={"attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_n_groups": 1,
                    "mamba_d_state": 8, "mamba_chunk_size": 4}),
    Arch("recurrent_gemma", "ssm", "recurrent_gemma",
         overrides={"block_types": ["recurrent", "attention"], "attention_window_size": 4, "lru_width": 64}),
    Arch("qwen3_5_moe_text", "moe", "qwen3_5_moe_text",
         overrides={"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                    "num_experts": 4, "num_experts_per_tok": 2}),
    Arch("lfm3", "ssm", "lfm3",
         overrides={"layer_types": ["conv", "full_attention"]}),
    Arch("mobilebert", "encoder", "mobilebert", task="masked-lm",
         overrides={"embedding_size": 32, "intermediate_size": 64, "true_hidden_size": 32, "intra_bottleneck_size": 32,
                    "num_feedforward_networks": 1}),
    Arch("squeezebert", "encoder", "squeezebert", task="masked-lm",
         overrides={"embedding_size": 64, "intermediate_size": 64}),
    Arch("swinv2", "vision", "swinv2", task="image-classification", batch=8,
         overrides={"embed_dim": 16, "depths": [1, 1], "num_heads": [2, 4], "image_size": 32, "patch_size": 4,
                    "window_size": 4}),
    Arch("segformer", "vision", "segformer", task="image-classification", batch=8,
         overrides=_STAGES),
    Arch("pvt_v2", "vision", "pvt_v2", task="image-classification", batch=8,
         overrides=_STAGES),
    Arch("convnextv2", "vision", "convnextv2", task="image-classification", batch=8,
         overrides={"image_size": 64, "hidden_sizes": [16, 32], "depths": [1, 1], "num_stages": 2}),
    # transformers 5.25's model types no sweep held (2026-12-07), as a new user builds them.
    Arch("cwm", "decoder", "cwm"),
    Arch("ministral", "decoder", "ministral",
         overrides={"head_dim": 16, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}),
    Arch("ministral3", "decoder", "ministral3"),
    Arch("hrm_text", "decoder", "hrm_text"),
    Arch("gemma4_text", "decoder", "gemma4_text"),
    Arch("flint", "decoder", "flint"),
    Arch("apertus1p5_text", "decoder", "apertus1p5_text"),
    Arch("dory", "decoder", "dory"),  # a looped stack; export fails on its cache's mask: captured in pieces
    Arch("hy_v3", "moe", "hy_v3"),
    Arch("hy_v4", "moe", "hy_v4"),
    Arch("lara_mini", "moe", "lara_mini"),
    Arch("kolibri1", "moe", "kolibri1"),
    Arch("ergo", "moe", "ergo"),
    Arch("inkling_text", "moe", "inkling_text"),
    Arch("deepseek_v4", "moe", "deepseek_v4"),
    Arch("minicpm5_moe", "moe", "minicpm5_moe"),
    Arch("mimo_v2_flash", "moe", "mimo_v2_flash"),
    Arch("deepseek_v32", "moe", "deepseek_v32", overrides=_DSA),
    Arch("glm_moe_dsa", "moe", "glm_moe_dsa", overrides={**_DSA, "indexer_types": ["full", "full"]}),
]

BY_NAME = {a.name: a for a in ARCHS + WIDER}
FAMILIES = sorted({a.family for a in ARCHS})
