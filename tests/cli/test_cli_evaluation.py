"""`tierzero train`'s evaluation options through typer's runner: the validation set it uses
(--val-data, --val-fraction, or a split nobody asked for, dropped with a note on a small
corpus), --keep-best's checkpoint through pruning, the refusals (exit 2, one line), and
`tierzero report` reading and plotting `eval_loss` (and an older run's `val_loss`)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.axes
import pytest
from tierzero.cli.app import app

from tests.support.cli import one_line_error, runner, train
from tierzero.checkpoint.catalog import checkpoint_dirs, read_best
from tierzero.run.charts import eval_losses, summarize
from tierzero.run.data import default_corpus
from tierzero.run.directory import read_metrics


def text(path: Path, nbytes: int) -> Path:
    path.write_bytes(default_corpus(nbytes).tobytes())
    return path


def test_a_corpus_too_small_for_a_split_trains_without_one(tmp_path) -> None:
    small = text(tmp_path / "small.txt", 1000)  # 5% is 50 tokens: no window of 65
    run_dir = tmp_path / "run"
    result = train(
        "--data", str(small), "--seq-len", "64", "--steps", "2", "--run-dir", str(run_dir)
    )
    assert result.exit_code == 0, result.output
    assert "note: training without evaluation" in result.output and "--val-data" in result.output
    assert not [r for r in read_metrics(run_dir) if "eval_loss" in r]
    assert "eval loss" not in result.output


def test_val_data_is_evaluated_and_logged_with_perplexity(tmp_path) -> None:
    corpus, held_out = text(tmp_path / "a.txt", 20_000), tmp_path / "b.txt"
    held_out.write_bytes(default_corpus(40_000).tobytes()[20_000:])
    run_dir = tmp_path / "run"
    result = train(
        "--data",
        str(corpus),
        "--val-data",
        str(held_out),
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--eval-tokens",
        "256",
        "--run-dir",
        str(run_dir),
        "--json",
    )
    assert result.exit_code == 0, result.output
    evals = [r for r in read_metrics(run_dir) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert all(
        abs(r["eval_ppl"] - 2.718281828459045 ** r["eval_loss"]) < 1e-6 * r["eval_ppl"]
        for r in evals
    )
    assert evals[0]["eval_bytes_host->gpu"] > 0  # the evaluation's own reads, beside the step's
    summary = json.loads(result.stdout[result.stdout.index("{") :])
    assert summary["eval_loss_end"] == evals[-1]["eval_loss"] and summary["best_checkpoint"] is None


def test_keep_best_keeps_the_best_checkpoint_through_pruning(tmp_path, monkeypatch) -> None:
    """Evaluations scripted to be best at step 2: with one checkpoint kept, step 2's survives
    every later checkpoint's pruning, named in best.json and in the summary."""
    scripted = iter([5.0, 4.0, 3.0, 3.5, 3.6, 3.7, 3.8])
    monkeypatch.setattr("tierzero.run.loop.evaluate", lambda *args: next(scripted))
    run_dir = tmp_path / "run"
    result = train(
        "--steps",
        "6",
        "--eval-every",
        "1",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "1",
        "--keep-best",
        "--run-dir",
        str(run_dir),
    )
    assert result.exit_code == 0, result.output
    assert [step for step, _ in checkpoint_dirs(run_dir)] == [2, 6]
    best = read_best(run_dir)
    assert best is not None and best["step"] == 2 and best["eval_loss"] == 3.0
    assert best["checkpoint"] == "checkpoints/step-00000002"
    assert "best checkpoint: step 2 (eval loss 3.0000)" in result.output


def test_keep_best_checkpoints_each_better_evaluation(tmp_path, monkeypatch) -> None:
    """No --checkpoint-every: the run checkpoints where an evaluation improves (and at the end),
    and the previous best is pruned as an ordinary checkpoint once beaten."""
    scripted = iter([5.0, 4.0, 4.5, 3.0])
    monkeypatch.setattr("tierzero.run.loop.evaluate", lambda *args: next(scripted))
    run_dir = tmp_path / "run"
    result = train(
        "--steps",
        "3",
        "--eval-every",
        "1",
        "--keep-checkpoints",
        "1",
        "--keep-best",
        "--run-dir",
        str(run_dir),
    )
    assert result.exit_code == 0, result.output
    assert [step for step, _ in checkpoint_dirs(run_dir)] == [3]
    assert read_best(run_dir)["step"] == 3


