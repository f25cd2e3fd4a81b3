"""`tierzero train --report-to`: every tracker's records read back with that tracker's own
reader, against the run's metrics.jsonl.

TensorBoard's event files through its EventAccumulator, the MLflow store through MlflowClient,
Trackio's database through its Api and SQLiteStorage. W&B 0.31 has no reader for an offline
run's files (`wandb sync --view` and `wandb.sdk.internal.datastore` are gone), so its record
log is decoded here with W&B's own protobuf `Record` (the log's framing is LevelDB's, which
W&B's format keeps). Nothing leaves the machine: W&B is offline, MLflow's telemetry is off,
Hugging Face is offline and Trackio logs locally, to a directory in the session's temp dir.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import train
from tierzero.checkpoint.catalog import checkpoint_dirs
from tierzero.config import Placement, RunConfig
from tierzero.run.directory import read_metrics
from tierzero.run.trackers import (
    IDENTITY_NAME,
    Trackers,
    flat_config,
    flat_metrics,
    resolve_report_to,
)
from tierzero.run.trackers_libraries import mlflow_key

ALL = "tensorboard,mlflow,wandb,trackio"


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Trackio reads TRACKIO_DIR once, when it is imported: point it into the temp dir first."""
    before = os.environ.get("TRACKIO_DIR")
    if "trackio" not in sys.modules:
        os.environ["TRACKIO_DIR"] = str(tmp_path_factory.mktemp("trackio"))
    import trackio.utils

    where = Path(trackio.utils.TRACKIO_DIR)
    assert where.is_relative_to(tmp_path_factory.getbasetemp()), (
        f"trackio was imported earlier, for {where}"
    )
    yield where
    if before is None:
        os.environ.pop("TRACKIO_DIR", None)


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trackio_dir: Path) -> Path:
    """Every tracker local and quiet; W&B's files in tmp_path/wandb. Returns WANDB_DIR."""
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()
    for key in (
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_EXPERIMENT_ID",
        "WANDB_PROJECT",
        "WANDB_RUN_ID",
        "TRACKIO_SPACE_ID",
        "TRACKIO_SERVER_URL",
    ):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_X_DISABLE_STATS", "true")  # no system-metrics sampler process
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return wandb_dir


def losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """Each step's `key` as metrics.jsonl holds it (a resume's redone steps: the new rows)."""
    return {r["step"]: r[key] for r in read_metrics(run_dir) if key in r}


# -- TensorBoard ----------------------------------------------------------------------------


