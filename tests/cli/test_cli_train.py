"""`tierzero train` through typer's runner: exit codes, one-line errors, metrics, JSON."""

from __future__ import annotations

import fcntl
import json
import os

import pytest
from tierzero.cli.app import app
from typer.testing import CliRunner

from tierzero.run.directory import read_metrics

runner = CliRunner()
QUICK = ["--steps", "6", "--batch-size", "2", "--seq-len", "32"]


def train(*args: str):
    return runner.invoke(app, ["train", *args])


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_train_writes_config_and_metrics(tmp_path, offload: str) -> None:
    run_dir = tmp_path / "run"
    result = train(*QUICK, "--offload", offload, "--run-dir", str(run_dir), "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{") :])
    assert summary["steps"] == 6 and summary["last_loss"] < summary["first_loss"]
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 for r in records)
    assert (run_dir / "config.toml").read_text().count(f'offload = "{offload}"') == 1
    if offload == "nvme":
        assert records[-1]["bytes_nvme->host"] > 0 and "peak_host_bytes" in records[-1]
        assert (run_dir / "nvme").is_dir()


def test_config_file_and_flags_override_it(tmp_path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('steps = 3\nbatch_size = 2\nseq_len = 16\noffload = "none"\nlr = 0.01\n')
    run_dir = tmp_path / "run"
    result = train("--config", str(cfg), "--steps", "2", "--run-dir", str(run_dir))
    assert result.exit_code == 0, result.output
    written = (run_dir / "config.toml").read_text()
    assert "steps = 2" in written and "lr = 0.01" in written


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_unknown_preset(tmp_path) -> None:
    assert "unknown model preset 'huge'" in one_line_error(
        train("--model", "huge", "--run-dir", str(tmp_path))
    )


def test_missing_data_file(tmp_path) -> None:
    assert "does not exist" in one_line_error(
        train("--data", str(tmp_path / "nope.bin"), "--run-dir", str(tmp_path))
    )


def test_malformed_toml(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3\n")
    assert "is not valid TOML" in one_line_error(train("--config", str(bad)))


def test_unknown_toml_key(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("stepz = 3\n")
    assert "unknown config keys ['stepz']" in one_line_error(train("--config", str(bad)))


def test_negative_batch() -> None:
    assert "--batch-size must be an integer >= 1" in one_line_error(train("--batch-size", "-4"))


def test_bad_dtype_and_offload() -> None:
    assert "dtype 'fp8' is not valid" in one_line_error(train("--dtype", "fp8"))
    assert "offload 'disk' is not valid" in one_line_error(train("--offload", "disk"))


def test_locked_run_dir(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fd = os.open(run_dir / "lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, b"4242\n")
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        message = one_line_error(train(*QUICK, "--run-dir", str(run_dir)))
    finally:
        os.close(fd)
    assert "in use by another trainer (pid 4242)" in message
    assert not (run_dir / "config.toml").exists()


def test_report_plots_a_run(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert train(*QUICK, "--run-dir", str(run_dir)).exit_code == 0
    result = runner.invoke(app, ["report", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{") :])
    assert summary["steps"] == 6 and summary["last_loss"] < summary["first_loss"]
    png = run_dir / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "peak gpu" in runner.invoke(app, ["report", str(run_dir)]).output


def test_report_on_a_directory_without_metrics(tmp_path) -> None:
    assert "has no metrics.jsonl" in one_line_error(runner.invoke(app, ["report", str(tmp_path)]))


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_train_starts_from_local_safetensors(tmp_path, offload: str) -> None:
    from safetensors.torch import save_file

    from tierzero import models

    source = models.build("tiny", seed=3)
    save_file(
        {k: v.contiguous() for k, v in source.state_dict().items() if k != "head.weight"},
        str(tmp_path / "w.safetensors"),
    )
    ok = train(
        *QUICK,
        "--offload",
        offload,
        "--weights",
        str(tmp_path / "w.safetensors"),
        "--run-dir",
        str(tmp_path / "run"),
        "--json",
    )
    assert ok.exit_code == 0, ok.output
    missing = train(
        *QUICK, "--weights", str(tmp_path / "nope.safetensors"), "--run-dir", str(tmp_path / "r2")
    )
    assert "is not a .safetensors file" in one_line_error(missing)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--nproc", "2", "--batch-size", "3"],
            "--batch-size 3 (the global batch) does not split evenly over 2 ranks",
        ),
        (
            ["--nproc", "2", "--offload", "none"],
            "--offload none trains in memory on one rank, not 2",
        ),
        (["--nproc", "0"], "--nproc must be at least 1"),
        (["--comm-timeout", "0"], "--comm-timeout must be a finite positive number"),
    ],
)
def test_ranks_refused_before_any_starts(tmp_path, args: list[str], message: str) -> None:
    assert message in one_line_error(train(*args, "--run-dir", str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


def test_ranks_from_torchrun_need_one_run_dir(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert one_line_error(train("--steps", "1")) == (
        "error: rank 1: ranks started by torchrun must name one run directory; pass --run-dir DIR"
    )
