"""One experiment tracker per library, each over that library's own API and file format.

Every tracker is opened with a `TrackerStart` (the run's name, directory, flattened config and
where it starts), logs one metrics record per call on the training thread, logs a step's samples
(`--sample-prompts`: prompt and completion per row) as its library's own table or text, and
closes with how the run ended. `identity` is what it needs saved in the run directory to
continue the same tracker run after a --resume; `where` says, for the user, where its records
can be seen.

Each library is imported when its tracker opens (they cost seconds to import, and only the ones
a run names need be installed). None of them is handed a hand-written file: TensorBoard's event
files, MLflow's store, W&B's run files and Trackio's database are written by the library.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

RunEnd = Literal["finished", "failed", "killed"]
# the columns of a step's samples in every tracker's table
SAMPLE_COLUMNS = ("step", "prompt", "completion")


def sample_table(step: int, rows: list[dict[str, Any]]) -> list[list[Any]]:
    """A step's samples.jsonl rows as table rows of SAMPLE_COLUMNS."""
    return [[step, row["prompt"], row["completion"]] for row in rows]


# what markdown would read as emphasis, links, code, headings or a cell's end: escaped with a
# backslash; & and < as entities (a backslash does not escape them), line breaks as <br>
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]()>#+\-.!|])")


def markdown_cell(text: str) -> str:
    """Text that a markdown table shows literally, in one cell (a completion is any text)."""
    text = text.replace("&", "&amp;").replace("<", "&lt;")
    return _MARKDOWN_SPECIAL.sub(r"\\\1", text).replace("\r", "").replace("\n", "<br>")


@dataclass(frozen=True)
class TrackerStart:
    """What every tracker opens with. `saved` is the identity this tracker saved in the run
    directory earlier ({}: none); it is only looked at when `resume`."""

    run_name: str
    run_dir: Path
    config: dict[str, Any]
    start_step: int
    resume: bool
    saved: dict[str, Any]


class TensorBoardTracker:
    """Event files in RUN_DIR/tensorboard through `torch.utils.tensorboard.SummaryWriter`.

    A resumed run writes to the same log directory with `purge_step` one past its checkpoint, so
    TensorBoard hides the steps after it that the stopped run had logged (the resumed run redoes
    them); a fresh run purges from step 0, hiding an --overwrite's earlier run."""

    def __init__(self, writer: Any, log_dir: Path) -> None:
        self._writer = writer
        self.identity: dict[str, Any] = {}
        self.where = f"tensorboard --logdir {log_dir}"

    @classmethod
    def open(cls, start: TrackerStart) -> TensorBoardTracker:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        log_dir = start.run_dir / "tensorboard"
        purge_step = start.start_step + 1 if start.start_step else 0
        writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=10)
        # the HParams tab's view of the config, written into this run's own directory (the
        # writer's add_hparams would start a run of its own beside it)
        plain = {
            k: v if isinstance(v, (int, float, str, bool)) else str(v)
            for k, v in start.config.items()
        }
        for summary in hparams(plain, {"loss": 0.0, "eval_loss": 0.0}):
            writer.file_writer.add_summary(summary, start.start_step)
        rows = "\n".join(f"| {key} | {value} |" for key, value in start.config.items())
        writer.add_text(
            "config",
            f"run **{start.run_name}**\n\n| key | value |\n|---|---|\n{rows}",
            global_step=start.start_step,
        )
        return cls(writer, log_dir)

    def log(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step, walltime=wall_time)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """One markdown table per step under the `samples` tag (TensorBoard's Text tab)."""
        lines = [
            f"| {markdown_cell(prompt)} | {markdown_cell(completion)} |"
            for _, prompt, completion in sample_table(step, rows)
        ]
        table = "| prompt | completion |\n|---|---|\n" + "\n".join(lines)
        self._writer.add_text("samples", table, global_step=step)

    def close(self, end: RunEnd) -> None:
        self._writer.close()