def tensorboard_scalars(run_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()  # applies the purge a resumed writer asked for
    scalars = events.Scalars(tag)
    assert len({s.step for s in scalars}) == len(scalars), f"{tag}: a step logged twice"
    return {s.step: s.value for s in scalars}


def tensorboard_text(run_dir: Path) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


# -- MLflow ---------------------------------------------------------------------------------


def mlflow_run(run_dir: Path) -> tuple[Any, Any]:
    from mlflow.tracking import MlflowClient

    saved = json.loads((run_dir / IDENTITY_NAME).read_text())["mlflow"]
    assert saved["tracking_uri"] == f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
    client = MlflowClient(tracking_uri=saved["tracking_uri"])
    return client, client.get_run(saved["run_id"])


def mlflow_history(client: Any, run_id: str, key: str) -> dict[int, float]:
    """The newest value of each step (a resumed run logs its redone steps again)."""
    rows = sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
    return {m.step: m.value for m in rows}


# -- W&B ------------------------------------------------------------------------------------

_BLOCK = 32 * 1024  # the record log's block size; a record's header never straddles blocks
_HEADER = 7  # ":W&B", magic 0xBEE1, version 0; then per chunk: crc32, length, chunk type


def wandb_records(path: Path) -> list[Any]:
    """The protobuf Records of one offline run's .wandb file (chunk types 1 full, 2 first,
    3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, pending = [], _HEADER, b""
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # too little left in the block for a header: padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        pending += data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_runs(wandb_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """Each offline run directory W&B wrote for `run_id` (a resume writes one more), oldest
    first: its run record's name and config, and its history rows."""
    found = []
    for offline in sorted((wandb_dir / "wandb").glob(f"offline-run-*-{run_id}")):
        records = wandb_records(offline / f"run-{run_id}.wandb")
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        history = [
            {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in r.history.item
            }
            for r in records
            if r.WhichOneof("record_type") == "history"
        ]
        found.append(
            {
                "id": run.run_id,
                "name": run.display_name,
                "config": config,
                "history": history,
            }
        )
    return found


# -- Trackio --------------------------------------------------------------------------------


def trackio_run(name: str) -> tuple[Any, list[dict[str, Any]]]:
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    runs = [r for r in trackio.Api().runs("tierzero") if r.name == name]
    assert len(runs) == 1, f"{len(runs)} trackio runs named {name}"
    return runs[0], SQLiteStorage.get_logs("tierzero", run_id=runs[0].id)


# -- the runs -------------------------------------------------------------------------------


def test_a_run_reports_to_every_tracker(tmp_path: Path, offline: Path) -> None:
    run_dir = tmp_path / "mem-run"
    result = train(
        "--steps",
        "3",
        "--offload",
        "none",
        "--run-dir",
        str(run_dir),
        "--report-to",
        ALL,
    )
    assert result.exit_code == 0, result.output
    loss, val = losses(run_dir), losses(run_dir, "val_loss")
    assert sorted(loss) == [1, 2, 3] and sorted(val) == [0, 3]

    assert tensorboard_scalars(run_dir, "loss") == pytest.approx(loss)
    assert tensorboard_scalars(run_dir, "val_loss") == pytest.approx(val)
    assert set(tensorboard_scalars(run_dir, "tokens_per_s")) == {1, 2, 3}
    assert "run **mem-run**" in tensorboard_text(
        run_dir
    ) and "| offload | none |" in tensorboard_text(run_dir)

    client, run = mlflow_run(run_dir)
    assert run.info.run_name == "mem-run" and run.info.status == "FINISHED"
    assert run.data.params["offload"] == "none" and run.data.params["steps"] == "3"
    assert mlflow_history(client, run.info.run_id, "loss") == pytest.approx(loss)
    assert mlflow_history(client, run.info.run_id, "val_loss") == pytest.approx(val)

    wandb_id = json.loads((run_dir / IDENTITY_NAME).read_text())["wandb"]["id"]
    [wb] = wandb_runs(offline, wandb_id)
    assert (
        wb["name"] == "mem-run" and wb["config"]["offload"] == "none" and wb["config"]["lr"] == 1e-3
    )
    assert {row["step"]: row["loss"] for row in wb["history"] if "loss" in row} == pytest.approx(
        loss
    )

    tio, logs = trackio_run("mem-run")
    assert tio.config["offload"] == "none" and tio.config["steps"] == 3
    assert {row["step"]: row["loss"] for row in logs if "loss" in row} == pytest.approx(loss)


def test_a_tiered_run_stopped_and_resumed_continues_each_tracker_run(
    tmp_path: Path, offline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C after step 3 reached the trackers (checkpoint at 2), then --resume: each tracker
    continues its run, and what it shows per step is what metrics.jsonl holds."""
    run_dir = tmp_path / "nvme-run"
    forward = Trackers.log

    def stop_after_step_3(self: Trackers, record: dict[str, Any]) -> None:
        forward(self, record)
        if record.get("step") == 3:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Trackers, "log", stop_after_step_3)
        stopped = train(
            "--steps",
            "4",
            "--offload",
            "nvme",
            "--checkpoint-every",
            "2",
            "--run-dir",
            str(run_dir),
            "--report-to",
            ALL,
        )
    assert stopped.exit_code == 130, stopped.output
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [2]
    identities = json.loads((run_dir / IDENTITY_NAME).read_text())
    client, run = mlflow_run(run_dir)
    assert run.info.status == "KILLED"

    resumed = train("--resume", "--run-dir", str(run_dir))  # report_to comes back from config.toml
    assert resumed.exit_code == 0, resumed.output
    assert "resumed from checkpoint step 2" in resumed.output
    assert json.loads((run_dir / IDENTITY_NAME).read_text()) == identities
    loss = losses(run_dir)
    assert sorted(loss) == [1, 2, 3, 4]

    assert tensorboard_scalars(run_dir, "loss") == pytest.approx(
        loss
    )  # the stopped run's step 3 purged
    assert set(tensorboard_scalars(run_dir, "bytes_nvme->host")) == {1, 2, 3, 4}

    client, run = mlflow_run(run_dir)
    assert run.info.status == "FINISHED" and run.info.run_id == identities["mlflow"]["run_id"]
    assert mlflow_history(client, run.info.run_id, "loss") == pytest.approx(loss)
    assert (
        mlflow_history(client, run.info.run_id, "bytes_nvme_to_host")[4]
        == losses(run_dir, "bytes_nvme->host")[4]
    )
    assert run.data.params["offload"] == "nvme"

    first, second = wandb_runs(offline, identities["wandb"]["id"])
    assert [row["step"] for row in first["history"] if "loss" in row] == [1, 2, 3]
    assert {
        row["step"]: row["loss"] for row in second["history"] if "loss" in row
    } == pytest.approx({step: loss[step] for step in (3, 4)})

    tio, logs = trackio_run("nvme-run")  # one run, resumed
    assert tio.id == identities["trackio"]["id"] and tio.config["offload"] == "nvme"
    assert {row["step"]: row["loss"] for row in logs if "loss" in row} == pytest.approx(loss)


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
    run = RunConfig(steps=5, report_to=["tensorboard"])
    run.engine.placement = Placement()
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
