"""Run as a script: train a few steps per case and print predicted vs measured memory as JSON lines.

Each case is one engine on the CPU device, fp32, its host budget exactly the memory model's
host total (activations included). Measured: the pools' peak counters over the steps after the
first (the first opens the engine and reserves the activations), and the growth of the
process's resident memory over the same steps (VmHWM reset through /proc/self/clear_refs) from
its size before the engine was built. The first case runs once unmeasured first: it pays
torch's and the I/O thread pool's one-time costs (the fixed overhead README states).
Used by tests/planning/test_memory_model.py; a subprocess, so the RSS is this run's alone.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

from tierzero import Config, models
from tierzero.config import TORCH_DTYPES, DType, Placement, Schedule, Tier
from tierzero.engine import Engine
from tierzero.models import ModelArgs
from tierzero.planning.ledger import activation_memory
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.statebytes import StateBytes, grad_dtype
from tierzero.planning.workload import Workload


def status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmHWM:", "VmRSS:")):
            key, value = line.split(":")
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def run(case: dict, root: Path) -> dict:
    args = ModelArgs(**case["args"])
    side = case.get("optimizer_device", "auto")  # "gpu": stepped on the compute device
    placement = Placement(
        *[Tier(t) for t in case["placement"]], optimizer=Tier.GPU if side == "gpu" else None
    )
    batch_size, seq_len, steps = case["batch"], case["seq"], case.get("steps", 2)
    dtype, moments, master = (
        case.get("dtype", "fp32"),
        case.get("optimizer_state", "fp32"),
        case.get("master", "fp32"),
    )
    itemsize = 2 if dtype == "bf16" else 4
    formats = StateBytes.for_compute(moments, master, DType(dtype))
    grads = TORCH_DTYPES[grad_dtype(DType(dtype), 1, Schedule.AUTO)].itemsize  # as planned
    act = activation_memory(
        args, batch_size, seq_len, itemsize, models.llama.loss_chunk_bytes(args.vocab_size)
    )
    predicted = peak_memory(
        Workload.from_preset(
            args,
            itemsize,
            grad_itemsize=grads,
            device="cpu",
            prefetch_depth=case["depth"],
            piece_numel=case["piece"],
            overlap=True,
            activations=act,
            formats=formats,
        ),
        placement,
    )
    cfg = Config(
        placement=placement,
        device="cpu",
        dtype=dtype,
        nvme_path=[str(root / case["name"])],
        prefetch_depth=case["depth"],
        piece_numel=case["piece"],
        lr=1e-3,
        host_budget=predicted.host_total_bytes,
        optimizer_state=moments,
        master=master,
        optimizer_device=side,
    )
    g = torch.Generator().manual_seed(0)
    batch = (
        torch.randint(0, args.vocab_size, (batch_size, seq_len), generator=g),
        torch.randint(0, args.vocab_size, (batch_size, seq_len), generator=g),
    )
    gc.collect()
    base = status()["VmRSS"]
    engine = Engine(models.build(args, device="meta"), cfg)
    try:
        engine.train_step(batch)  # opens the engine, reserves the activations
        engine.parts.tiers.host_pool.reset_peak()
        engine.parts.tiers.device_pool.reset_peak()
        reset_hwm()
        for _ in range(steps):
            engine.train_step(batch)
        rss = status()["VmHWM"] - base
        peaks = engine.stats()
    finally:
        engine.close()
    return {
        "name": case["name"],
        "params": args.param_count(),
        "predicted_host_total": predicted.host_total_bytes,
        "measured_rss_growth": rss,
        "predicted_host_pool": predicted.tiers[Tier.HOST].pool_bytes,
        "measured_host_pool": peaks["peak_host_bytes"],
        "predicted_gpu_pool": predicted.tiers[Tier.GPU].pool_bytes,
        "measured_gpu_pool": peaks["peak_gpu_bytes"],
        "predicted_unpooled": predicted.host_memory.unpooled_bytes,
        "breakdown": predicted.breakdown(),
    }


def main() -> None:
    torch.set_num_threads(2)
    cases = json.loads(sys.argv[1])
    # the drive's speed is not what is measured: tmpfs where there is one (its pages are not RSS)
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        root = Path(tmp)
        run({**cases[0], "name": "warm-up"}, root)  # torch's and the I/O threads' first-use costs
        for case in cases:
            print(json.dumps(run(case, root)), flush=True)


if __name__ == "__main__":
    main()
