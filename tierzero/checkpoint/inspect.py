"""What a run directory holds, read without touching it: checkpoints, stores, config.

`inspect_run` is what `tierzero inspect` shows. It takes no lock and writes nothing, so it is safe
beside a live trainer (whose files may change under it: a checkpoint half-made, a shard mid-swap).
Anything odd it meets -- unreadable JSON, a stray file, a missing directory -- is recorded as a
reason next to the thing it concerns, never raised, except a missing run directory. Files are opened
only when they are regular files (`checkpoint.files.read_regular`): a FIFO or a symlink in the run
directory is reported, never blocked on or followed. Only host and GPU tiers hold their state in
memory, so the arrays it counts are the NVMe store's on disk; the placement says which state kinds
the run keeps where.

NVMe store layouts understood (`storage.nvme.store`): one array per key (`<key>/zarr.json` with
node_type "array"), or one group per key whose `attributes.tierzero.current` names the current
generation directory (`<key>/g000017/zarr.json`); older generations, which checkpoints may
still link, are not counted.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from tierzero.checkpoint.catalog import checkpoint_dirs, verify_checkpoint
from tierzero.checkpoint.files import read_regular
from tierzero.checkpoint.manifest import MANIFEST_NAME, Manifest
from tierzero.config import Offload, Placement, StateKind
from tierzero.errors import RunDirError, TierzeroError
from tierzero.storage.base import StorageError
from tierzero.storage.filekind import kind_of

# bytes per element of the zarr data types the store writes (bf16 is stored as uint16)
_ITEMSIZE = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
}


@dataclass
class CheckpointInfo:
    step: int
    path: str
    status: str  # complete | incomplete | damaged, or after --verify: ok | damaged
    reason: str | None = None
    time: float | None = None
    nbytes: int | None = None  # bytes of state it holds
    bytes_copied: int | None = None  # bytes written to make it (0: all hard links)
    arrays: int | None = None


@dataclass
class KindTotal:
    arrays: int = 0
    nbytes: int = 0


@dataclass
class StoreInfo:
    """One NVMe directory of the run: its current arrays per state kind."""

    path: str
    exists: bool
    kinds: dict[str, KindTotal] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # odd files, each with why

    @property
    def arrays(self) -> int:
        return sum(k.arrays for k in self.kinds.values())

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes for k in self.kinds.values())


@dataclass
class RunInfo:
    run_dir: str
    config: dict[str, Any] | None
    config_error: str | None
    placement: dict[str, str]  # state kind -> tier ("auto" when the planner chose at run time)
    checkpoints: list[CheckpointInfo]
    stores: list[StoreInfo]
    # checkpoints newer than the one a resume would use, with why
    skipped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["stores"] = [{**asdict(s), "arrays": s.arrays, "nbytes": s.nbytes} for s in self.stores]
        return doc


def inspect_run(run_dir: str | Path, verify: bool = False) -> RunInfo:
    """The run's checkpoints (checked chunk by chunk with `verify`), NVMe stores and config."""
    root = Path(run_dir)
    if not root.is_dir():
        kind = kind_of(root)
        raise RunDirError(
            f"run directory '{run_dir}' "
            + (f"is {kind}, not a directory" if kind else "does not exist")
            + "; pass a directory that "
            "`tierzero train` wrote"
        )
    config, config_error = _config(root)
    checkpoints = [_checkpoint(step, path, verify) for step, path in checkpoint_dirs(root)]
    return RunInfo(
        str(run_dir),
        config,
        config_error,
        _placement(config),
        checkpoints,
        [store_info(p) for p in _nvme_paths(root, config)],
        _skipped_newer(checkpoints),
    )


def _skipped_newer(checkpoints: list[CheckpointInfo]) -> list[str]:
    """The checkpoints newer than the newest usable one (which resume and export take), each with
    why."""
    skipped = []
    for c in reversed(checkpoints):
        if c.status in ("complete", "ok"):
            break
        skipped.append(f"step {c.step} is {c.status}" + (f": {c.reason}" if c.reason else ""))
    return skipped


def _nvme_paths(root: Path, config: dict[str, Any] | None) -> list[str]:
    """The config's nvme_path (relative paths are relative to the run directory, as the trainer
    saves them), or the train command's default RUN_DIR/nvme when the config does not say."""
    value = (config or {}).get("nvme_path")
    paths = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    paths = [root / p for p in paths if isinstance(p, str)]
    if not paths and (root / "nvme").is_dir():
        paths = [root / "nvme"]
    return [str(store) for p in paths for store in _rank_stores(Path(p))]


def _rank_stores(path: Path) -> list[Path]:
    """A multi-rank run keeps one store per rank under `path/rank<r>/` (`Tiers.nvme_paths`)."""
    try:
        ranks = sorted(
            (p for p in path.iterdir() if re.fullmatch(r"rank\d+", p.name) and p.is_dir()),
            key=lambda p: int(p.name[4:]),
        )
    except OSError:
        return [path]
    return ranks or [path]