@pytest.mark.parametrize(
    "args, says",
    [
        (["--val-fraction", "0.02"], "leaves 20 for validation, too short for seq_len 64"),
        (["--val-fraction", "1.5"], "--val-fraction must be a number in [0, 1)"),
        (["--val-data", "MISSING"], "does not exist"),
        (["--val-data", "SHORT"], "--val-data holds 10 tokens, too short for seq_len 64"),
        (
            ["--val-data", "SHORT", "--val-fraction", "0.1"],
            "--val-data and --val-fraction both name",
        ),
        (
            ["--keep-best", "--eval-every", "0", "--val-fraction", "0.2"],
            "--keep-best keeps the checkpoint",
        ),
        (
            ["--keep-best"],
            "but this run evaluates nothing",
        ),  # the split nobody asked for was dropped
        (
            ["--keep-best", "--val-fraction", "0.2", "--offload", "none"],
            "drop --checkpoint-every and --keep-best",
        ),
        (["--eval-every", "-1"], "--eval-every must be an integer >= 1"),
    ],
)
def test_bad_evaluation_inputs_are_one_sentence(tmp_path, args: list[str], says: str) -> None:
    small = text(tmp_path / "small.txt", 1000)
    (tmp_path / "short.txt").write_bytes(b"0123456789")
    args = [
        str(tmp_path / "missing.txt")
        if a == "MISSING"
        else str(tmp_path / "short.txt")
        if a == "SHORT"
        else a
        for a in args
    ]
    result = train(
        "--data",
        str(small),
        "--seq-len",
        "64",
        "--steps",
        "1",
        "--run-dir",
        str(tmp_path / "run"),
        *args,
    )
    assert says in one_line_error(result)


def test_report_plots_eval_loss_and_reads_older_runs_val_loss(tmp_path, monkeypatch) -> None:
    run_dir = tmp_path / "run"
    assert (
        train(
            "--steps",
            "2",
            "--eval-every",
            "1",
            "--eval-tokens",
            "128",
            "--offload",
            "none",
            "--run-dir",
            str(run_dir),
        ).exit_code
        == 0
    )
    plotted: list[str] = []
    plot = matplotlib.axes.Axes.plot

    def recording(self, *args, **kwargs):
        plotted.append(kwargs.get("label"))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording)
    result = runner.invoke(app, ["report", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    evals = eval_losses(read_metrics(run_dir))
    assert [s for s, _ in evals] == [0, 1, 2] and summary["eval_loss"] == evals[-1][1]
    assert "eval" in plotted and Path(summary["png"]).is_file()
    old = [
        {"step": 0, "val_loss": 5.0},
        {"step": 1, "loss": 4.0, "tokens_per_s": 1.0, "wall_s": 1.0, "val_loss": 3.0},
    ]
    assert eval_losses(old) == [(0, 5.0), (1, 3.0)]
    assert summarize(old)["eval_loss"] == 3.0 and summarize(old)["best_eval"] == {
        "step": 1,
        "eval_loss": 3.0,
    }


def test_plan_says_what_one_evaluation_reads() -> None:
    result = runner.invoke(
        app,
        [
            "plan",
            "--model",
            "125m",
            "--batch-size",
            "4",
            "--seq-len",
            "32",
            "--host-mem",
            "300MiB",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    ev, params = report["evaluation"], report["model"]["params"]
    # the nearest placement: params on NVMe
    assert report["verdict"]["placement"]["param"] == "nvme"
    # fp32 here; 125m ties its embedding
    assert ev["windows"] == 128 and ev["nvme_read_bytes"] >= params * 4
    # 128 windows in batches of 4
    assert ev["per_window_nvme_read_bytes"] == 32 * ev["nvme_read_bytes"]
    text = runner.invoke(
        app,
        ["plan", "--model", "125m", "--batch-size", "4", "--seq-len", "32", "--host-mem", "300MiB"],
    ).output
    assert "Evaluation: NVMe" in text and "every unit once" in text


def test_a_resumed_run_keeps_the_best_so_far(tmp_path, monkeypatch) -> None:
    """Best at step 1 (3.0); resumed from step 3, steps 4 and 5 evaluate 4.2 and 3.5: neither
    beats the best read back from best.json, so step 1's checkpoint stays beside the final one."""
    scripted = iter([5.0, 3.0, 4.0, 4.5, 4.2, 3.5])
    monkeypatch.setattr("tierzero.run.loop.evaluate", lambda *args: next(scripted))
    run_dir = tmp_path / "run"
    common = [
        "--eval-every",
        "1",
        "--keep-checkpoints",
        "1",
        "--keep-best",
        "--run-dir",
        str(run_dir),
    ]
    assert train("--steps", "3", *common).exit_code == 0
    assert [step for step, _ in checkpoint_dirs(run_dir)] == [1, 3]
    result = train("--steps", "5", "--resume", *common)
    assert result.exit_code == 0, result.output
    assert [step for step, _ in checkpoint_dirs(run_dir)] == [1, 5]
    assert read_best(run_dir)["step"] == 1 and "best checkpoint: step 1" in result.output
