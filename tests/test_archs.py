"""The architecture suite (``soybean.models.archs``, issue 21) in CI.

* in process, every architecture: every strategy of every rule its graph uses is exact, forward and backward
  in float64 (``soybean check`` on 2 devices); no op of the decoder, encoder, encoder-decoder and vision
  families runs replicated for want of a rule (mixture-of-experts routing is issue 22's);
* on gloo processes, a handful: trained 3 AdamW steps with ``soybean.parallelize(model, kwargs, devices=2)`` under
  a plan that splits parameters, as close to the float64 serial run as the float32 serial run is
  (``sweep.differences``).  ``scripts/arch_sweep.py`` runs every architecture that way, on threads or gloo.
"""
from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers", reason="the architecture suite needs transformers: pip install -e '.[hf]'")

from soybean.verify import sweep
from soybean.verify.check import check_model
from soybean.models import archs

pytestmark = pytest.mark.unit

RULED = ("decoder", "encoder", "encoder-decoder", "vision")  # families with a rule for every op
SEEN: dict[Any, None] = {}  # ops already checked, shared across the suite (its models repeat most ops)


def test_the_suite_spans_the_families_users_bring() -> None:
    names = {a.name for a in archs.ARCHS}
    assert len(archs.ARCHS) >= 50 and len(names) == len(archs.ARCHS)
    # the sweep's wider net: other model types than the suite's, every name once
    assert not {a.model_type for a in archs.WIDER} & {a.model_type for a in archs.ARCHS}
    assert len(archs.BY_NAME) == len(archs.ARCHS) + len(archs.WIDER) and set(archs.FAMILIES) >= {
        a.family for a in archs.WIDER}
    assert set(archs.FAMILIES) == {"decoder", "moe", "ssm", "encoder", "encoder-decoder", "vision", "audio"}
    named = {"mistral", "gemma2", "gemma3_text", "starcoder2", "olmo3", "cohere2", "gpt_oss", "falcon", "deberta-v2",
             "beit", "whisper", "pegasus", "deepseek_v3", "qwen3_next", "granitemoe", "modernbert", "glm", "glm4",
             "gptj", "cohere", "codegen", "bloom", "siglip", "t5", "wav2vec2", "hubert", "mamba2", "bart", "rwkv"}
    assert named <= names, named - names


@pytest.mark.parametrize("arch", archs.ARCHS, ids=lambda a: a.name)
def test_every_rule_the_architecture_uses_is_exact(arch: archs.Arch) -> None:
    model, kwargs = archs.build(arch)
    report = check_model(model, kwargs, devices=2, seen=SEEN)
    assert report.ok, "\n".join(report.lines())
    if arch.family in RULED:
        assert not report.unruled, f"{arch.name} runs {report.unruled} replicated for want of a rule"


GLOO = [("mistral", "comm"), ("t5", "comm"), ("deberta-v2", "time")]


def _gloo_ranks(rank: int, world: int, cases: list[tuple[str, str]]) -> list[tuple[Any, dict[str, list[str]]]]:
    """``sweep``'s gloo rank (build, ``parallelize``, train) for every case in turn, in this one process group."""
    return [sweep._gloo_rank(rank, world, f"arch:{name}", objective, sweep.STEPS, sweep.LR)
            for name, objective in cases]


@pytest.mark.dist
def test_gloo_processes_train_like_serial() -> None:
    """``GLOO``'s architectures as ``sweep_arch(..., tier="gloo")`` trains them (its ``_gloo_rank`` on 2 processes,
    judged by its ``differences``), all in one spawn (the processes' start-up was most of each case's run)."""
    from soybean.runtime.launch import spawn
    from soybean.verify.testing import train_serial

    got = spawn(_gloo_ranks, 2, GLOO, timeout_s=600)[0]  # rank 0's traces, as ``sweep.train`` reads them
    for (name, objective), (par, params) in zip(GLOO, got):
        model, example = sweep.build(f"arch:{name}")
        serial = train_serial(model, example, steps=sweep.STEPS, lr=sweep.LR)
        bad = sweep.differences(serial, sweep.exact_serial(model, example, serial), par)
        assert not bad, (name, objective, bad[:2])
