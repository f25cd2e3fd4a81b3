"""A run's metrics as a picture: loss curves, throughput and tier traffic in one PNG.

Evaluations are logged as `eval_loss` (and `eval_ppl`); runs from before those keys logged
`val_loss`, which is read the same way.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from tierzero.errors import RunDirError
from tierzero.run.directory import read_metrics
from tierzero.run.overlap import BUSY, busy_links, overlap
from tierzero.storage.filekind import kind_of


def load_run(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir)
    if os.path.lexists(path) and not path.is_dir():
        raise RunDirError(
            f"'{path}' is {kind_of(path)}, not a directory; point at a run directory that "
            "`tierzero train` wrote"
        )
    if not os.path.lexists(path / "metrics.jsonl"):
        raise RunDirError(
            f"'{path}' has no metrics.jsonl; point at a run directory that `tierzero train` wrote"
        )
    records = read_metrics(path)
    if not any("loss" in r for r in records):
        raise RunDirError(f"'{path}/metrics.jsonl' has no training steps yet; train first")
    return records


def eval_losses(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, loss) of every evaluation the run logged, under either key it was logged as."""
    return [
        (r["step"], r.get("eval_loss", r.get("val_loss")))
        for r in records
        if "eval_loss" in r or "val_loss" in r
    ]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's figures; peaks are the busiest rank's where several ranks logged theirs."""
    steps = [r for r in records if "loss" in r]
    counters = [c for r in steps for c in r.get("ranks", [r])]
    vals = eval_losses(records)
    rates = sorted(r["tokens_per_s"] for r in steps)
    last_eval = vals[-1][1] if vals else None
    best = min(vals, key=lambda v: v[1]) if vals else None
    return {
        "steps": steps[-1]["step"],
        "first_loss": steps[0]["loss"],
        "last_loss": steps[-1]["loss"],
        "eval_loss": last_eval,
        "eval_ppl": None if last_eval is None else _perplexity(last_eval),
        "best_eval": None if best is None else {"step": best[0], "eval_loss": best[1]},
        "median_tokens_per_s": rates[len(rates) // 2],
        "wall_s": steps[-1]["wall_s"],
        "peak_bytes": {
            k[5:-6]: max(c.get(k, 0) for c in counters) for k in steps[-1] if k.startswith("peak_")
        },
    }


def plot(records: list[dict[str, Any]], out: str | Path) -> Path:
    """Write the run's report PNG: loss (train, eval), tokens/s, bytes per step per link, and
    each link's busy time per step beside the step's time."""
    out = Path(out)
    if not os.access(out.parent, os.W_OK | os.X_OK):  # refused before any drawing
        raise RunDirError(
            f"cannot write the report {out}: {out.parent} is read-only; pass --out a writable path"
        )
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    steps = [r for r in records if "loss" in r]
    xs = [r["step"] for r in steps]
    fig, (ax_loss, ax_rate, ax_io, ax_busy) = plt.subplots(1, 4, figsize=(20, 4.2))
    ax_loss.plot(xs, [r["loss"] for r in steps], label="train", lw=1)
    vals = eval_losses(records)
    if vals:
        ax_loss.plot(*zip(*vals), "o-", label="eval")
        import numpy as np

        # the same curve read as perplexity (exp of the loss), clipped where exp overflows
        ppl = ax_loss.secondary_yaxis(
            "right",
            functions=(
                lambda x: np.exp(np.minimum(x, 700)),
                lambda y: np.log(np.maximum(y, 1e-300)),
            ),
        )
        ppl.set_ylabel("perplexity")
    ax_loss.set(title="loss", xlabel="step", ylabel="nats / token")
    ax_loss.legend()
    ax_rate.plot(xs, [r["tokens_per_s"] for r in steps], lw=1)
    ax_rate.set(title="throughput", xlabel="step", ylabel="tokens / s")
    links = sorted({k for r in steps for k in r if k.startswith("bytes_")})
    for link in links:
        ax_io.plot(xs, [r.get(link, 0) / 1e6 for r in steps], label=link[6:], lw=1)
    ax_io.set(title="tier traffic per step", xlabel="step", ylabel="MB")
    if links:
        ax_io.legend(fontsize="small")
    else:
        ax_io.text(
            0.5, 0.5, "in-memory run: no tier traffic", ha="center", transform=ax_io.transAxes
        )
    _plot_busy(ax_busy, steps)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise RunDirError(
            f"cannot write the report {out} ({e.strerror}); pass --out a writable path"
        ) from None
    finally:
        plt.close(fig)
    return out


def _plot_busy(ax: Any, steps: list[dict[str, Any]]) -> None:
    """Side-by-side bars of each link's busy time per step, the step's time as a line above."""
    timed = [r for r in steps if any(k.startswith(BUSY) for k in r)]
    ax.set(title="link busy time per step", xlabel="step", ylabel="s")
    if not timed:
        note = overlap(steps)["note"].replace(" (", "\n(").replace(": ", ":\n")
        ax.text(0.5, 0.5, note, ha="center", transform=ax.transAxes, fontsize="small")
        return
    xs = [r["step"] for r in timed]
    links = busy_links(timed)
    width = 0.8 / len(links)
    for i, link in enumerate(links):
        offset = (i - (len(links) - 1) / 2) * width
        busy = [r.get(BUSY + link, 0.0) for r in timed]
        ax.bar([x + offset for x in xs], busy, width, label=link)
    ax.plot(xs, [r.get("step_s", math.nan) for r in timed], "k.-", lw=1, label="step")
    ax.legend(fontsize="small")


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
