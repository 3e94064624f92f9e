"""A tiny Hugging Face model trained by a stock ``transformers.Trainer``, with soybean's plan or without it.

    torchrun --nproc-per-node 2 examples/train_hf_trainer.py                 # soybean on 2 processes
    python examples/train_hf_trainer.py --no-soybean                         # the plain Trainer, one process
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --model t5 --objective comm
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --resume out/checkpoint-10

The only soybean line is the Trainer class (``soybean.hf.Trainer`` for ``transformers.Trainer``); everything else is
a plain Trainer script.  The data are made in code (nothing is downloaded): fixed-length sequences of a few
arithmetic patterns, which a tiny model learns quickly.  ``--batch`` is the global batch: each of the N processes
reads ``batch / N`` rows per step (``per_device_train_batch_size``), so any N trains on the same batches.
``--log-history FILE``: Trainer's ``state.log_history`` as JSON, written by rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

VOCAB = 128


class Patterns(torch.utils.data.Dataset):
    """``n`` rows of ``length`` tokens: row ``i`` counts from ``i * 7 % VOCAB`` in steps of ``1 + i % 3`` (mod
    ``VOCAB``).  Causal LM: labels are the inputs (the model shifts them).  Seq2seq (``t5``): the target is the
    source one step further on."""

    def __init__(self, n: int, length: int, seq2seq: bool) -> None:
        self.n, self.length, self.seq2seq = n, length, seq2seq

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        step = 1 + i % 3
        ids = (i * 7 + step * torch.arange(self.length)) % VOCAB
        row = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        row["labels"] = (ids + step) % VOCAB if self.seq2seq else ids.clone()
        return row


def tiny_model(name: str) -> torch.nn.Module:
    """A tiny ``llama``, ``mixtral`` (4 experts, top 2) or ``t5``, float32, no dropout."""
    import transformers as tf

    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64))
    if name == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))
    if name == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    raise ValueError(f"unknown model {name!r}: use llama, mixtral or t5")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("llama", "mixtral", "t5"), default="llama")
    p.add_argument("--objective", choices=("time", "comm"), default="time", help="what soybean's plan minimises")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (max_steps)")
    p.add_argument("--soybean", action=argparse.BooleanOptionalAction, default=True,
                   help="train by soybean's plan (--no-soybean: the plain Trainer)")
    p.add_argument("--output-dir", default="out/hf_trainer")
    p.add_argument("--resume", default=None, help="a checkpoint directory to resume from")
    p.add_argument("--log-history", default=None, help="write Trainer's state.log_history here as JSON (rank 0)")
    p.add_argument("--batch", type=int, default=8, help="the global batch (rows per micro-step, all processes)")
    p.add_argument("--length", type=int, default=16, help="tokens per row")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--contract", choices=("auto", "local", "full"), default="auto",
                   help="soybean's input contract (auto: the plan's choice)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build(argv: list[str] | None = None) -> tuple[Any, argparse.Namespace]:
    """The Trainer the command line asks for, not yet trained, and the parsed flags."""
    import transformers as tf

    a = parse(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.batch % world:
        raise SystemExit(f"--batch {a.batch} must be a multiple of the {world} processes")
    seq2seq = a.model == "t5"
    tf.set_seed(a.seed)
    model = tiny_model(a.model)
    rows = a.batch * a.grad_accum * a.steps  # one epoch: every step reads new rows
    kind = tf.Seq2SeqTrainingArguments if seq2seq else tf.TrainingArguments
    args = kind(
        output_dir=a.output_dir, max_steps=a.steps, per_device_train_batch_size=a.batch // world,
        per_device_eval_batch_size=a.batch // world, gradient_accumulation_steps=a.grad_accum,
        max_grad_norm=a.max_grad_norm, learning_rate=a.lr, weight_decay=0.01, logging_steps=1,
        save_strategy="steps", save_steps=a.save_steps, eval_strategy="steps", eval_steps=a.save_steps,
        report_to="none", seed=a.seed, dataloader_drop_last=True, disable_tqdm=True,
        # Without a GPU, Trainer runs one process per CPU rank only when told to use the CPU (accelerate's gloo
        # group); on GPUs it makes an NCCL group.
        use_cpu=not torch.cuda.is_available())
    if a.soybean:
        from soybean.hf import Seq2SeqTrainer, Trainer

        trainer_cls = Seq2SeqTrainer if seq2seq else Trainer
        extra = {"soybean_options": {"objective": a.objective}, "soybean_contract": a.contract}
    else:
        trainer_cls, extra = (tf.Seq2SeqTrainer if seq2seq else tf.Trainer), {}
    trainer = trainer_cls(model=model, args=args, train_dataset=Patterns(rows, a.length, seq2seq),
                          eval_dataset=Patterns(a.batch, a.length, seq2seq),
                          data_collator=tf.default_data_collator, **extra)
    return trainer, a


def main(argv: list[str] | None = None) -> Any:
    trainer, a = build(argv)
    trainer.train(resume_from_checkpoint=a.resume)
    if trainer.is_world_process_zero():
        if a.soybean:
            print(trainer.soybean.describe())
        if a.log_history:
            with open(a.log_history, "w") as f:
                json.dump(trainer.state.log_history, f, indent=1)
    if torch.distributed.is_initialized():
        # Every rank leaves together and closes its group: a rank whose gloo threads are still open at interpreter
        # exit, while a peer is still writing, can abort ("terminate called without an active exception").
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return trainer


if __name__ == "__main__":
    main()
