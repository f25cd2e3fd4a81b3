"""AdamW as torch implements it, applied to any tensors we hand it.

The engine steps flat shards and the reference trainer steps a model's parameters; both go
through `torch.optim.AdamW` with the same implementation flag, because fused, foreach and the
single-tensor loop round differently. AdamW is elementwise, so stepping a flat concatenation
gives bitwise the same result as stepping its pieces (tests hold this).
"""

from __future__ import annotations

import torch

from tierzero.config import OptimizerSettings


def implementation(device: torch.device) -> dict[str, bool]:
    """torch's fused kernel where it exists (CPU since torch 2.4, CUDA), else foreach."""
    if device.type in ("cpu", "cuda"):
        return {"fused": True}
    return {"foreach": True}


def decays(param: torch.Tensor) -> bool:
    """Weight decay applies to matrices (linears, embeddings), never to norm gains or biases."""
    return param.dim() >= 2


def adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    weight_decay: list[float],
    steps: list[int],
    lr: float,
    optimizer: OptimizerSettings,
) -> None:
    """One AdamW update, in place, of `params` (any views: flat shard segments or parameters).

    `steps[i]` is the number of updates already applied to `params[i]` (torch's per-parameter
    state 'step' before this update).
    """
    if not params:
        return
    groups = [{"params": [p], "weight_decay": wd} for p, wd in zip(params, weight_decay)]
    opt = torch.optim.AdamW(
        groups, lr=lr, betas=optimizer.betas, eps=optimizer.eps, **implementation(params[0].device)
    )
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        p.grad = g
        # a fill on the device, not torch.tensor's synchronous host-to-device copy per parameter
        opt.state[p] = {
            "step": torch.full((), float(step), dtype=torch.float32, device=p.device),
            "exp_avg": m,
            "exp_avg_sq": v,
        }
    opt.step()
    for p in params:
        p.grad = None
