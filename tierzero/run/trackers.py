"""The experiment trackers a run reports to (`--report-to`): which, and what they are sent.

`resolve_report_to` checks the names before anything runs: an unknown one, or one whose library
is not installed, is refused in one sentence that names the fix. `reporting` opens the named
trackers on rank 0 once the run directory and the start step are known, sends each the run's
name (the run directory's) and its flattened config, then hands every record written to
metrics.jsonl to all of them as it is written (`RunDir.stream_metrics`: one place, so the
trackers see exactly the file's rows), and likewise each step's rows of samples.jsonl
(`RunDir.stream_samples`), and closes them however the run ends.

What a tracker needs to continue its run after a --resume (an MLflow run id, a W&B id, a
Trackio run's name) is saved in RUN_DIR/trackers.json, written temp-then-rename.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from tierzero.checkpoint.files import read_regular
from tierzero.config import RunConfig
from tierzero.errors import ConfigError
from tierzero.run.directory import RunDir
from tierzero.run.trackers_libraries import (
    MlflowTracker,
    RunEnd,
    TensorBoardTracker,
    TrackerStart,
    TrackioTracker,
    WandbTracker,
)
from tierzero.storage.durable import write_atomic

IDENTITY_NAME = "trackers.json"


class Tracker(Protocol):
    identity: dict[str, Any]
    where: str

    def log(self, step: int, metrics: dict[str, float], wall_time: float) -> None: ...
    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...
    def close(self, end: RunEnd) -> None: ...


# each tracker's class (its name is the name of the package it imports), and what to try when
# it cannot start
TRACKERS: dict[str, Any] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
    "trackio": TrackioTracker,
}
_START_FIXES = {
    "tensorboard": "make the run directory writable",
    "wandb": "log in with `wandb login`, or set WANDB_MODE=offline to keep the run's files local",
    "mlflow": "check MLFLOW_TRACKING_URI (unset, the run keeps a store in its own directory)",
    "trackio": "check TRACKIO_DIR, or TRACKIO_SPACE_ID / TRACKIO_SERVER_URL where they are set",
}
# the record's keys that are not metrics: the x axis and the wall clock it was written at
_AXES = ("step", "time")


def resolve_report_to(value: str | list[str] | None) -> list[str]:
    """The trackers `--report-to` (or `report_to` in a --config file) names, comma-separated or
    as a list; none: []. Refused here, before anything runs: an unknown name, or a tracker
    whose library is not installed."""
    items = value.split(",") if isinstance(value, str) else value or []
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise ConfigError(
            f'report_to must name trackers such as "tensorboard,wandb", got {value!r}'
        )
    names = list(dict.fromkeys(item.strip().lower() for item in items if item.strip()))
    if names == ["none"]:
        return []
    if "none" in names:
        others = ", ".join(name for name in names if name != "none")
        raise ConfigError(
            f"--report-to none reports nowhere and cannot be combined with {others}; "
            "pass none alone, or only trackers"
        )
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(
                f"--report-to {name} is not a tracker; choose none, or any of "
                f"{', '.join(TRACKERS)} (comma-separated)"
            )
        if importlib.util.find_spec(name) is None:
            raise ConfigError(
                f"--report-to {name} needs the {name} package: pip install 'tierzero[{name}]'"
            )
    return names


def flat_config(run: RunConfig) -> dict[str, Any]:
    """The run's config as one flat table (run and engine keys side by side, as config.toml
    holds them): enums as their spellings, a placement as placement/<state kind>."""
    items = run.flat()
    flat: dict[str, Any] = {}
    for key, value in sorted(items.items()):
        if dataclasses.is_dataclass(value):
            flat.update(
                {
                    f"{key}/{f.name}": _plain(getattr(value, f.name))
                    for f in dataclasses.fields(value)
                }
            )
        else:
            flat[key] = _plain(value)
    return flat


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


def flat_metrics(record: dict[str, Any] | list[Any], prefix: str = "") -> dict[str, float]:
    """Every number in a metrics record, nested dicts and lists flattened with '/'
    (`ranks/1/peak_host_bytes`); the step and the wall clock are the axes, not metrics."""
    pairs = record.items() if isinstance(record, dict) else enumerate(record)
    flat: dict[str, float] = {}
    for key, value in pairs:
        name = f"{prefix}{key}"
        if isinstance(value, (dict, list)):
            flat.update(flat_metrics(value, name + "/"))
        elif isinstance(value, (int, float)) and not (prefix == "" and key in _AXES):
            flat[name] = float(value)
    return flat


class Trackers:
    """The run's open trackers, by name."""

    def __init__(self, opened: dict[str, Tracker]) -> None:
        self.opened = opened

    @property
    def where(self) -> list[str]:
        return [tracker.where for tracker in self.opened.values()]

    def log(self, record: dict[str, Any]) -> None:
        """Send one metrics.jsonl row to every tracker; a row without a step (a resume's marker)
        is not a point on any curve."""
        step = record.get("step")
        if not isinstance(step, int):
            return
        metrics = flat_metrics(record)
        for tracker in self.opened.values():
            tracker.log(step, metrics, record["time"])

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Send one step's samples.jsonl rows to every tracker."""
        for tracker in self.opened.values():
            tracker.log_samples(step, rows)

    def close(self, end: RunEnd) -> None:
        """Close every tracker. A tracker that fails to close does not keep the others open; its
        error is raised after a finished run, and dropped after a failed or stopped one, whose
        own error is the one to see."""
        errors = []
        for tracker in self.opened.values():
            try:
                tracker.close(end)
            except Exception as e:  # noqa: BLE001 - each library raises its own kinds
                errors.append(e)
        self.opened = {}
        if errors and end == "finished":
            raise errors[0]


