"""The reference trainer: plain in-memory PyTorch, the oracle every tiered path is compared with.

It is also what `tierzero train --offload none` runs. Nothing here is clever on purpose: the
model lives on one device, `torch.optim.AdamW` steps it, `clip_grad_norm_` clips it. Its one
concession to the engine: each unit's call draws its dropout masks from the state the engine's
does (`tierzero.models.draws`), so models with dropout compare bitwise too.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from tierzero.adamw import decays, implementation
from tierzero.config import Config, DType
from tierzero.lr import lr_at
from tierzero.models.draws import SeededEntries, unit_entries
from tierzero.models.loss import compute_loss, loss_divisor
from tierzero.precision import resolve_dtype


class ReferenceTrainer:
    """AdamW + warmup/cosine + gradient accumulation + clipping on one device, in memory.

    Weights stay fp32; bf16/fp16 compute runs under `torch.autocast` (fp16 without a loss
    scaler: the reference is for bf16/fp32 comparisons, the engine owns dynamic scaling).
    """

    def __init__(
        self, model: nn.Module, config: Config, device: torch.device | str = "cpu"
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = resolve_dtype(config.precision.dtype, self.device)
        self.model = model.to(self.device)
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {
                "params": [p for p in params if decays(p)],
                "weight_decay": config.optimizer.weight_decay,
            },
            {"params": [p for p in params if not decays(p)], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=config.optimizer.lr,
            betas=config.optimizer.betas,
            eps=config.optimizer.eps,
            **implementation(self.device),
        )
        self.step_count = 0
        self.micro_step = 0
        SeededEntries(
            unit_entries(model),
            config.seed,
            lambda: (self.step_count, self.micro_step % config.execution.accumulate),
        )
        self.last_grad_norm: float | None = None

    def train_step(self, batch: Any, step_tokens: int | None = None) -> float:
        """Forward and backward one micro-batch; step after every `accumulate` of them.
        `step_tokens`: the trained tokens of the step's whole batch (`Engine.forward`)."""
        return self.train_micro_batch(batch, step_tokens).item()

    def train_micro_batch(self, batch: Any, step_tokens: int | None = None) -> torch.Tensor:
        """`train_step`, the loss left on the device (detached)."""
        self.model.train()
        divisor = loss_divisor(step_tokens, False, self.config.execution.accumulate, 1)
        with self._autocast():
            loss = compute_loss(self.model, to_device(batch, self.device), divisor)
        (loss / self.config.execution.accumulate).backward()
        self.micro_step += 1
        if self.micro_step % self.config.execution.accumulate == 0:
            self._step()
        return loss.detach()

    def _step(self) -> None:
        if self.config.optimizer.clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.config.optimizer.clip_grad_norm
            )
            self.last_grad_norm = norm.item()
        lr = lr_at(self.step_count, self.config.optimizer)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1

    @torch.no_grad()
    def eval_loss(self, batch: Any, summed: bool = False) -> float:
        """The loss in eval mode: the mean over the batch's trained tokens, or with `summed` their
        sum."""
        self.model.eval()
        with self._autocast():
            return compute_loss(
                self.model, to_device(batch, self.device), loss_divisor(None, summed, 1, 1)
            ).item()

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Plain PyTorch mixed precision: fp32 weights, low-precision matmuls under autocast."""
        if self.dtype is DType.FP32:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.dtype is DType.BF16 else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 weights under every parameter name, tied aliases included (like `state_dict`)."""
        return {
            name: p.detach().float().cpu()
            for name, p in self.model.named_parameters(remove_duplicate=False)
        }

    def stats(self) -> dict[str, Any]:
        return {"grad_norm": self.last_grad_norm} if self.last_grad_norm is not None else {}

    def close(self) -> None:
        pass


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a batch (tensor, dict, tuple or list) to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