# MLflow's metric and param keys: letters, digits, _ - . space : and /
_MLFLOW_UNSAFE = re.compile(r"[^\w\-. :/]")
_MLFLOW_BATCH = 100  # log_batch takes at most 100 params per call
OWN_MLFLOW_STORE = "RUN_DIR/mlflow.db"  # the store a run keeps when MLFLOW_TRACKING_URI is unset


def sample_artifact(step: int) -> str:
    """Where in the MLflow run's artifacts a step's samples table is."""
    return f"samples/step_{step:06d}.json"


def mlflow_key(key: str) -> str:
    """A metrics key as MLflow accepts it: `bytes_nvme->host` is `bytes_nvme_to_host`."""
    return _MLFLOW_UNSAFE.sub("_", key.replace("->", "_to_"))


class MlflowTracker:
    """One MLflow run through `MlflowClient` (no global active run to leak into the process).

    The store is the one MLFLOW_TRACKING_URI names; without it, a SQLite store in
    RUN_DIR/mlflow.db (MLflow refuses new file stores), saved as that name rather than its
    absolute path, so a moved or copied run directory resumes into its own store. The run id is
    saved in the run directory, and a resume in the same store reopens that run: params it lacks
    are added (MLflow never changes a param's value; config.toml holds the resumed run's) and
    the redone steps' metrics are logged again, after the stopped run's values for them."""

    def __init__(self, client: Any, run_id: str, store: str, tracking_uri: str) -> None:
        self._client = client
        self._run_id = run_id
        self.identity = {"run_id": run_id, "store": store}
        self.where = f"mlflow run {run_id} in {tracking_uri}"

    @classmethod
    def open(cls, start: TrackerStart) -> MlflowTracker:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        given = os.environ.get("MLFLOW_TRACKING_URI")
        store = given or OWN_MLFLOW_STORE
        uri = given or f"sqlite:///{(start.run_dir / 'mlflow.db').resolve()}"
        client = MlflowClient(tracking_uri=uri)
        run_id = cls._resumable(client, start, store)
        if run_id is None:
            artifacts = None if given else (start.run_dir / "mlartifacts").resolve().as_uri()
            run_id = client.create_run(
                cls._experiment(client, artifacts), run_name=start.run_name
            ).info.run_id
            have: dict[str, str] = {}
        else:
            client.update_run(run_id, status="RUNNING")
            have = client.get_run(run_id).data.params
        params = [
            Param(mlflow_key(k), str(v))
            for k, v in start.config.items()
            if mlflow_key(k) not in have
        ]
        for first in range(0, len(params), _MLFLOW_BATCH):
            client.log_batch(run_id, params=params[first : first + _MLFLOW_BATCH])
        return cls(client, run_id, store, uri)

    @staticmethod
    def _resumable(client: Any, start: TrackerStart, store: str) -> str | None:
        """The saved run, when this is a resume into the store that holds it and it still lives."""
        run_id = start.saved.get("run_id")
        if not start.resume or run_id is None or start.saved.get("store") != store:
            return None
        from mlflow.exceptions import MlflowException

        try:
            return run_id if client.get_run(run_id).info.lifecycle_stage == "active" else None
        except MlflowException:
            return None

    @staticmethod
    def _experiment(client: Any, artifacts: str | None) -> str:
        """The experiment MLflow's variables name (MLFLOW_EXPERIMENT_ID, _NAME), else `tierzero`."""
        if experiment_id := os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return experiment_id
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "tierzero"
        found = client.get_experiment_by_name(name)
        return (
            found.experiment_id if found is not None else client.create_experiment(name, artifacts)
        )

    def log(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        from mlflow.entities import Metric

        ms = int(wall_time * 1000)
        rows = [Metric(mlflow_key(k), v, ms, step) for k, v in metrics.items()]
        self._client.log_batch(self._run_id, metrics=rows)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A table artifact per step, samples/step_000010.json (a resume's redone step replaces
        its own file, where one growing table would hold the step twice)."""
        table = sample_table(step, rows)
        self._client.log_table(
            self._run_id,
            data={name: [row[i] for row in table] for i, name in enumerate(SAMPLE_COLUMNS)},
            artifact_file=sample_artifact(step),
        )

    def close(self, end: RunEnd) -> None:
        self._client.set_terminated(self._run_id, status=end.upper())


class WandbTracker:
    """One W&B run through `wandb.init` / `Run.log`, in the mode W&B's settings give (WANDB_MODE:
    online, offline, disabled). Its files go to WANDB_DIR, else the run directory.

    The run id is saved in the run directory and a resume passes it back with resume="allow".
    Records are logged against a `step` metric of their own rather than W&B's internal step,
    which only moves forward: the steps a resumed run redoes would otherwise be dropped."""

    def __init__(self, run: Any) -> None:
        self._run = run
        mode = run.settings.mode
        self.identity = {} if mode == "disabled" else {"id": run.id, "project": run.project}
        if mode == "disabled":
            self.where = "wandb: nowhere, WANDB_MODE is disabled"
        elif mode == "offline":
            self.where = f"wandb offline run {run.id}: wandb sync {run.settings.sync_dir}"
        else:
            self.where = f"wandb {run.url}"

    @classmethod
    def open(cls, start: TrackerStart) -> WandbTracker:
        import wandb

        saved = start.saved if start.resume else {}
        # W&B reads its env once a process
        files = os.environ.get("WANDB_DIR") or str(start.run_dir)
        run = wandb.init(
            project=saved.get("project") or os.environ.get("WANDB_PROJECT") or "tierzero",
            name=start.run_name,
            id=saved.get("id"),  # None: a new run, whose id W&B picks
            resume="allow" if saved.get("id") else None,
            config=start.config,
            allow_val_change=True,  # a resume may change --steps and the like
            dir=files,
            reinit="create_new",
        )
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return cls(run)

    def log(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        self._run.log({**metrics, "step": step})

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A `wandb.Table` of the step's samples under the `samples` key, at that step."""
        import wandb

        table = wandb.Table(columns=list(SAMPLE_COLUMNS), data=sample_table(step, rows))
        self._run.log({"samples": table, "step": step})

    def close(self, end: RunEnd) -> None:
        self._run.finish(exit_code={"finished": 0, "failed": 1, "killed": 255}[end])


