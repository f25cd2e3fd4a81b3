"""`--optimizer-state` and `--master` through typer's runner: `plan` prints the compact rows and
counts the choice, `train` says what it chose and keeps it in config.toml (which reads back),
and a resume in another format is one sentence naming the flag that matches."""

from __future__ import annotations

import json

from tierzero.cli.app import app
from typer.testing import CliRunner

from tests.support.cli import one_line_error, train
from tierzero.config import STATE_BLOCK, DType, StateFormat
from tierzero.configfile import load_run_config, to_toml

runner = CliRunner()
MACHINE = [
    "--model",
    "125m",
    "--gpu-mem",
    "1GB",
    "--host-mem",
    "16GB",
    "--nvme-free",
    "1TB",
    "--dtype",
    "bf16",
    "--batch-size",
    "1",
    "--seq-len",
    "64",
]


def test_plan_prints_the_compact_rows_and_counts_the_chosen_one() -> None:
    result = runner.invoke(app, ["plan", *MACHINE, "--optimizer-state", "int8", "--master", "bf16"])
    assert result.exit_code == 0, result.output
    rows = [
        line.split()
        for line in result.output.splitlines()
        if line.strip().startswith(("fp32 ", "bf16 ", "int8 "))
    ]
    assert [row[:2] for row in rows] == [
        ["fp32", "fp32"],
        ["bf16", "fp32"],
        ["int8", "fp32"],
        ["fp32", "bf16"],
        ["bf16", "bf16"],
        ["int8", "bf16"],
    ]
    scales = 8 / STATE_BLOCK  # both int8 moments' fp32 absmax, per parameter
    assert (
        rows[-1][2:] == ["2.00", "2.00", f"{2 + scales:.2f}", f"{6 + scales:.2f}", "<"]
        and rows[0][-1] == "16.00"
    )
    text = " ".join(result.output.split())  # free text wraps at the console's width
    assert (
        "State: int8 Adam moments (blocks of 256, an fp32 scale each), "
        "bf16 master (the param itself)" in text
    )
    fp32 = json.loads(runner.invoke(app, ["plan", *MACHINE, "--json"]).stdout)
    compact = json.loads(
        runner.invoke(
            app, ["plan", *MACHINE, "--optimizer-state", "int8", "--master", "bf16", "--json"]
        ).stdout
    )
    assert (
        compact["ledger"][-1]["bytes_per_param"] == 6 + 8 / STATE_BLOCK
        and fp32["ledger"][-1]["bytes_per_param"] == 16
    )
    # the same placement (optimizer states on the host) holds 8 bytes per parameter there, not 16
    assert compact["verdict"]["placement"] == fp32["verdict"]["placement"]
    assert (
        compact["verdict"]["resident_bytes"]["host"]
        < 0.6 * fp32["verdict"]["resident_bytes"]["host"]
    )


def test_plan_refuses_an_unknown_format_naming_its_flag() -> None:
    line = one_line_error(runner.invoke(app, ["plan", *MACHINE, "--optimizer-state", "int4"]))
    assert "--optimizer-state 'int4' is not valid; choose one of fp32|bf16|int8" in line
    assert "--master 'fp16'" in one_line_error(
        runner.invoke(app, ["plan", *MACHINE, "--master", "fp16"])
    )


def test_config_toml_carries_the_formats_and_reads_them_back(tmp_path) -> None:
    # resolved, as a run writes it
    run = load_run_config(None, {"optimizer_state": "int8", "master": "bf16"})
    text = to_toml(run)
    assert 'optimizer_state = "int8"' in text and 'master = "bf16"' in text
    (tmp_path / "c.toml").write_text(text)
    back = load_run_config(tmp_path / "c.toml")
    formats = back.engine.formats
    assert (formats.optimizer_state, formats.master) == (StateFormat.INT8, DType.BF16)
    assert to_toml(back) == text
    line = one_line_error(train("--optimizer-state", "int4", "--run-dir", str(tmp_path / "r")))
    assert "--optimizer-state 'int4' is not valid; choose one of fp32|bf16|int8" in line


def test_a_compact_run_says_its_formats_and_a_resume_in_another_is_refused(tmp_path) -> None:
    run_dir = tmp_path / "run"
    result = train(
        "--steps", "1", "--optimizer-state", "int8", "--master", "bf16", "--run-dir", str(run_dir)
    )
    assert result.exit_code == 0, result.output
    assert (
        "optimizer state: int8 Adam moments (blocks of 256, an fp32 scale each), bf16 master"
        in result.output
    )
    saved = (run_dir / "config.toml").read_text()
    assert 'optimizer_state = "int8"' in saved and 'master = "bf16"' in saved
    line = one_line_error(
        train("--resume", "--run-dir", str(run_dir), "--steps", "2", "--optimizer-state", "fp32")
    )
    assert (
        "--optimizer-state fp32 differs from the int8 this run's checkpoints hold its "
        "Adam moments in" in line
    )
    assert "resume with --optimizer-state int8" in line
    line = one_line_error(
        train("--resume", "--run-dir", str(run_dir), "--steps", "2", "--master", "fp32")
    )
    assert "resume with --master bf16" in line
