"""``soybean.hf.Trainer`` and ``soybean.hf.Seq2SeqTrainer``: ``transformers``' trainers that train by soybean's plan.

A Trainer script changes one import (``from soybean.hf import Trainer``) and nothing else: the model, the
``TrainingArguments``, the datasets, the collator, ``trainer.train(resume_from_checkpoint=...)`` and
``torchrun --nproc-per-node N train.py`` stay as they are (``docs/guide/hf_trainer.md`` says why a subclass
rather than a callback: Trainer's model wrapping, loss scaling, clipping and checkpoint writing are methods, not
events).  What the subclass replaces, and why each stays the serial run's:

* **Setup** (``_prepare_for_training``): instead of wrapping the model in DDP, it plans once from the first
  global batch (the dataset's first ``per_device_train_batch_size x world`` rows as the collator makes them, with
  ``num_items_in_batch`` where Trainer passes it) and builds the program (``SoybeanModel``); the optimizer Trainer
  creates on the serial model (or the one given) is pointed at the tiles before its first step, so its groups,
  settings and ``state_dict`` indices are the serial optimizer's; then the scheduler, as Trainer makes it.
* **Loss** (``compute_loss``): the program's loss is the whole global batch's, normalised by Trainer's
  ``num_items_in_batch`` (all ranks' label tokens) where the model takes it, so it is not multiplied by the
  number of processes as a DDP rank's share is; gradient accumulation, logging and the GA scaling are Trainer's.
* **Clipping** (``_clip_grad_norm``): the serial gradient norm from the tiles (``SoybeanModel.grad_norm``).
* **Checkpoints**: ``save_model`` gathers the tiles into the serial model (every rank) and rank 0 writes it with
  ``save_pretrained`` (safetensors, the model's own keys and config), so ``from_pretrained(checkpoint)`` loads the
  serial model; the optimizer state is gathered to the serial layout (``optimizer.pt``, the serial optimizer's
  indices) and cut back to tiles on resume; scheduler, RNG and trainer state are Trainer's.  Resuming loads the
  weights into the serial model before planning (Trainer's order), so the tiles start from them.
* **Evaluation**: the serial model, holding the current weights (gathered once per evaluation), evaluates each
  rank's share of the evaluation set as Trainer does under DDP.

Not offered (a clear error at ``train()``): DeepSpeed, FSDP, ``nn.DataParallel`` (several GPUs in one process),
fp16/bf16 autocast (soybean's ``precision`` option instead), a ``compute_loss_func`` or label smoothing (they read
the logits, which the local contract keeps split).
"""
from __future__ import annotations

import itertools
import logging
import os
from typing import Any

import torch
from torch import nn

from .model import SoybeanModel, world

try:
    import transformers

    # Trainer's own checkpoint file names: it looks for these when it resumes.
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
except ImportError as e:  # pragma: no cover - the hf extra is missing
    raise ImportError("soybean.hf needs transformers and accelerate: pip install 'soybean[hf]'") from e

PLAN_NAME = "soybean_plan.json"  # written by rank 0 into ``output_dir`` when the plan is made

logger = logging.getLogger(__name__)