def _config(root: Path) -> tuple[dict[str, Any] | None, str | None]:
    path = root / "config.toml"
    try:
        return tomllib.loads(read_regular(path).decode()), None
    except FileNotFoundError:
        return None, f"{path} is missing"
    except OSError as e:
        return None, f"{path} {e.strerror}"
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        return None, f"{path} is not valid TOML ({e})"


def _placement(config: dict[str, Any] | None) -> dict[str, str]:
    try:
        if config is None:
            raise TierzeroError("no config")
        if isinstance(config.get("placement"), dict):
            return {k.value: str(config["placement"].get(k.value, "gpu")) for k in StateKind}
        offload = Offload(str(config.get("offload", Offload.NVME.value)).lower())
        if offload is Offload.AUTO:
            return {k.value: "auto" for k in StateKind}
        placement = Placement.for_offload(offload)
        return {k.value: placement.home(k).value for k in StateKind}
    except (TierzeroError, ValueError):
        return {k.value: "unknown" for k in StateKind}


def _checkpoint(step: int, path: Path, verify: bool) -> CheckpointInfo:
    info = CheckpointInfo(step, str(path), "incomplete")
    if not os.path.lexists(path / MANIFEST_NAME):
        info.reason = f"{MANIFEST_NAME} is missing (being written, or interrupted)"
        return info
    try:
        manifest = Manifest.load(path)
    except (TierzeroError, StorageError, OSError) as e:
        info.status, info.reason = "damaged", str(e)
        return info
    info.status = "complete"
    info.time, info.nbytes = manifest.origin.time, manifest.nbytes
    info.bytes_copied, info.arrays = manifest.origin.bytes_copied, len(manifest.arrays)
    if verify:
        try:
            verify_checkpoint(path, manifest)
            info.status = "ok"
        except (TierzeroError, StorageError, OSError) as e:
            info.status, info.reason = "damaged", str(e)
    return info


def store_info(path: str | Path) -> StoreInfo:
    """Count the current arrays under one NVMe store directory, by state kind."""
    info = StoreInfo(str(path), Path(path).is_dir())
    if not info.exists:
        return info
    for directory, subdirs, _ in os.walk(
        path, onerror=lambda e: info.skipped.append(f"{e.filename}: {e.strerror}")
    ):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))  # lock, spares, temps
        doc = _node(Path(directory) / "zarr.json", info)
        if doc is None:
            continue
        key = os.path.relpath(directory, path)
        current = _current_generation(doc)
        if current is not None:  # one group per key; the current generation is the array
            subdirs[:] = []
            generation = Path(directory) / current / "zarr.json"
            if not generation.is_file():
                info.skipped.append(
                    f"{directory}: its current generation {current} has no zarr.json"
                )
                continue
            doc = _node(generation, info)
            if doc is None:
                continue
        elif doc.get("node_type") != "array":
            continue
        subdirs[:] = []  # an array's chunk files: nothing more to find below
        nbytes = _array_nbytes(doc)
        if nbytes is None:
            info.skipped.append(f"{directory}: zarr.json has no readable shape or data type")
            continue
        total = info.kinds.setdefault(key.split(os.sep)[0], KindTotal())
        total.arrays += 1
        total.nbytes += nbytes
    return info


def _node(path: Path, info: StoreInfo) -> dict[str, Any] | None:
    """The parsed zarr.json at `path`, or None (noting why when it exists but is unreadable)."""
    try:
        doc = json.loads(read_regular(path))
    except FileNotFoundError:
        return None
    except OSError as e:
        info.skipped.append(f"{path}: {e.strerror}")
        return None
    except ValueError as e:
        info.skipped.append(f"{path}: {type(e).__name__}: {e}")
        return None
    if not isinstance(doc, dict):
        info.skipped.append(f"{path}: not a JSON object")
        return None
    return doc


def _current_generation(doc: dict[str, Any]) -> str | None:
    attrs = doc.get("attributes")
    ours = attrs.get("tierzero") if isinstance(attrs, dict) else None
    current = ours.get("current") if isinstance(ours, dict) else None
    if doc.get("node_type") != "group" or not isinstance(current, str):
        return None
    return current if current and os.sep not in current and not current.startswith(".") else None


def _array_nbytes(doc: dict[str, Any]) -> int | None:
    """shape x itemsize from a zarr v3 array's metadata (tierzero's true dtype when recorded)."""
    try:
        attrs = doc.get("attributes") or {}
        name = (attrs.get("tierzero") or {}).get("dtype") or doc["data_type"]
        return math.prod(int(d) for d in doc["shape"]) * _ITEMSIZE[name]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
