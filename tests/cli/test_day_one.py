"""A fine-tuner's first day, end to end through the CLI: the LoRA chat recipe on a tiny Hugging
Face Llama with a word-level tokenizer and a chat template, reporting to TensorBoard and MLflow,
evaluating on a held-out tenth and sampling as it trains; then each record read back the way
the user would see it (TensorBoard's EventAccumulator, MlflowClient, `tierzero report`'s
chart, samples.jsonl).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.axes
import pytest
from tierzero.cli.app import app

from tests.support.cli import runner
from tests.support.hf import sample_text, save_chat_llama
from tierzero.run.charts import eval_losses
from tierzero.run.directory import read_metrics, read_samples

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "lora-7b-chat.toml"
# the template's markers, [user] ... [end] [assistant] ..., are words of the tokenizer
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} [end] {% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
QUESTIONS = ["what is two and three", "why is the sky blue", "which import comes first"]
ANSWERS = ["five", "because light scatters", "the import of os"]
WORDS = "[ ] user assistant end " + " ".join(QUESTIONS + ANSWERS)
STEPS, EVERY = 10, 5


@pytest.fixture
def chat_llama(tmp_path: Path) -> Path:
    """A tiny random Llama with a word-level tokenizer that knows the chat words and markers."""
    return save_chat_llama(
        tmp_path / "llama", sample_text(8_000) + f" {WORDS}" * 50, TEMPLATE, "end"
    )


def chats(path: Path, n: int) -> Path:
    """`n` chat records of one user turn and one assistant reply, as --data takes them."""
    with path.open("w") as f:
        for i in range(n):
            q, a = QUESTIONS[i % 3], ANSWERS[i % 3]
            messages = [
                {"role": "user", "content": q},
                {"role": "assistant", "content": a},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def test_a_lora_chat_fine_tune_reports_evaluates_and_samples(
    tmp_path: Path, chat_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    for key in (
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_EXPERIMENT_ID",
    ):
        monkeypatch.delenv(key, raising=False)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("what is two and three\nwhy is the sky blue\n")
    run_dir = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "train",
            "--config",
            str(RECIPE),
            "--model",
            f"hf:{chat_llama}",
            "--data",
            str(chats(tmp_path / "chats.jsonl", 120)),
            # the recipe's own keys, but for its size: 2048 positions are past the tiny model's
            # 128 and leave no held-out window in a small chat file (evaluation would be
            # skipped), and its 4 x 4 batches only cost time. offload "auto" puts this tiny
            # model's every state on the device; nvme makes the steps go through the tiers.
            *["--steps", str(STEPS), "--seq-len", "32", "--batch-size", "2"],
            *["--accumulate", "1", "--offload", "nvme"],
            *["--report-to", "tensorboard,mlflow", "--val-fraction", "0.1"],
            *["--eval-every", str(EVERY), "--sample-every", str(EVERY)],
            *["--sample-prompts", str(prompts), "--sample-max-new-tokens", "6"],
            *["--run-dir", str(run_dir)],
        ],
    )
    assert result.exit_code == 0, result.output
    assert "LoRA r=16 alpha=32" in result.output  # the recipe's adapters on the base
    records = read_metrics(run_dir)
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    evals = dict(eval_losses(records))
    assert sorted(losses) == list(range(1, STEPS + 1)) and sorted(evals) == [0, 5, 10]
    assert_tensorboard_curves(run_dir, losses, evals)
    assert_mlflow_curves(run_dir, losses, evals)
    assert_report_plots_evaluations(run_dir, evals, monkeypatch)
    assert_samples_framed_as_chats(run_dir, chat_llama, prompts)


def assert_tensorboard_curves(
    run_dir: Path, losses: dict[int, float], evals: dict[int, float]
) -> None:
    """TensorBoard: the loss of every step, the eval loss of every evaluation."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tb = {tag: {p.step: p.value for p in events.Scalars(tag)} for tag in ("loss", "eval_loss")}
    assert tb == {"loss": pytest.approx(losses), "eval_loss": pytest.approx(evals)}


def assert_mlflow_curves(run_dir: Path, losses: dict[int, float], evals: dict[int, float]) -> None:
    """MLflow: the same curves in the run's own store."""
    from mlflow.tracking import MlflowClient

    saved = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    assert client.get_run(saved["run_id"]).info.status == "FINISHED"
    ml = {
        key: {m.step: m.value for m in client.get_metric_history(saved["run_id"], key)}
        for key in ("loss", "eval_loss")
    }
    assert ml == {"loss": pytest.approx(losses), "eval_loss": pytest.approx(evals)}


def assert_report_plots_evaluations(
    run_dir: Path, evals: dict[int, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tierzero report`: a PNG whose loss panel plots the evaluations."""
    plotted: list[tuple[Any, ...]] = []
    plot = matplotlib.axes.Axes.plot

    def recording(self: matplotlib.axes.Axes, *args: Any, **kwargs: Any) -> Any:
        plotted.append((kwargs.get("label"), *args))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording)
    report = runner.invoke(app, ["report", str(run_dir), "--json"])
    assert report.exit_code == 0, report.output
    png = Path(json.loads(report.stdout)["png"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    [(_, steps, values, _)] = [p for p in plotted if p[0] == "eval"]
    assert dict(zip(steps, values)) == pytest.approx(evals)


def assert_samples_framed_as_chats(run_dir: Path, chat_llama: Path, prompts: Path) -> None:
    """samples.jsonl: each prompt at steps 5 and 10, framed as a user's turn by the chat
    template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_llama)
    samples = read_samples(run_dir)
    assert [row["step"] for row in samples] == [5, 5, 10, 10]
    for row, text in zip(samples, prompts.read_text().splitlines() * 2):
        chat = [{"role": "user", "content": text}]
        framed = tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        assert row["prompt"] == text and row["prompt_ids"] == list(framed["input_ids"])
        shown = tokenizer.decode(row["prompt_ids"])
        assert shown.startswith("[ user ]") and shown.endswith("[ end ] [ assistant ]")
        assert row["completion_ids"] and row["completion"].strip()