class SoybeanTrainerMixin:
    """The methods ``soybean.hf.Trainer`` replaces (module docstring); mixed in before a ``transformers.Trainer``
    class.  ``soybean_options``: ``soybean.parallelize``'s planning keywords (``{"objective": "comm"}``);
    ``soybean_contract``: ``auto`` (default), ``local`` or ``full`` (``soybean.hf.model``)."""

    # Trainer's attributes this mixin reads (set by ``transformers.Trainer.__init__``)
    model: Any
    model_wrapped: Any
    args: Any
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any
    callback_handler: Any

    def __init__(self, *args: Any, soybean_options: dict[str, Any] | None = None, soybean_contract: str = "auto",
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._soybean_options = dict(soybean_options or {})
        self._soybean_contract = soybean_contract
        self.soybean: SoybeanModel | None = None

    # ---- setup -------------------------------------------------------------------------------------------

    def _refuse(self) -> None:
        """The Trainer features soybean does not run, named before anything is planned (same on every rank)."""
        t: Any = self
        why = []
        if t.is_deepspeed_enabled or t.is_fsdp_enabled:
            why.append("DeepSpeed/FSDP (soybean's plan already chooses how parameters are split): drop them")
        if t.args.n_gpu > 1:
            why.append(f"{t.args.n_gpu} GPUs in one process (nn.DataParallel): launch one process per GPU with "
                       "torchrun --nproc-per-node N")
        _, size = world()
        if size != t.args.world_size:
            why.append(f"{size} processes that Trainer runs as {t.args.world_size} (each alone, on all the data): on a "
                       "machine without GPUs pass use_cpu=True to TrainingArguments, so that accelerate makes the "
                       "gloo group")
        if t.args.fp16 or t.args.bf16:
            why.append("fp16/bf16 autocast (soybean computes in the plan's precision): pass soybean_options="
                       "{'precision': 'bf16-mixed'} instead")
        if t.compute_loss_func is not None or t.label_smoother is not None:
            why.append("a compute_loss_func or label_smoothing_factor (they read the logits, which the plan may keep "
                       "split): compute the loss in the model's forward")
        if why:
            raise ValueError("soybean.hf.Trainer does not run " + "; ".join(why))

    def _first_global_batch(self, dataloader: Any) -> dict[str, Any]:
        """The batch one process would read first, as the collator makes it: the dataset's first
        ``per_device_train_batch_size x world`` rows (the same on every rank, read without touching the loader,
        its sampler or any random generator), on the device, with ``num_items_in_batch`` where Trainer passes
        it to the model.  Only the shapes and the keywords shape the plan."""
        t: Any = self
        _, size = world()
        rows = t._train_batch_size * size
        dataset = dataloader.dataset
        if isinstance(dataset, torch.utils.data.IterableDataset):
            items = list(itertools.islice(iter(dataset), rows))
        else:
            items = [dataset[i] for i in range(min(rows, len(dataset)))]
        if len(items) < rows:
            raise ValueError(f"the training set has {len(items)} rows, fewer than one global batch ({rows}): "
                             "lower per_device_train_batch_size or add data")
        batch = t._prepare_inputs(dataloader.collate_fn(items))
        if t.model_accepts_loss_kwargs and "labels" in batch:
            n = t._get_num_items_in_batch([batch], t.args.device)
            if n is not None:
                batch["num_items_in_batch"] = _as_tensor(n, t.args.device)
        return dict(batch)

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
                              ) -> tuple[nn.Module, Any]:
        """Trainer's setup with soybean's program where Trainer would wrap the model (module docstring)."""
        t: Any = self
        self._refuse()
        if t._created_lr_scheduler:  # as Trainer: a new scheduler per train() call
            t.lr_scheduler = None
            t._created_lr_scheduler = False
        if self.soybean is None:
            self.soybean = SoybeanModel(self.model, contract=self._soybean_contract, **self._soybean_options)
            pm = self.soybean.plan_from(self._first_global_batch(train_dataloader))
            logger.info(self.soybean.describe())
            if self.args.should_save:  # the plan beside the checkpoints: `soybean explain` reads it
                os.makedirs(self.args.output_dir, exist_ok=True)
                pm.plan.save(os.path.join(self.args.output_dir, PLAN_NAME))
        else:
            self.soybean.load_serial()  # a later train(): the serial model may have been loaded since
        if t.optimizer is None:
            t.create_optimizer()  # on the serial model: its groups by the serial parameters' names
        self.soybean.rebind(self.optimizer)
        self.optimizer = self.accelerator.prepare(self.optimizer)
        t.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = self.soybean
        if resume_from_checkpoint is not None:
            t._load_optimizer_and_scheduler(resume_from_checkpoint)
            t._load_scaler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.soybean, train_dataloader

    # ---- a step --------------------------------------------------------------------------------------------

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """The global batch's loss from the program (the same on every rank), not scaled by the number of
        processes; another model (evaluation's serial one) as Trainer computes it."""
        if model is not self.soybean:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,  # type: ignore[misc]
                                        num_items_in_batch=num_items_in_batch)
        t: Any = self
        if t.model_accepts_loss_kwargs and num_items_in_batch is not None:
            inputs = {**inputs, "num_items_in_batch": _as_tensor(num_items_in_batch, t.args.device)}
        outputs = model(**inputs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        return (loss, outputs) if return_outputs else loss

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        if model is not self.soybean:
            return super()._clip_grad_norm(model)  # type: ignore[misc]
        return self.soybean.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if model is not self.soybean or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)  # type: ignore[misc]
        return self.soybean.grad_norm()

    # ---- checkpoints and evaluation ------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's ``save_model`` of the serial model holding the current weights (gathered on every rank
        first: every rank calls ``save_model``, rank 0 writes)."""
        if self.soybean is not None and self.soybean.planned:
            self.soybean.sync_serial()
        super().save_model(output_dir, _internal_call=_internal_call)  # type: ignore[misc]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """The checkpoint's weights into the serial model as ``from_pretrained`` reads them.  ``save_pretrained``
        may write a model's weights under other keys than its ``state_dict``'s (transformers 5 writes a Mixtral's
        fused experts as the per-expert ``w1``/``w2``/``w3`` of older checkpoints), which ``from_pretrained``
        converts back but Trainer's own resume does not (it warns of missing keys and keeps the current weights:
        measured with the plain Trainer); so the weights are read through ``from_pretrained``."""
        target = self.model if model is None else model
        files = ("config.json", "model.safetensors")
        if not (isinstance(target, transformers.PreTrainedModel)
                and all(os.path.isfile(os.path.join(resume_from_checkpoint, f)) for f in files)):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        loaded = type(target).from_pretrained(resume_from_checkpoint, dtype=target.dtype)
        target.load_state_dict(loaded.state_dict())
        del loaded

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The optimizer's state gathered to the serial layout (every rank), written by rank 0 with the
        scheduler's."""
        if self.soybean is None or not self.soybean.planned:
            return super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
        full = self.soybean.optimizer_state_full(self.optimizer)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            torch.save(full, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """A serial-layout ``optimizer.pt`` cut to this rank's tiles, and the scheduler's state."""
        if checkpoint is None or self.soybean is None or not self.soybean.planned:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        opt, sched = os.path.join(checkpoint, OPTIMIZER_NAME), os.path.join(checkpoint, SCHEDULER_NAME)
        if not (os.path.isfile(opt) and os.path.isfile(sched)):
            return  # as Trainer: a checkpoint without them resumes the weights only
        self.soybean.load_optimizer_state_full(self.optimizer, torch.load(opt, map_location="cpu", weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(sched, map_location="cpu", weights_only=True))

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's evaluation of the serial model, holding the current weights (every rank gathers them)."""
        if self.soybean is not None and self.soybean.planned:
            self.soybean.sync_serial()
        return super().evaluation_loop(*args, **kwargs)  # type: ignore[misc]


def _as_tensor(n: Any, device: Any) -> torch.Tensor:
    """``num_items_in_batch`` as a tensor: a program input (a Python number would be captured as a constant)."""
    return n if isinstance(n, torch.Tensor) else torch.tensor(n, device=device)


class Trainer(SoybeanTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` training by soybean's plan (``soybean.hf.trainer``)."""


class Seq2SeqTrainer(SoybeanTrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` training by soybean's plan (``soybean.hf.trainer``)."""