def open_trackers(
    names: list[str], run: RunConfig, run_dir: Path, start_step: int, resume: bool
) -> Trackers:
    """Open each named tracker, resuming its saved run when `resume`; save their identities."""
    saved = read_identities(run_dir) if resume else {}
    name_of_run = Path(os.path.abspath(run_dir)).name
    config = flat_config(run)
    opened: dict[str, Tracker] = {}
    for name in names:
        start = TrackerStart(name_of_run, run_dir, config, start_step, resume, saved.get(name, {}))
        try:
            opened[name] = TRACKERS[name].open(start)
        except KeyboardInterrupt:  # Ctrl-C while a library waits on its server
            Trackers(opened).close("killed")
            raise
        except Exception as e:  # noqa: BLE001 - each library raises its own kinds
            Trackers(opened).close("failed")
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"--report-to {name} could not start its run ({why}); {_START_FIXES[name]}"
            ) from None
    write_identities(
        run_dir,
        {**saved, **{name: t.identity for name, t in opened.items() if t.identity}},
    )
    return Trackers(opened)


def read_identities(run_dir: Path) -> dict[str, dict[str, Any]]:
    """The tracker identities a run directory saved ({}: none yet)."""
    path = run_dir / IDENTITY_NAME
    if not os.path.lexists(path):
        return {}
    try:
        saved = json.loads(read_regular(path))
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{path} cannot be read ({e}); remove it, and the trackers start new runs"
        ) from None
    if not isinstance(saved, dict) or not all(isinstance(v, dict) for v in saved.values()):
        raise ConfigError(
            f"{path} is not a table of tracker identities; remove it, and the trackers start "
            "new runs"
        )
    return saved


def write_identities(run_dir: Path, identities: dict[str, dict[str, Any]]) -> None:
    write_atomic(
        run_dir / IDENTITY_NAME,
        (json.dumps(identities, indent=1, sort_keys=True) + "\n").encode(),
    )


@contextmanager
def reporting(run: RunConfig, rundir: RunDir, start_step: int, resume: bool) -> Iterator[list[str]]:
    """Report the run to its trackers while the body trains (rank 0; the others report nothing):
    yields where each one can be seen. The trackers close when the body ends: finished, failed
    on an error, killed on Ctrl-C."""
    names = resolve_report_to(run.reporting.report_to)
    if not names or not rundir.primary:
        yield []
        return
    trackers = open_trackers(names, run, rundir.path, start_step, resume)
    rundir.stream_metrics(trackers.log)
    rundir.stream_samples(trackers.log_samples)
    end: RunEnd = "failed"
    try:
        yield trackers.where
        end = "finished"
    except KeyboardInterrupt:
        end = "killed"
        raise
    finally:
        rundir.stream_metrics(None)
        rundir.stream_samples(None)
        trackers.close(end)
