"""`tierzero report`'s overlap table from hand-written metrics: medians over steps, the bound
(the slowest link), step / bound, serial / bound and step / floor (against max(bound, compute)),
in --json and for people; a run from before the busy-time metrics, and an in-memory one, say
so instead."""

from __future__ import annotations

import json

from tierzero.cli.app import app
from typer.testing import CliRunner

from tierzero.run.overlap import IN_MEMORY, PREDATES

runner = CliRunner()


def step(n: int, step_s: float, busy: dict[str, float], nbytes: dict[str, int]) -> dict:
    record = {
        "step": n,
        "loss": 5.0 - n,
        "lr": 1e-3,
        "tokens_per_s": 100.0,
        "step_s": step_s,
        "wall_s": float(n),
        "io_wait_s": 1.0,
    }
    record.update({f"busy_s/{k}": v for k, v in busy.items()})
    record.update({f"bytes_{k}": v for k, v in nbytes.items()})
    return record


def write_run(tmp_path, records: list[dict]):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


NBYTES = {"nvme->host": 4_000_000_000, "host->nvme": 1_000_000_000}
RUN = [
    step(1, 9.0, {"nvme->host": 4.0, "host->nvme": 1.0, "optimizer": 3.0}, NBYTES),
    step(2, 5.0, {"nvme->host": 2.0, "host->nvme": 1.0, "optimizer": 3.0}, NBYTES),
    step(3, 6.0, {"nvme->host": 4.0, "host->nvme": 2.0, "optimizer": 1.0}, NBYTES),
]


def test_json_holds_the_medians_bound_and_ratios(tmp_path) -> None:
    result = runner.invoke(app, ["report", str(write_run(tmp_path, RUN)), "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)["overlap"]
    assert figures["measured"] and figures["steps"] == 3
    assert figures["links"]["nvme->host"] == {
        "busy_s": 4.0,
        "bytes_per_s": 1e9,
    }  # 4 GB / 4 s
    assert figures["links"]["host->nvme"] == {
        "busy_s": 1.0,
        "bytes_per_s": 1e9,
    }  # 1 / 1, .5, 1
    assert figures["links"]["optimizer"] == {"busy_s": 3.0, "bytes_per_s": None}
    # per step: bounds 4, 3, 4; serial 8, 6, 7; step / bound 2.25, 5/3, 1.5;
    # serial / bound 2, 2, 1.75
    assert figures["step_s"] == 6.0 and figures["bound_s"] == 4.0
    assert figures["bound_link"] == "nvme->host"
    assert abs(figures["step_over_bound"] - 5 / 3) < 1e-12 and figures["serial_over_bound"] == 2.0
    # compute (step - io wait) 8, 4, 5; floors 8, 4, 5: step / floor 9/8, 5/4, 6/5
    assert figures["compute_s"] == 5.0 and figures["step_over_floor"] == 1.2


def test_the_table_for_people(tmp_path) -> None:
    result = runner.invoke(app, ["report", str(write_run(tmp_path, RUN))])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any("overlap (median over 3 steps)" in line for line in lines)
    row = next(line for line in lines if "nvme->host" in line and "bound" not in line)
    assert ["4.0000", "66.7%", "1.000"] == [c.strip() for c in row.split("│")[2:5]]
    assert any("bound (nvme->host)" in line and "4.0000" in line for line in lines)
    assert any("step / bound" in line and "1.67" in line for line in lines)
    assert any("serial / bound" in line and "2.00" in line for line in lines)
    assert any("compute (step - io wait)" in line and "5.0000" in line for line in lines)
    assert any("step / floor" in line and "1.20" in line for line in lines)


def test_a_run_from_before_the_measurement_still_reports(tmp_path) -> None:
    old = [step(n, 1.0, {}, NBYTES) for n in (1, 2)]
    run_dir = write_run(tmp_path, old)
    result = runner.invoke(app, ["report", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["overlap"] == {"measured": False, "note": PREDATES}
    human = runner.invoke(app, ["report", str(run_dir)], terminal_width=300)
    assert human.exit_code == 0 and f"overlap: {PREDATES}" in human.output
    assert (run_dir / "report.png").stat().st_size > 10_000


def test_an_in_memory_run_has_no_links_to_overlap(tmp_path) -> None:
    result = runner.invoke(
        app, ["report", str(write_run(tmp_path, [step(1, 1.0, {}, {})])), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["overlap"] == {
        "measured": False,
        "note": IN_MEMORY,
    }
