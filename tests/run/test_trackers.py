"""`tierzero train --report-to`: every tracker's records read back with that tracker's own
reader, against the run's metrics.jsonl.

TensorBoard's event files through its EventAccumulator, the MLflow store through MlflowClient,
Trackio's database through its Api and SQLiteStorage. The samples too: TensorBoard's text
through its own markdown renderer, MLflow's table artifacts, W&B's table files, Trackio's
tables, each against the run's samples.jsonl. W&B 0.31 has no reader for an offline
run's files (`wandb sync --view` and `wandb.sdk.internal.datastore` are gone), so its record
log is decoded here with W&B's own protobuf `Record` (the log's framing is LevelDB's, which
W&B's format keeps). Nothing leaves the machine: W&B is offline, MLflow's telemetry is off,
Hugging Face is offline and Trackio logs locally, to a directory in the session's temp dir.
"""

from __future__ import annotations

import html.parser
import json
import os
import re
import shutil
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import train
from tierzero.checkpoint.catalog import checkpoint_dirs
from tierzero.run.directory import read_metrics, read_samples
from tierzero.run.trackers import IDENTITY_NAME, Trackers, flat_metrics
from tierzero.run.trackers_libraries import mlflow_key, sample_artifact

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


def expected(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every metric of metrics.jsonl by key and step, as the trackers are sent it (a resume's
    redone steps: the new rows)."""
    curves: dict[str, dict[int, float]] = {}
    for record in read_metrics(run_dir):
        for key, value in flat_metrics(record).items():
            curves.setdefault(key, {})[record["step"]] = value
    return curves


def assert_curves(seen: dict[str, dict[int, float]], run_dir: Path, key=lambda k: k) -> None:
    """A tracker shows every metric of every step metrics.jsonl holds, and nothing else."""
    want = {key(k): steps for k, steps in expected(run_dir).items()}
    assert set(seen) == set(want)
    for name, steps in want.items():
        assert seen[name] == pytest.approx(steps, nan_ok=True), name


def curves_of(rows: list[dict[str, Any]], step: str = "step") -> dict[str, dict[int, float]]:
    """Rows of {step, metric: value, ...} as curves; a later row of a step replaces an earlier."""
    curves: dict[str, dict[int, float]] = {}
    for row in rows:
        for name, value in row.items():
            if name != step and isinstance(value, (int, float)) and value is not None:
                curves.setdefault(name, {})[row[step]] = value
    return curves


def samples_by_step(run_dir: Path) -> dict[int, list[tuple[str, str]]]:
    """samples.jsonl as each step's (prompt, completion) pairs, in the file's order."""
    by_step: dict[int, list[tuple[str, str]]] = {}
    for row in read_samples(run_dir):
        by_step.setdefault(row["step"], []).append((row["prompt"], row["completion"]))
    return by_step


def table_by_step(rows: list[list[Any]]) -> dict[int, list[tuple[str, str]]]:
    """Rows of [step, prompt, completion] as samples_by_step's shape."""
    by_step: dict[int, list[tuple[str, str]]] = {}
    for step, prompt, completion in rows:
        by_step.setdefault(step, []).append((prompt, completion))
    return by_step


# -- TensorBoard ----------------------------------------------------------------------------


class _Cells(html.parser.HTMLParser):
    """The text of every <td> of rendered HTML, a <br> as a line break."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.cells: list[str] = []
        self._inside = False

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag == "td":
            self.cells.append("")
            self._inside = True
        elif tag == "br" and self._inside:
            self.cells[-1] += "\n"

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._inside = False

    def handle_data(self, data: str) -> None:
        if self._inside:
            self.cells[-1] += data


def shown(text: str) -> str:
    """Text as a rendered table cell can show it: runs of spaces and tabs as one space, trimmed
    (markdown expands tabs and a cell drops its edges' spaces)."""
    return re.sub(r"[ \t]+", " ", text).strip()


def tensorboard_samples(run_dir: Path) -> dict[int, list[tuple[str, str]]]:
    """Each step's samples as TensorBoard's Text tab shows them: the `samples` text rendered by
    TensorBoard's own markdown, its table cells read back."""
    from tensorboard import plugin_util
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    by_step = {}
    for event in events.Tensors("samples/text_summary"):
        markdown = event.tensor_proto.string_val[0].decode()
        cells = _Cells()
        cells.feed(plugin_util.markdown_to_safe_html(markdown))
        by_step[event.step] = list(zip(cells.cells[0::2], cells.cells[1::2]))
    return by_step


def tensorboard_curves(run_dir: Path) -> tuple[dict[str, dict[int, float]], str]:
    """Every scalar curve of the run's event files (each step once), and the config's text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()  # applies the purge a resumed writer asked for
    curves = {}
    for tag in events.Tags()["scalars"]:
        points = events.Scalars(tag)
        assert len({p.step for p in points}) == len(points), f"{tag}: a step shown twice"
        curves[tag] = {p.step: p.value for p in points}
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    return curves, text


# -- MLflow ---------------------------------------------------------------------------------


def mlflow_run(run_dir: Path) -> tuple[Any, Any]:
    from mlflow.tracking import MlflowClient

    saved = json.loads((run_dir / IDENTITY_NAME).read_text())["mlflow"]
    assert saved["store"] == "RUN_DIR/mlflow.db"  # the run's own: MLFLOW_TRACKING_URI is unset
    client = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    return client, client.get_run(saved["run_id"])


def mlflow_curves(client: Any, run: Any) -> dict[str, dict[int, float]]:
    """Each metric's history, the newest value of each step (a resume logs redone steps again)."""
    curves = {}
    for key in run.data.metrics:
        rows = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp)
        curves[key] = {m.step: m.value for m in rows}
    return curves


def mlflow_samples(client: Any, run: Any, where: Path) -> dict[int, list[tuple[str, str]]]:
    """Each step's samples table artifact (samples/step_NNNNNN.json), downloaded."""
    by_step = {}
    for artifact in client.list_artifacts(run.info.run_id, "samples"):
        local = client.download_artifacts(run.info.run_id, artifact.path, str(where))
        table = json.loads(Path(local).read_text())
        assert table["columns"] == ["step", "prompt", "completion"]
        [step] = {row[0] for row in table["data"]}
        assert artifact.path == sample_artifact(step)
        by_step.update(table_by_step(table["data"]))
    return by_step


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
    first: its run record's name and config, and its history rows (W&B's own keys dropped)."""
    found = []
    for offline in sorted((wandb_dir / "wandb").glob(f"offline-run-*-{run_id}")):
        records = wandb_records(offline / f"run-{run_id}.wandb")
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        history, tables = [], {}
        for record in records:
            if record.WhichOneof("record_type") == "history":
                row: dict[str, Any] = {}
                for item in record.history.item:  # a nested key is a dict's (a table's) field
                    *outer, last = item.nested_key or [item.key]
                    into = row
                    for key in outer:
                        into = into.setdefault(key, {})
                    into[last] = json.loads(item.value_json)
                row = {k: v for k, v in row.items() if not k.startswith("_")}
                history.append(row)
                if "samples" in row:  # a wandb.Table: its rows are in a file beside the log
                    assert row["samples"]["_type"] == "table-file"
                    table = json.loads((offline / "files" / row["samples"]["path"]).read_text())
                    assert table["columns"] == ["step", "prompt", "completion"]
                    tables[row["step"]] = table_by_step(table["data"])[row["step"]]
        found.append(
            {
                "id": run.run_id,
                "name": run.display_name,
                "config": config,
                "history": history,
                "samples": tables,
            }
        )
    return found


# -- Trackio --------------------------------------------------------------------------------


def trackio_run(name: str) -> tuple[Any, list[dict[str, Any]]]:
    """The one Trackio run of that name in project tierzero, and its logged rows."""
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    runs = [r for r in trackio.Api().runs("tierzero") if r.name == name]
    assert len(runs) == 1, f"{len(runs)} trackio runs named {name}"
    logs = SQLiteStorage.get_logs("tierzero", run_id=runs[0].id)
    return runs[0], [{k: v for k, v in row.items() if k != "timestamp"} for row in logs]


def trackio_samples(logs: list[dict[str, Any]]) -> dict[int, list[tuple[str, str]]]:
    """Each step's `samples` table among a Trackio run's logged rows."""
    import trackio

    by_step = {}
    for row in logs:
        if "samples" in row:
            assert row["samples"]["_type"] == trackio.Table.TYPE
            table = [[r["step"], r["prompt"], r["completion"]] for r in row["samples"]["_value"]]
            by_step[row["step"]] = table_by_step(table)[row["step"]]
    return by_step


# -- the runs -------------------------------------------------------------------------------


def test_a_run_reports_to_every_tracker(tmp_path: Path, offline: Path) -> None:
    """Metrics and samples (every 2 steps and at the end) reach every tracker."""
    run_dir = tmp_path / "mem-run"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main(args):\nclass A | B: # *not* emphasis <b>\n")
    args = ["--steps", "3", "--offload", "none", "--run-dir", str(run_dir), "--json"]
    samples = ["--sample-prompts", str(prompts), "--sample-every", "2"]
    result = train(*args, *samples, "--sample-max-new-tokens", "12", "--report-to", ALL)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["steps"] == 3  # the trackers' chatter stays off stdout
    written = samples_by_step(run_dir)
    assert sorted(written) == [2, 3] and all(len(rows) == 2 for rows in written.values())
    assert written[2][1][0] == "class A | B: # *not* emphasis <b>"
    loss = expected(run_dir)["loss"]
    assert sorted(loss) == [1, 2, 3] and len(expected(run_dir)) > 4  # lr, tokens/s, evaluations...

    curves, text = tensorboard_curves(run_dir)
    assert_curves(curves, run_dir)
    assert "run **mem-run**" in text and "| offload | none |" in text and "| steps | 3 |" in text

    client, run = mlflow_run(run_dir)
    assert run.info.run_name == "mem-run" and run.info.status == "FINISHED"
    assert run.data.params["offload"] == "none" and run.data.params["steps"] == "3"
    assert run.data.params["report_to"] == str(ALL.split(","))
    assert_curves(mlflow_curves(client, run), run_dir, key=mlflow_key)

    wandb_id = json.loads((run_dir / IDENTITY_NAME).read_text())["wandb"]["id"]
    [wb] = wandb_runs(offline, wandb_id)
    assert (
        wb["name"] == "mem-run" and wb["config"]["offload"] == "none" and wb["config"]["lr"] == 1e-3
    )
    assert_curves(curves_of(wb["history"]), run_dir)

    tio, logs = trackio_run("mem-run")
    assert tio.config["offload"] == "none" and tio.config["steps"] == 3
    assert_curves(curves_of(logs), run_dir)

    def as_shown(by_step: dict[int, list[tuple[str, str]]]) -> dict[int, list[tuple[str, str]]]:
        return {step: [(shown(p), shown(c)) for p, c in rows] for step, rows in by_step.items()}

    assert as_shown(tensorboard_samples(run_dir)) == as_shown(written)
    assert mlflow_samples(client, run, tmp_path / "downloads") == written
    assert wb["samples"] == written
    assert trackio_samples(logs) == written


def test_a_tiered_run_stopped_and_resumed_continues_each_tracker_run(
    tmp_path: Path, offline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C after step 3 reached the trackers (checkpoint at 2), then --resume of the run
    directory moved elsewhere: each tracker continues its run, and what it shows per step is
    what metrics.jsonl holds."""
    run_dir = tmp_path / "nvme-run"
    forward = Trackers.log

    def stop_after_step_3(self: Trackers, record: dict[str, Any]) -> None:
        forward(self, record)
        if record.get("step") == 3:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Trackers, "log", stop_after_step_3)
        args = [
            "--steps",
            "4",
            "--offload",
            "nvme",
            "--checkpoint-every",
            "2",
            "--run-dir",
            str(run_dir),
        ]
        stopped = train(*args, "--report-to", ALL)
    assert stopped.exit_code == 130, stopped.output
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [2]
    identities = json.loads((run_dir / IDENTITY_NAME).read_text())
    client, run = mlflow_run(run_dir)
    assert run.info.status == "KILLED"
    [wb] = wandb_runs(offline, identities["wandb"]["id"])
    assert [row["step"] for row in wb["history"]] == [0, 1, 2, 3]

    (tmp_path / "moved").mkdir()
    run_dir = Path(shutil.move(run_dir, tmp_path / "moved"))  # resumes into its own stores
    resumed = train("--resume", "--run-dir", str(run_dir))  # report_to comes back from config.toml
    assert resumed.exit_code == 0, resumed.output
    assert "resumed from checkpoint step 2" in resumed.output
    assert json.loads((run_dir / IDENTITY_NAME).read_text()) == identities
    assert sorted(expected(run_dir)["loss"]) == [1, 2, 3, 4]
    assert sorted(expected(run_dir)["bytes_nvme->host"]) == [1, 2, 3, 4]

    assert_curves(tensorboard_curves(run_dir)[0], run_dir)  # the stopped run's step 3: purged

    client, run = mlflow_run(run_dir)
    assert run.info.status == "FINISHED" and run.info.run_id == identities["mlflow"]["run_id"]
    assert run.data.params["offload"] == "nvme"
    assert_curves(mlflow_curves(client, run), run_dir, key=mlflow_key)

    first, second = wandb_runs(offline, identities["wandb"]["id"])
    assert second["name"] == "nvme-run" and [row["step"] for row in second["history"]] == [3, 4]
    assert_curves(curves_of(first["history"] + second["history"]), run_dir)

    tio, logs = trackio_run("nvme-run")  # one run, resumed
    assert tio.id == identities["trackio"]["id"] and tio.config["offload"] == "nvme"
    assert_curves(curves_of(logs), run_dir)


# -- what TensorBoard shows ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "a | b || c",
        "*not* _emphasis_ **nor** `code` ~~struck~~",
        "# not a heading\n- nor a list\n1. nor this",
        "[a link](http://x) ![an image](y) <b>raw</b> &amp; a\\|b \\\\",
        "{braces} (parens) + - . ! > quote",
    ],
)
def test_a_sample_cell_shows_its_text_literally_in_tensorboard(text: str) -> None:
    """A completion is any text: rendered by TensorBoard's own markdown, its cell reads back as
    the text, line breaks included."""
    from tensorboard import plugin_util

    from tierzero.run.trackers_libraries import markdown_cell

    cells = _Cells()
    table = f"| prompt | completion |\n|---|---|\n| p | {markdown_cell(text)} |"
    cells.feed(plugin_util.markdown_to_safe_html(table))
    assert cells.cells == ["p", text]