@contextlib.contextmanager
def _chatter_to_stderr() -> Iterator[None]:
    """Trackio prints its banners on stdout, which `--json` keeps for the result alone."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


class TrackioTracker:
    """One Trackio run through `trackio.init` / `Run.log` / `trackio.finish`, local (TRACKIO_DIR)
    or on the Space or server Trackio's own variables name.

    Trackio finds a run to resume by its name within the project, so the name and project are
    saved in the run directory: a resume continues that run even if the directory was renamed.
    A fresh run always starts a new Trackio run, beside any of the same name."""

    def __init__(self, run: Any, project: str) -> None:
        self._run = run
        self.identity = {"project": project, "name": run.name, "id": run.id}
        self.where = f"trackio project {project}, run {run.name} (trackio show --project {project})"

    @classmethod
    def open(cls, start: TrackerStart) -> TrackioTracker:
        import trackio

        saved = start.saved if start.resume else {}
        project = saved.get("project") or "tierzero"
        with _chatter_to_stderr():
            run = trackio.init(
                project=project,
                name=saved.get("name") or start.run_name,
                config=start.config,
                resume="allow" if start.resume else "never",
                embed=False,
            )
        return cls(run, project)

    def log(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        self._run.log(metrics, step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A `trackio.Table` of the step's samples under the `samples` key, at that step."""
        import trackio

        table = trackio.Table(columns=list(SAMPLE_COLUMNS), data=sample_table(step, rows))
        self._run.log({"samples": table}, step=step)

    def close(self, end: RunEnd) -> None:
        import trackio

        with _chatter_to_stderr():
            trackio.finish()  # the run trackio.init made current on this thread
