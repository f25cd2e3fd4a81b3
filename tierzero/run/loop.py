"""The training loop `tierzero train` drives: data in, steps, evaluation, metrics out.

It knows nothing of printing: the CLI passes `on_step` to draw progress. The trainer is either
the reference trainer (`offload none`) or the `Engine`; both offer `train_micro_batch`,
`eval_loss`, `stats` and `close`. Micro-batch losses stay on the device until the step's last
one has run: the loop reads them once per step (one host sync), not once per micro-batch.

One definition of the loss, for training and validation alike: the sum of every trained
token's loss over the global batch (all micro-batches, all ranks) divided by their number. The
loop draws a step's micro-batches first, counts their trained targets and sums the count over
the ranks, and passes it with each micro-batch (`step_tokens`, see `Engine.forward`); the mean
of the micro-batches' losses over them and the ranks is then that step's loss. Evaluation sums
each window's token losses and divides by the set's trained targets: `eval_loss`, and its
perplexity `eval_ppl` (runs before these keys logged `val_loss`). The engine reads each unit
once per evaluation (`Engine.evaluate`); the reference trainer runs window by window. With
`keep_best` every evaluation that beats the run's best checkpoints its step (if it is not
checkpointing then anyway) and names it in `best.json`, which pruning never removes.
Ctrl-C leaves it as `Interrupted`, which says how far the run got and what it can resume from.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tierzero.checkpoint.catalog import prune, read_best, record_best, step_dir
from tierzero.config import RunConfig
from tierzero.lr import lr_at
from tierzero.models.loss import trained_targets
from tierzero.run.data import TokenBatches
from tierzero.run.directory import RunDir


class Trainer(Protocol):
    def train_micro_batch(self, batch: Any, step_tokens: int | None = None) -> torch.Tensor: ...
    def eval_loss(self, batch: Any, summed: bool = False) -> float: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during training: `step` optimizer steps are finished, and `checkpoint_step` is the
    newest checkpoint the run directory holds (None: none yet), which --resume continues from."""

    def __init__(self, step: int, checkpoint_step: int | None) -> None:
        super().__init__(step, checkpoint_step)
        self.step = step
        self.checkpoint_step = checkpoint_step


@dataclass
class LoopResult:
    first_loss: float
    last_loss: float
    val_losses: list[tuple[int, float]]  # (step, eval loss) of every evaluation
    wall_s: float
    best: dict[str, Any] | None = None  # `keep_best`: the best checkpoint's record (`best.json`)


Total = Callable[[list[float]], list[float]]  # each value summed over the ranks


def evaluate(
    trainer: Trainer, batches: TokenBatches, eval_tokens: int, total: Total | None = None
) -> float:
    """The evaluation loss: every rank's trained tokens' losses summed, over their number (each
    window's sum added in window order, however the trainer runs them)."""
    val = batches.val_batches(eval_tokens)
    one_pass = getattr(trainer, "evaluate", None)  # the engine's: each unit read once for the set
    windows = (
        one_pass(val) if one_pass is not None else [trainer.eval_loss(b, summed=True) for b in val]
    )
    summed = sum(windows)
    count = sum(trained_targets(y) for _, y in val)
    summed, count = (summed, count) if total is None else total([summed, count])
    return summed / max(count, 1)


def eval_record(loss: float) -> dict[str, float]:
    """An evaluation's metrics: its loss and perplexity (exp of the loss; inf past a float's
    range)."""
    return {"eval_loss": loss, "eval_ppl": math.exp(loss) if loss < 700 else math.inf}


