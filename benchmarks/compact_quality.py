"""Does compact optimizer state train as well as fp32? Loss curves side by side, in one PNG.

Trains a built-in preset (default `tiny`) on the built-in corpus for `--steps` steps, once per
state format -- fp32 moments and master (torch's AdamW), bf16 moments and master, int8 moments
with a bf16 master -- from the same initial weights and batches, and prints each run's mean
training loss over the last 50 steps and its ratio to fp32's (the aim: within 1%). The curves
(and their 20-step running means) go to `--out`.

    nice python benchmarks/compact_quality.py                    # tiny, 300 steps
    # a full fine-tune of a Hugging Face decoder
    nice python benchmarks/compact_quality.py --model hf:DIR
    # 134M, ~40 min a format here
    nice python benchmarks/compact_quality.py --preset 125m --dtype bf16 --lr 6e-4

`--baseline CURVES.json` (repeatable) takes the curves of earlier runs of this script with the
same settings (the JSON it writes beside its PNG) instead of training those formats again:
fp32's run is deterministic (torch's AdamW, the same weights and batches), so a new compact
run is compared with it without paying for it twice, and formats trained apart (`--formats
fp32`, then `--formats int8`, each alone on the cores) are tabled and plotted together by
`--formats "" --baseline A.json --baseline B.json`. Without fp32 the table has no ratios.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from tierzero import Config, models
from tierzero.engine import Engine
from tierzero.hf import load_model
from tierzero.models.presets import get_preset
from tierzero.run.data import TokenBatches, default_corpus

FORMATS = {
    "fp32": ("fp32", "fp32"),
    "bf16": ("bf16", "bf16"),
    "int8 + bf16 master": ("int8", "bf16"),
}
TAIL = 50  # steps the losses are compared over


def train(
    preset: str, moments: str, master: str, opts: argparse.Namespace, path: str
) -> list[float]:
    cfg = Config(
        offload=opts.offload,
        nvme_path=[path],
        lr=opts.lr,
        total_steps=opts.steps,
        warmup_steps=opts.steps // 20,
        optimizer_state=moments,
        master=master,
        seed=0,
        dtype=opts.dtype,
    )
    data = TokenBatches(default_corpus(), opts.batch_size, opts.seq_len, seed=0)
    if (
        opts.model is not None
    ):  # every weight of the directory's model trained, from its own weights
        hf = load_model(opts.model)
        model, weights = hf.model, hf.weights
    else:
        model, weights = models.build(get_preset(preset), device="meta", seed=0), None
    with Engine(model, cfg, weights=weights) as engine:
        return [engine.train_step(data.next_batch()) for _ in range(opts.steps)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument(
        "--model",
        default=None,
        help="hf:DIR, a Hugging Face decoder (vocabulary >= 256: the corpus is bytes)",
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=("fp32", "bf16"),
        help="compute dtype of every run (bf16: a bf16 master is the param itself)",
    )
    p.add_argument(
        "--out",
        default="compact_quality.png",
        help="the curves' plot (.png, .svg or .pdf); their losses go beside it as .json",
    )
    p.add_argument(
        "--offload", default="none", help="where the state lives (none: memory; nvme: --nvme-path)"
    )
    p.add_argument(
        "--nvme-path", default=None, help="where the runs' stores go (default: a temp dir)"
    )
    p.add_argument(
        "--formats",
        default=",".join(FORMATS),
        help="comma-separated runs, fp32 among them or in --baseline "
        f"(default: all of {', '.join(FORMATS)})",
    )
    p.add_argument(
        "--baseline",
        action="append",
        default=[],
        help="curves JSON of an earlier run with the "
        "same settings, whose formats are not trained again (repeatable)",
    )
    opts = p.parse_args()
    if Path(opts.out).suffix.lower() not in (".png", ".svg", ".pdf"):
        p.error(f"--out {opts.out!r} is the plot: name a .png, .svg or .pdf file")
    chosen = [name.strip() for name in opts.formats.split(",") if name.strip()]
    if not set(chosen) <= set(FORMATS):
        p.error(f"--formats {opts.formats!r}: name any of {', '.join(FORMATS)}")
    losses: dict[str, list[float]] = {}
    for path in opts.baseline:
        losses.update(json.loads(Path(path).read_text()))
    if any(len(curve) != opts.steps for curve in losses.values()):
        p.error(
            f"--baseline {' '.join(opts.baseline)}: its curves are not {opts.steps} steps long; "
            "give the same --steps"
        )
    if not chosen and not losses:
        p.error("nothing to train or show: name --formats or give --baseline")
    for name in chosen:
        moments, master = FORMATS[name]
        with tempfile.TemporaryDirectory(dir=opts.nvme_path) as path:
            losses[name] = train(opts.preset, moments, master, opts, path)
        print(f"{name}: last-{TAIL} mean loss {np.mean(losses[name][-TAIL:]):.4f}", flush=True)
    base = np.mean(losses["fp32"][-TAIL:]) if "fp32" in losses else None
    trained = opts.model or opts.preset
    print(
        f"{trained}, {opts.steps} steps, batch {opts.batch_size} x {opts.seq_len}, lr {opts.lr}, "
        f"{opts.dtype} compute"
    )
    print(f"{'state':<20} {'last-50 mean':>12} {'vs fp32':>8}")
    for name, curve in losses.items():
        mean = np.mean(curve[-TAIL:])
        print(f"{name:<20} {mean:>12.4f} {'' if base is None else f'{mean / base:.4f}':>8}")
    plot(losses, opts)


def plot(losses: dict[str, list[float]], opts: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, curve in losses.items():
        (line,) = ax.plot(curve, alpha=0.3, linewidth=0.8)
        window = min(20, len(curve))
        smooth = np.convolve(curve, np.ones(window) / window, mode="valid")
        ax.plot(np.arange(window - 1, len(curve)), smooth, color=line.get_color(), label=name)
    ax.set(
        xlabel="step",
        ylabel="training loss",
        title=f"{opts.model or opts.preset} ({opts.dtype} compute): optimizer state formats",
    )
    ax.legend()
    fig.savefig(opts.out, dpi=120, bbox_inches="tight")
    curves = str(Path(opts.out).with_suffix(".json"))
    Path(curves).write_text(json.dumps(losses))
    print(f"wrote {opts.out} and the curves to {curves}")


if __name__ == "__main__":
    main()
