"""Hugging Face ``Trainer`` with optpass: the whole training step compiled, the update in backward.

``Trainer(torch_compile=True)`` compiles the model's forward only; optpass's rewrites act on the
step (backward, clipping, the update), which the Trainer runs eagerly around it. ``OptpassTrainer``
(and ``OptpassSeq2SeqTrainer``) keep the Trainer's loop, data, logging, evaluation, checkpoints and
callbacks, and compile what ``training_step`` does (the Trainer's own ``compute_loss`` under its
autocast, the loss scaled for accumulation as the Trainer scales it, ``backward``) with
``backend="optpass"`` and the options the user already set in ``TrainingArguments``:

* ``gradient_accumulation_steps`` -> ``accumulation_steps``: the K-th micro-step of a window applies
  the update inside its backward; micro-steps 1..K-1 accumulate into ``.grad``;
* ``max_grad_norm`` (> 0) -> ``clip_grad_norm``: the window's gradient clipped by its global norm
  before the update; the norm the Trainer logs as ``grad_norm`` is ``optpass.grad_norm(opt)``; with
  ``max_grad_norm=0``, ``clip_grad_norm=inf``: no clipping, the norm only reported (no extra backward);
* the optimizer the Trainer built (``optim``: ``adamw_torch``, ``sgd``, a torchao low-bit one...) ->
  ``optimizer``, with ``optimizer_in_backward=True``; the LR scheduler sets each group's lr as before
  (optpass reads it at every step, no recompile);
* ``bf16``: the Trainer's autocast, traced into the step; ``gradient_checkpointing``: the model's
  checkpointed layers, recomputed in the compiled backward.

After a window that optpass updated, every gradient is ``None``: the Trainer's ``clip_grad_norm_``
and ``optimizer.step()`` that follow have nothing to do (``_clip_grad_norm`` returns optpass's norm
instead). A window cut short at an epoch's end (fewer than K micro-batches left) is not updated
inside backward: its gradients stay in ``.grad`` and the Trainer clips and steps them eagerly, as it
would without optpass. Optimizer state stays in the optimizer: ``save_steps`` checkpoints and
``resume_from_checkpoint`` save and load it as they do.

Refused, with the reason (``OptpassError`` when the Trainer is built): ``fp16`` (its GradScaler
runs outside the step: use ``bf16``), more than one process (DDP, FSDP, DeepSpeed: use
``optpass.fully_shard`` or ``data_parallel`` in a loop of your own, docs/fsdp.md), ``torch_compile``
(the Trainer would compile the forward again inside optpass's step), LOMO optimizers (they update
inside their own backward).

    from optpass.integrations.transformers import OptpassTrainer
    trainer = OptpassTrainer(model=model, args=TrainingArguments(..., gradient_accumulation_steps=4,
                             max_grad_norm=1.0), train_dataset=train, data_collator=collator)
    trainer.train()
"""

from __future__ import annotations

from typing import Any

import torch

from optpass.errors import OptpassError

try:
    from transformers import Seq2SeqTrainer, Trainer
except ImportError as error:                      # pragma: no cover - transformers is optional
    raise ImportError("optpass.integrations.transformers needs Hugging Face transformers (and accelerate): "
                      "pip install transformers accelerate") from error