def train_loop(
    run: RunConfig,
    trainer: Trainer,
    batches: TokenBatches,
    rundir: RunDir,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    start_step: int = 0,
    checkpoint: Callable[[int], None] | None = None,
    mean: Callable[[list[float]], list[float]] | None = None,
    gather: Callable[[dict[str, Any]], list[dict[str, Any]]] | None = None,
    total: Total | None = None,
    samples: Callable[[int], None] | None = None,
) -> LoopResult:
    """Run optimizer steps `start_step + 1 .. run.steps` of `accumulate` micro-batches each,
    logging every step; `checkpoint(step)` runs every `run.checkpoints.checkpoint_every` steps and
    at the end, `samples(step)` after every step (it generates when due: `tierzero.run.samples`).
    With several ranks `mean` averages losses over them, `total` sums trained-token counts and
    `gather` collects every rank's own counters (collectives: every rank calls them at the same
    points), so the losses logged are those of the global batch, and each step's record keeps
    rank 0's counters at the top level and every rank's under "ranks" (their pools, bytes and
    waits differ)."""
    accumulate = run.engine.execution.accumulate
    tokens_per_step = run.batch_size * run.seq_len * accumulate
    start = time.perf_counter()
    val_losses = []
    first = last = float("nan")
    done, saved = start_step, (start_step or None)  # a resumed run starts from a checkpoint
    every = run.evaluation.eval_every if batches.has_validation else None
    # a resumed run's best so far
    best = read_best(rundir.path) if run.evaluation.keep_best and start_step else None

    def evaluated(step: int) -> dict[str, float]:
        loss, record = _evaluation(trainer, batches, run.evaluation.eval_tokens, total)
        val_losses.append((step, loss))
        return record

    try:
        if start_step == 0 and every:
            rundir.log({"step": 0, **evaluated(0)})
        # metrics of steps after the checkpoint were lost with the crash: they are redone
        elif start_step:
            rundir.log({"resumed_at": start_step})
        for step in range(start_step, run.steps):
            t0 = time.perf_counter()
            loss = _train_step(trainer, batches, accumulate, total, mean)
            dt = time.perf_counter() - t0
            first = loss if step == start_step else first
            last = loss
            stats = trainer.stats()
            record = {
                "step": step + 1,
                "loss": loss,
                "lr": lr_at(step, run.engine.optimizer),
                "tokens_per_s": tokens_per_step / dt,
                "step_s": dt,
                "wall_s": time.perf_counter() - start,
                **stats,
            }
            if gather is not None:
                record["ranks"] = gather(stats)
            if every and ((step + 1) % every == 0 or step + 1 == run.steps):
                record.update(evaluated(step + 1))
            rundir.log(record)
            if samples is not None:
                samples(step + 1)
            done = step + 1
            better = _improves(run, record, best)
            if checkpoint is not None and _checkpoint_due(run, step + 1, better):
                checkpoint(step + 1)
                saved = step + 1
                if better:
                    best = keep_best(
                        rundir, step + 1, record["eval_loss"], run.checkpoints.keep_checkpoints
                    )
            if on_step is not None:
                on_step(step + 1, record)
    except KeyboardInterrupt:
        raise Interrupted(done, saved) from None
    return LoopResult(first, last, val_losses, time.perf_counter() - start, best)


def _evaluation(
    trainer: Trainer, batches: TokenBatches, eval_tokens: int, total: Total | None
) -> tuple[float, dict[str, float]]:
    """One evaluation (`evaluate`) and its record: the loss and perplexity, its seconds, and the
    bytes it moved itself."""
    t0 = time.perf_counter()
    loss = evaluate(trainer, batches, eval_tokens, total)
    cost = {f"eval_{k}": v for k, v in trainer.stats().items() if k.startswith("bytes_")}
    return loss, {**eval_record(loss), "eval_s": time.perf_counter() - t0, **cost}


def _train_step(
    trainer: Trainer,
    batches: TokenBatches,
    accumulate: int,
    total: Total | None,
    mean: Callable[[list[float]], list[float]] | None,
) -> float:
    """One optimizer step of `accumulate` micro-batches and its loss (averaged over ranks by
    `mean`). The step's trained tokens (summed over ranks by `total`) are counted before its
    first backward, which divides by them."""
    micro = [batches.next_batch() for _ in range(accumulate)]
    tokens = sum(trained_targets(y) for _, y in micro)
    tokens = tokens if total is None else int(total([tokens])[0])
    micro_losses = [trainer.train_micro_batch(b, step_tokens=tokens) for b in micro]
    # host sync point, once per step
    loss = sum(t.item() for t in micro_losses) / accumulate
    return loss if mean is None else mean([loss])[0]


def _improves(run: RunConfig, record: dict[str, Any], best: dict[str, Any] | None) -> bool:
    """Whether `record` holds an evaluation loss below the best so far (with `--keep-best`)."""
    return bool(
        run.evaluation.keep_best
        and "eval_loss" in record
        and (best is None or record["eval_loss"] < best["eval_loss"])
    )


def _checkpoint_due(run: RunConfig, step: int, better: bool) -> bool:
    """Whether a checkpoint follows step `step` (counted from 1): every `checkpoint_every` steps
    (unset: only the last), the last step, and a new best evaluation loss."""
    every = run.checkpoints.checkpoint_every or run.steps
    return step % every == 0 or step == run.steps or better


def keep_best(rundir: RunDir, step: int, eval_loss: float, keep: int) -> dict[str, Any]:
    """Name checkpoint `step` (just written) the run's best and prune again: the best before it
    is an ordinary checkpoint from now on. Rank 0 writes; the record."""
    if not rundir.primary:
        return {"step": step, "eval_loss": eval_loss}
    record = record_best(rundir.path, step, eval_loss)
    prune(rundir.path, keep, step_dir(rundir.path, step))
    return record
