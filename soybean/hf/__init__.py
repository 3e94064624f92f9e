"""soybean inside Hugging Face training: ``Trainer`` / ``Seq2SeqTrainer`` that train by soybean's plan, and
``SoybeanModel`` for a loop of one's own (Accelerate).  Needs the ``hf`` extra (transformers, accelerate); see
``docs/guide/hf_trainer.md``."""
from __future__ import annotations

from typing import Any

from .model import SoybeanModel

__all__ = ["Seq2SeqTrainer", "SoybeanModel", "Trainer"]


def __getattr__(name: str) -> Any:
    # The trainers import transformers; SoybeanModel alone does not need it.
    if name in ("Trainer", "Seq2SeqTrainer", "SoybeanTrainerMixin"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'soybean.hf' has no attribute {name!r}")
