"""Sizing and timing an out-of-core run (`benchmarks/out_of_core.py`): a LLaMA-style shape with
at least a given number of parameters, the training state's bytes per parameter, the drive's
store bandwidth, and from the measured disk and CPU rates what the run should take. Nothing here
prints."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tierzero.config import StateKind
from tierzero.models import ModelArgs
from tierzero.planning import speeds as compute_bench
from tierzero.planning.diskbench import DiskBench
from tierzero.planning.statebytes import StateBytes
from tierzero.storage.host import HostPool
from tierzero.storage.io import IOLoop

VOCAB = 32000
# Widths tried in order; the first whose depth stays within dim / 100 layers (LLaMA-2 7B: 4096
# wide, 32 deep) and at least 2 is taken, so the shape stays LLaMA-like at any size.
DIMS = (256, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192)
GB = 1e9


# -- the model -----------------------------------------------------------------------------------


def state_bytes_per_param(dtype: str, formats: StateBytes) -> float:
    """param in the compute dtype (none of its own when it is the bf16 master), grad (fp32 in
    tierzero), master and both Adam moments in their stored formats."""
    itemsize = 2 if dtype == "bf16" else 4
    kinds = [k for k in StateKind if not (k is StateKind.PARAM and formats.one_weight)]
    return sum(formats.per_param(k, itemsize, grad_itemsize=4) for k in kinds)


def llama_shape(target_params: int, seq_len: int) -> ModelArgs:
    """The narrowest LLaMA-style shape in `DIMS` with at least `target_params` parameters and no
    more than max(2, dim / 100) layers: untied, vocab 32000, SwiGLU width 8/3 dim rounded up to
    256, heads of 128 (64 below dim 1024), no GQA."""
    for dim in DIMS:
        heads = dim // 128 if dim >= 1024 else dim // 64
        ffn = math.ceil(8 * dim / 3 / 256) * 256
        one = ModelArgs(
            dim=dim,
            n_layers=1,
            n_heads=heads,
            n_kv_heads=heads,
            vocab_size=VOCAB,
            ffn_dim=ffn,
            max_seq_len=max(seq_len, 2048),
        )
        block = replace(one, n_layers=2).param_count() - one.param_count()
        layers = max(2, 1 + math.ceil((target_params - one.param_count()) / block))
        if layers <= max(2, dim // 100):
            return replace(one, n_layers=layers)
    raise ValueError(
        f"no shape up to dim {DIMS[-1]} reaches {target_params:,} params within "
        f"dim / 100 layers; ask for fewer parameters"
    )


# -- measurements before training ----------------------------------------------------------------


def measure_disk(directory: Path, nbytes: int, io_threads: int) -> dict[str, Any]:
    """The drive's store and raw GB/s: `DiskBench`'s always-run group (layout, one interleaved
    round of raw direct I/O and the store; reads are cold, of a slot written before)."""
    with (
        IOLoop(io_threads) as io_loop,
        HostPool(nbytes, alignment=4096) as pool,
        DiskBench(str(directory), nbytes, io_loop, pool, rounds=1) as disk,
    ):
        for step in disk.steps():
            if step.group == 0:
                step.run()
        return disk.result()["nvme"]


@dataclass
class Estimate:
    """What the run should take, from the state's size and the measured disk and CPU rates.

    Per step the engine reads params twice (forward, and the recompute in backward, unless its
    host cache still holds them) and master + both Adam moments once, and writes params,
    master and moments once; gradients go from backward straight to the optimizer
    (overlap_step), so they never reach the disk. Compute is 8 x params x tokens flops
    (forward, recompute, backward) at the measured matmul rate, plus the optimizer at the
    measured CPU AdamW rate; a step's estimate is compute + the serial I/O time, a ceiling,
    since the engine overlaps them. Materialising draws every weight (the measured normal_
    rate) and writes the whole state into new files, which on ext4 go at about half the speed
    of overwrites (`tierzero.storage.nvme.spares`), one unit at a time.
    """

    materialise_s: float
    step_s: float
    total_s: float
    read_bytes_per_step: int
    write_bytes_per_step: int
    matmul_tflops: float
    adam_params_per_s: float
    init_params_per_s: float


def init_params_per_s(numel: int = 1 << 22, seconds: float = 0.5) -> float:
    """Weights per second drawn by `normal_` from a seeded generator, as the models initialise."""
    buf, generator = torch.empty(numel), torch.Generator().manual_seed(0)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        buf.normal_(0.0, 0.02, generator=generator)
        best = min(best, time.perf_counter() - t0)
    return numel / best


def estimate(
    params: int,
    state_bytes: int,
    itemsize: int,
    tokens: int,
    steps: int,
    disk: dict[str, Any],
    dtype: torch.dtype,
    formats: StateBytes,
) -> Estimate:
    tflops = compute_bench.matmul_tflops(dtype, n=1024, seconds=0.5)
    adam = compute_bench.adam_params_per_s(seconds=0.5)
    init = init_params_per_s()
    read_bw, write_bw = disk["read_gbps"] * GB, disk["write_gbps"] * GB
    optimizer = sum(
        formats.per_param(k, itemsize)
        for k in (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
    )
    # else the step writes the param as its master
    written_param = 0 if formats.one_weight else itemsize
    read, write = (
        int(params * (2 * itemsize + optimizer)),
        int(params * (written_param + optimizer)),
    )
    step = 8 * params * tokens / (tflops * 1e12) + params / adam + read / read_bw + write / write_bw
    materialise = params / init + 2 * state_bytes / write_bw
    return Estimate(materialise, step, materialise + steps * step, read, write, tflops, adam, init)
