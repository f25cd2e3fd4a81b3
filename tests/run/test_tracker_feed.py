"""What `--report-to` hands the trackers, and when: a record's numbers flattened into metrics,
the config flattened into one level, the tracker names parsed; and, with a recording fake in
place of each library, every row a tracker is sent, the identity it resumes with, and its close
however the run ends. What each library stores is read back in test_trackers.py."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tierzero.config import Config, Placement, RunConfig
from tierzero.run.trackers import IDENTITY_NAME, flat_config, flat_metrics, resolve_report_to
from tierzero.run.trackers_libraries import mlflow_key

# -- what is sent ---------------------------------------------------------------------------


def test_metrics_are_every_number_in_a_record_flattened_with_slashes() -> None:
    record = {
        "step": 7,
        "time": 1.5e9,
        "loss": 2.5,
        "bytes_nvme->host": 4096,
        "note": "text",
        "overflow": True,
        "ranks": [
            {"peak_host_bytes": 10, "io": {"wait_s": 0.5}},
            {"peak_host_bytes": 12},
        ],
    }
    assert flat_metrics(record) == {
        "loss": 2.5,
        "bytes_nvme->host": 4096.0,
        "overflow": 1.0,
        "ranks/0/peak_host_bytes": 10.0,
        "ranks/0/io/wait_s": 0.5,
        "ranks/1/peak_host_bytes": 12.0,
    }
    assert (
        mlflow_key("bytes_nvme->host") == "bytes_nvme_to_host"
        and mlflow_key("ranks/0/io wait") == "ranks/0/io wait"
    )


def test_the_config_is_flat_with_engine_keys_beside_run_keys() -> None:
    run = RunConfig(steps=5, report_to=["tensorboard"], engine=Config(placement=Placement()))
    flat = flat_config(run)
    assert (
        flat["steps"] == 5
        and flat["offload"] == "nvme"
        and flat["lr"] == 1e-3
        and flat["betas"] == [0.9, 0.95]
    )
    assert (
        flat["placement/grad"] == "gpu"
        and flat["report_to"] == ["tensorboard"]
        and "engine" not in flat
    )


def test_report_to_takes_a_comma_list_or_a_toml_list() -> None:
    assert (
        resolve_report_to(None) == []
        and resolve_report_to("none") == []
        and resolve_report_to([]) == []
    )
    assert resolve_report_to(" TensorBoard, mlflow,tensorboard ") == [
        "tensorboard",
        "mlflow",
    ]
    assert resolve_report_to(["wandb", "trackio"]) == ["wandb", "trackio"]


# -- how the trackers open and close ----------------------------------------------------------


class Recording:
    """A tracker that records what it is sent; `fail_open` makes opening raise."""

    events: ClassVar[list[tuple]] = []
    fail_open = False

    def __init__(self, start: Any) -> None:
        self.identity = {"id": start.run_name}
        self.where = "a recording"

    @classmethod
    def open(cls, start: Any) -> Recording:
        if cls.fail_open:
            raise RuntimeError("no such server\nsecond line")
        cls.events.append(("open", start.run_name, start.start_step, start.resume, start.saved))
        return cls(start)

    def log(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        self.events.append(("log", step, metrics))

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.events.append(("samples", step, rows))

    def close(self, end: str) -> None:
        self.events.append(("close", end))


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> type[Recording]:
    from tierzero.run import trackers

    monkeypatch.setattr(Recording, "events", [])
    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", Recording)
    monkeypatch.setitem(trackers.TRACKERS, "trackio", Recording)
    return Recording


@pytest.mark.parametrize(
    "body, end", [(None, "finished"), (RuntimeError, "failed"), (KeyboardInterrupt, "killed")]
)
def test_trackers_see_each_row_and_close_however_the_run_ends(
    tmp_path: Path, recording: type[Recording], body: type[BaseException] | None, end: str
) -> None:
    from tierzero.run.directory import RunDir
    from tierzero.run.trackers import reporting

    run = RunConfig(report_to=["tensorboard"])
    with RunDir(tmp_path / "run") as rundir:
        rundir.open_metrics(0)
        raises = pytest.raises(body) if body else contextlib.nullcontext()
        with raises, reporting(run, rundir, 0, resume=False) as where:
            assert where == ["a recording"]
            rundir.log({"resumed_at": 2})  # not a point on a curve
            rundir.log({"step": 1, "loss": 2.0, "ranks": [{"io_wait_s": 0.5}]})
            rundir.log_samples(1, [{"step": 1, "prompt": "a", "completion": "b"}])
            if body:
                raise body()
        rundir.log({"step": 2, "loss": 1.0})  # after the run: nobody listens
        rundir.log_samples(2, [{"step": 2, "prompt": "a", "completion": "c"}])
    assert recording.events == [
        ("open", "run", 0, False, {}),
        ("log", 1, {"loss": 2.0, "ranks/0/io_wait_s": 0.5}),
        ("samples", 1, [{"step": 1, "prompt": "a", "completion": "b"}]),
        ("close", end),
    ]
    assert json.loads((tmp_path / "run" / IDENTITY_NAME).read_text()) == {
        "tensorboard": {"id": "run"}
    }


def test_a_resume_hands_each_tracker_its_saved_identity(
    tmp_path: Path, recording: type[Recording]
) -> None:
    from tierzero.run.directory import RunDir
    from tierzero.run.trackers import reporting

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = {
        "tensorboard": {"id": "earlier"},
        "mlflow": {"run_id": "abc", "store": "sqlite:///x"},
    }
    (run_dir / IDENTITY_NAME).write_text(json.dumps(saved))
    with (
        RunDir(run_dir) as rundir,
        reporting(RunConfig(report_to=["tensorboard"]), rundir, 6, resume=True),
    ):
        pass
    assert recording.events[0] == ("open", "run", 6, True, {"id": "earlier"})
    # the identity of a tracker not named this time is kept for a later resume that names it
    assert json.loads((run_dir / IDENTITY_NAME).read_text())["mlflow"] == saved["mlflow"]


def test_only_rank_0_reports(tmp_path: Path, recording: type[Recording]) -> None:
    from tierzero.run.directory import RunDir
    from tierzero.run.trackers import reporting

    run = RunConfig(report_to=["tensorboard"])
    with (
        RunDir(tmp_path / "run", primary=False) as rundir,
        reporting(run, rundir, 0, False) as where,
    ):
        assert where == []
    assert recording.events == [] and not (tmp_path / "run" / IDENTITY_NAME).exists()


class Failing(Recording):
    fail_open = True


def test_a_tracker_that_cannot_start_closes_those_opened_and_says_why(
    tmp_path: Path, recording: type[Recording], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierzero.errors import ConfigError
    from tierzero.run import trackers

    monkeypatch.setitem(trackers.TRACKERS, "trackio", Failing)
    with pytest.raises(ConfigError) as refused:
        trackers.open_trackers(["tensorboard", "trackio"], RunConfig(), tmp_path, 0, False)
    assert str(refused.value) == (
        "--report-to trackio could not start its run (no such server); check TRACKIO_DIR, or "
        "TRACKIO_SPACE_ID / TRACKIO_SERVER_URL where they are set"
    )
    assert [e[0] for e in recording.events] == ["open", "close"] and recording.events[1] == (
        "close",
        "failed",
    )
    assert not (tmp_path / IDENTITY_NAME).exists()