class OptpassTrainerMixin:
    """What ``OptpassTrainer`` adds to a ``transformers.Trainer`` (see the module docstring).

    Args:
        optpass_options: options added to (or overriding) those taken from ``TrainingArguments``,
            e.g. ``{"optimizer_in_backward": False}`` for the update after backward (then
            ``gradient_accumulation_steps`` must be 1), ``{"lower": "eager"}``, ``{"master_weights":
            torch.float32}`` for a bf16 model. ``optimizer`` is always the Trainer's.
        optpass_dynamic: ``torch.compile``'s ``dynamic`` for the step (``None``: torch's default, a
            second sequence length recompiles once with dynamic shapes).
    """

    def __init__(self, *args, optpass_options: dict[str, Any] | None = None, optpass_dynamic: bool | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.optpass_options = dict(optpass_options or {})
        self.optpass_dynamic = optpass_dynamic
        self._optpass_steps: dict[bool, Any] = {}
        _refuse_what_cannot_be_compiled(self.args)
        if "optimizer" in self.optpass_options:
            raise OptpassError("OptpassTrainer(optpass_options={'optimizer': ...}): the optimizer is the Trainer's "
                               "(TrainingArguments.optim, or Trainer(optimizers=(opt, scheduler))); leave it out "
                               "of optpass_options.")

    # -- the step ---------------------------------------------------------------------------------

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """The Trainer's training step (loss, scaled for accumulation, and backward), compiled with
        optpass: the K-th micro-step of a window also clips and applies the update."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        divisor = 1 if self._loss_scaled_for_accumulation(num_items_in_batch) else \
            self.current_gradient_accumulation_steps
        return self._optpass_step(model)(model, inputs, num_items_in_batch, divisor)

    def _loss_scaled_for_accumulation(self, num_items_in_batch) -> bool:
        """Whether ``compute_loss`` already normalized the loss over the window (the Trainer's rule)."""
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return bool((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                    or self.compute_loss_func is not None)

    def _optpass_step(self, model: torch.nn.Module):
        """The compiled step, built at the first call (the Trainer makes its optimizer just before)."""
        accumulating = self.args.gradient_accumulation_steps > 1
        step = self._optpass_steps.get(accumulating)
        if step is None:
            step = self._optpass_steps[accumulating] = torch.compile(
                self._micro_step if accumulating else self._whole_step, backend="optpass",
                options=self.optpass_step_options(), dynamic=self.optpass_dynamic)
        return step

    def optpass_step_options(self) -> dict[str, Any]:
        """The options the step is compiled with: those ``TrainingArguments`` imply, then ``optpass_options``."""
        options: dict[str, Any] = {"optimizer": self.raw_optimizer, "optimizer_in_backward": True}
        if self.args.gradient_accumulation_steps > 1:
            options["accumulation_steps"] = self.args.gradient_accumulation_steps
        # max_grad_norm 0 (or None): no clipping, but the Trainer still logs the norm: an infinite max norm
        # reports it, taken from the gradients as backward makes them (no norm-only backward)
        clip = self.args.max_grad_norm
        options["clip_grad_norm"] = float(clip) if clip is not None and clip > 0 else float("inf")
        options.update(self.optpass_options)
        return options

    @property
    def raw_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer under accelerate's wrapper: the one optpass fuses into backward."""
        optimizer = self.optimizer                # accelerate's AcceleratedOptimizer subclasses Optimizer
        while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            optimizer = optimizer.optimizer
        return optimizer

    def _loss(self, model, inputs, num_items_in_batch, divisor) -> torch.Tensor:
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if self.args.n_gpu > 1:
            loss = loss.mean()
        return loss / divisor if divisor != 1 else loss

    def _micro_step(self, model, inputs, num_items_in_batch, divisor) -> torch.Tensor:
        """One micro-step of a window: optpass applies the update at every K-th (accumulation_steps)."""
        loss = self._loss(model, inputs, num_items_in_batch, divisor)
        loss.backward()
        return loss.detach()

    def _whole_step(self, model, inputs, num_items_in_batch, divisor) -> torch.Tensor:
        """No accumulation: the supported whole-step shape, the update in it."""
        loss = self._loss(model, inputs, num_items_in_batch, divisor)
        loss.backward()
        out = loss.detach()
        optimizer = self.raw_optimizer
        optimizer.step()
        optimizer.zero_grad()
        return out

    # -- what the Trainer does after the step ---------------------------------------------------

    def _clip_grad_norm(self, model: torch.nn.Module):
        """The norm optpass clipped by when it updated this window in backward (every gradient is
        None then); the Trainer's own clipping of ``.grad`` otherwise (a window cut short)."""
        if self._window_updated_in_step(model):
            from optpass.runtime.grad_norm import grad_norm

            return grad_norm(self.raw_optimizer)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm=None):
        if grad_norm is None and self._window_updated_in_step(model):
            from optpass.runtime.grad_norm import grad_norm as optpass_grad_norm

            return optpass_grad_norm(self.raw_optimizer)    # no clipping asked: the norm the step reported
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _window_updated_in_step(self, model: torch.nn.Module) -> bool:
        trained = [p for p in model.parameters() if p.requires_grad]
        return bool(self._optpass_steps) and all(p.grad is None for p in trained)


class OptpassTrainer(OptpassTrainerMixin, Trainer):
    """``transformers.Trainer`` whose training step is compiled with optpass (see the module docstring)."""


class OptpassSeq2SeqTrainer(OptpassTrainerMixin, Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` whose training step is compiled with optpass (see the module docstring)."""


def _refuse_what_cannot_be_compiled(args) -> None:
    """What the Trainer would do around the step that a compiled step cannot take in: an OptpassError
    naming the argument and what to do."""
    problems = []
    if getattr(args, "fp16", False):
        problems.append("fp16=True: the Trainer scales the loss with a GradScaler and steps it outside the step; "
                        "use bf16=True (autocast, traced into the step), or optpass's grad_scaler option in a "
                        "loop of your own (docs/mixed_precision.md)")
    if getattr(args, "world_size", 1) > 1:
        problems.append(f"{args.world_size} processes: OptpassTrainer trains on one; for several, shard the model "
                        "with optpass.fully_shard or pass data_parallel='zero1' in a loop of your own "
                        "(docs/fsdp.md, docs/zero1.md)")
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        problems.append("deepspeed / fsdp in TrainingArguments: they wrap the model and own the update; use "
                        "optpass.fully_shard in a loop of your own (docs/fsdp.md)")
    if getattr(args, "torch_compile", False):
        problems.append("torch_compile=True: the Trainer would compile the model's forward again inside "
                        "optpass's compiled step; leave it off (OptpassTrainer compiles the whole step)")
    if "lomo" in str(getattr(args, "optim", "")).lower():
        problems.append(f"optim={getattr(args.optim, 'value', args.optim)}: LOMO updates inside its own backward; use an elementwise torch "
                        "optimizer (adamw_torch, sgd), which optpass updates in backward the same way")
    if problems:
        raise OptpassError("OptpassTrainer cannot compile this Trainer's step:\n  - " + "\n  - ".join(problems))
