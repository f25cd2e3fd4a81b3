"""`tierzero plan --json`: each of a plan's records as its section of the JSON object.

Owns the sections' keys (tests/cli and tests/planning read them, and the text report prints
from them, so the two cannot disagree); `PlanReport.as_dict` puts them in order. Plain data
out: it never prints.
"""

from __future__ import annotations

from typing import Any

from tierzero.config import TORCH_DTYPES
from tierzero.planning.ledger import GB, ActivationEstimate, format_rows, ledger
from tierzero.planning.planrecords import Machine, ModelShape, Precision, RecomputeChoice
from tierzero.planning.workload import Workload


def model(shape: ModelShape, work: Workload) -> dict[str, Any]:
    return {
        "preset": shape.preset,
        "shape": shape.shape,
        "params": shape.numel,
        "ledger_params": shape.ledger_numel,
        "units": len(work.units),
        "largest_unit_params": work.largest_unit_numel,
        "vocab_size": shape.args.vocab_size,
    }


def machine(m: Machine) -> dict[str, Any]:
    return {
        "gpus": m.gpus,
        "detected": m.detected,
        "device": m.device,
        **{f"{t.value}_budget_bytes": b for t, b in m.budgets.items()},
    }


def state_formats(p: Precision) -> dict[str, Any]:
    return {
        "optimizer_state": p.formats.optimizer_state.value,
        "master": p.formats.master.value,
        "one_weight": p.formats.one_weight,
        "text": p.formats.describe(),
        "grad": p.grad_dtype.value,
        "grad_reason": p.grad_reason,
    }


def ledger_rows(shape: ModelShape, p: Precision, gpus: int) -> list[dict[str, Any]]:
    """The 16-byte ledger per GPU, stage by stage, at the ledger's size and the exact one."""
    itemsize = TORCH_DTYPES[p.dtype].itemsize
    return [
        {
            "stage": r.stage.value,
            "bytes_per_param": r.bytes_per_param,
            "gb_per_gpu": round(r.bytes_per_gpu / GB, 4),
            "exact_gb_per_gpu": round(r.bytes_per_param * shape.numel / GB, 4),
        }
        for r in ledger(shape.ledger_numel, gpus, itemsize, p.formats)
    ]


def compact_rows(p: Precision) -> list[dict[str, Any]]:
    """The state's bytes per parameter for each (--optimizer-state, --master)."""
    return [
        {
            "optimizer_state": f.formats.optimizer_state.value,
            "master": f.formats.master.value,
            "weights": f.weights,
            "grads": f.grads,
            "moments": f.moments,
            "bytes_per_param": f.total,
            "chosen": f.formats == p.formats,
        }
        for f in format_rows(p.dtype)
    ]


def activations(act: ActivationEstimate) -> dict[str, Any]:
    return {
        "batch_size": act.batch_size,
        "seq_len": act.seq_len,
        "checkpoints_bytes": act.checkpoints_bytes,
        "block_backward_bytes": act.block_backward_bytes,
        "head_backward_bytes": act.head_backward_bytes,
        "logits_bytes": act.logits_bytes,
        "chunk_tokens": act.chunk_tokens,
        "forward_bytes": act.forward_bytes,
        "backward_bytes": act.backward_bytes,
        "total_bytes": act.total_bytes,
    }


def recompute(rc: RecomputeChoice, act: ActivationEstimate) -> dict[str, Any]:
    return {
        "recompute": rc.recompute.value,
        "keepable_units": rc.keepable_units,
        "kept_blocks": rc.kept.kept_blocks if rc.kept else 0,
        "kept_head": rc.kept.kept_head if rc.kept else False,
        "graphs_per_block": rc.kept.vertical or 1 if rc.kept else 1,
        "bytes_per_block": rc.kept.block_kept_bytes if rc.kept else act.recompute_bytes,
        "head_bytes": act.head_kept_bytes,
        "kept_bytes": rc.kept.kept_bytes if rc.kept else 0,
        "sized_by": "the engine's first step" if rc.measured else "the shape",
    }
