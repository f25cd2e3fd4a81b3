"""One GPU for real: measure this machine, then train a preset with every state on the host and
then on NVMe, inside a hard time budget, recording every result the moment it exists.

    python benchmarks/gpu.py                      # on a GPU machine, no arguments: 6 minutes
    python benchmarks/gpu.py --quick --dry-run    # anywhere: the plan, the bound, what fits

With no arguments it works in `../tierzero-gpu` (beside the repo; `--work-dir`), checks that
the directory takes O_DIRECT and how much it has free, measures the bf16 matmul peak, pinned
H2D/D2H, the drive and CPU AdamW, prints the planner's verdict on each placement (a refused
placement is recorded, not fatal), sizes the preset and steps of each placement to its share
of `--minutes` (default 6), runs the CUDA tests in a child (not with `--quick`), and trains.
A watchdog stops the run at the budget. In the work dir it writes

- `results.jsonl`: one JSON object a line, appended and flushed as each exists: the machine,
  the peaks, each verdict and plan, each timed step, each placement's figures (step time,
  model TFLOPS, H2D/D2H/NVMe GB/s, I/O wait share, the bound and the step's ratio to it,
  pinning calls per step), each refusal and error with its message, and the trace summary;
- `trace-<preset>-<placement>.json.gz`: a `torch.profiler` trace of one step (< 10 MB), whose
  summary in `results.jsonl` gives the GPU busy share, the copy overlap and the five largest
  GPU-idle gaps with the host call that caused each;
- `pytest-cuda.txt`: the CUDA tests' output (not with `--quick`).

`--device cpu` runs the same stages on the CPU with the `tiny` preset. The benchmark logic lives
in `tierzero.bench`; this script parses flags and prints.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from tierzero.bench import gpu_run
from tierzero.bench.plan import PLACEMENTS
from tierzero.bench.results import ResultLog
from tierzero.config import parse_bytes
from tierzero.models.presets import PRESETS

REPO = Path(__file__).resolve().parents[1]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--work-dir",
        default=str(REPO.parent / "tierzero-gpu"),
        help="stores, results and traces (default: tierzero-gpu beside the repo); a local SSD",
    )
    ap.add_argument(
        "--minutes", type=float, default=6.0, help="the hard time budget the run is sized to"
    )
    ap.add_argument(
        "--quick", action="store_true", help="presets up to 1b, short peak probes, no pytest child"
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan for an H200 with nominal rates; run nothing",
    )
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the same stages with the tiny preset on the CPU",
    )
    ap.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="this preset instead of the largest that fits",
    )
    ap.add_argument("--placements", default="host,nvme")
    ap.add_argument("--seq-len", type=int, default=None, help="default 2048 (on --device cpu: 128)")
    ap.add_argument(
        "--steps", type=int, default=3, help="at most this many timed steps per placement"
    )
    ap.add_argument("--max-accumulate", type=int, default=8)
    ap.add_argument(
        "--gpu-mem",
        default=None,
        help="cap the GPU memory torch may use (e.g. 24GiB, a workstation card)",
    )
    ap.add_argument(
        "--host-fraction", type=float, default=0.8, help="share of MemAvailable the engine may use"
    )
    ap.add_argument(
        "--optimizer-device",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="where the optimizer steps (run twice, cpu then gpu, to time the two sides)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    placements = tuple(p for p in opts.placements.split(",") if p)
    if not placements or set(placements) - set(PLACEMENTS):
        print(
            f"--placements takes a comma-separated subset of {', '.join(PLACEMENTS)}",
            file=sys.stderr,
        )
        return 2
    if opts.minutes <= 0 or opts.steps < 1:
        print("--minutes must be positive and --steps at least 1", file=sys.stderr)
        return 2
    options = gpu_run.Options(
        work_dir=Path(opts.work_dir).resolve(),
        repo=REPO,
        minutes=opts.minutes,
        quick=opts.quick,
        device=opts.device,
        preset=opts.preset,
        placements=placements,
        max_steps=opts.steps,
        seq_len=opts.seq_len or (128 if opts.device == "cpu" else 2048),
        largest_micro_batch=1 if opts.device == "cpu" else 16,
        max_accumulate=opts.max_accumulate,
        host_fraction=opts.host_fraction,
        gpu_bytes=parse_bytes(opts.gpu_mem, "--gpu-mem") if opts.gpu_mem else None,
        optimizer_device=opts.optimizer_device,
    )
    if opts.dry_run:
        print("\n".join(gpu_run.dry_run(options)))
        return 0
    if opts.device == "cuda" and not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py needs a CUDA GPU and none is visible here; pass --dry-run for the "
            "plan, or --device cpu to run its stages on the CPU",
            file=sys.stderr,
        )
        return 2
    if options.gpu_bytes is not None and opts.device == "cuda":
        device = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, options.gpu_bytes / total), device)
    results = options.work_dir / "results.jsonl"
    with ResultLog(results, run=time.strftime("%Y%m%dT%H%M%S")).open() as log:
        print(
            f"results: {results} (run {log.run}); time budget {options.budget_s:.0f} s", flush=True
        )
        return gpu_run.run(options, log, lambda line: print(line, flush=True))


if __name__ == "__main__":
    sys.exit(main())
