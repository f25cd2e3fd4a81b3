"""The checkpoint manifest: what one checkpoint holds, as JSON (never a pickle).

A checkpoint is a directory `RUN_DIR/checkpoints/step-<N>/`:

    manifest.json            this file's `Manifest`; written last, so its presence marks a
                             complete checkpoint (the directory is renamed into place after it)
    state/<kind>/u<unit>/r<rank>/   one frozen array per shard (`tierzero.storage.nvme.arrays`):
                             zarr.json + c/<i>; the manifest's crc32c list is the authority

The manifest records the step, the unit layout (every parameter name, offset and shape, so
export needs no model code), the world size and dtypes, a hash of the config, the engine's
counters, loss scaler, data position and RNG states, one entry per array, the run id that wrote
it (`tierzero.checkpoint.lineage`) and the run's config.toml as it was then.

Integrity: the chunks carry crc32c lists in the manifest, and the manifest carries a sha256 over
its own content (canonical JSON, so the snapshot of config.toml is covered too). One changed
digit anywhere in it is caught on load, and `load` also insists that the directory's step, the
manifest's step and the engine's step count agree; anything else is a damaged checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tierzero.checkpoint.files import read_regular
from tierzero.errors import CheckpointError
from tierzero.layout.partition import Unit
from tierzero.storage.nvme.zarrmeta import ShardMeta

FORMAT = "tierzero-checkpoint/2"  # /2: a checksum over the manifest, its run id
MANIFEST_NAME = "manifest.json"
STATE_DIR = "state"
STEP_DIR = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class SlotLayout:
    """One parameter in its unit's flat buffer; `names` lists every tied alias. A frozen one
    has no master weight: its values are in the unit's param arrays (compute dtype)."""

    names: list[str]
    offset: int
    numel: int
    shape: list[int]
    frozen: bool = False


@dataclass(frozen=True)
class UnitLayout:
    index: int
    name: str
    numel: int
    padded_numel: int
    slots: list[SlotLayout]
    trainable_numel: int  # flat[:trainable_numel] has master weights and Adam states


def layout_of(units: list[Unit]) -> list[UnitLayout]:
    return [
        UnitLayout(
            u.index,
            u.name,
            u.numel,
            u.padded_numel,
            [
                SlotLayout(list(s.names), s.offset, s.numel, list(s.shape), s.frozen)
                for s in u.slots
            ],
            u.trainable_numel,
        )
        for u in units
    ]


def config_hash(values: dict[str, Any]) -> str:
    """A stable hash of the settings that shape training (sorted JSON, sha256, 16 hex digits)."""
    raw = json.dumps(values, sort_keys=True, default=str).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass
class Origin:
    """Where a checkpoint came from and what it cost: when it was written, the lineage that
    wrote it (RUN_DIR/run-id then), what built the model (preset name, shape; for humans and
    export), RUN_DIR/config.toml when it was written (covered by the checksum), and the bytes
    written to make it (0 when all hard-linked). In the manifest's JSON they sit beside the
    other keys."""

    time: float
    run_id: str | None = None
    model: dict[str, Any] | None = None
    config_toml: str | None = None
    bytes_copied: int = 0


@dataclass
class Manifest:
    step: int
    world_size: int
    compute_dtype: str
    config_hash: str
    units: list[UnitLayout]
    arrays: dict[str, ShardMeta]  # shard key -> its frozen array under state/<key>
    origin: Origin
    engine: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] | None = None
    rng: dict[str, Any] = field(default_factory=dict)
    # with several ranks: each rank's RNG states, in rank order
    rank_rng: list[dict[str, Any]] | None = None
    stage: int = 3  # the ZeRO stage: at 1 and 2 each rank's param arrays hold whole units

    @property
    def nbytes(self) -> int:
        """The bytes of state the checkpoint holds (not what it cost to make)."""
        return sum(m.nbytes for m in self.arrays.values())

    def to_json(self) -> bytes:
        doc = asdict(self)
        doc.update(doc.pop("origin"))  # one flat document, as manifests have always been
        doc["arrays"] = {k: m.to_dict() for k, m in self.arrays.items()}
        doc = {"format": FORMAT, **json.loads(json.dumps(doc))}  # as a reader will see it
        return json.dumps({**doc, "checksum": _checksum(doc)}, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Manifest:
        try:
            doc = json.loads(raw)
            if doc.get("format") != FORMAT:
                raise CheckpointError(
                    f"{where} is not a {FORMAT} manifest (format "
                    f"{doc.get('format')!r}); use a checkpoint this tierzero wrote"
                )
            if doc.pop("checksum", None) != _checksum(doc):
                raise CheckpointError(
                    f"{where} fails its checksum (edited or damaged since it was "
                    "written); the checkpoint is damaged, use another one"
                )
            units = [
                UnitLayout(
                    int(u["index"]),
                    str(u["name"]),
                    int(u["numel"]),
                    int(u["padded_numel"]),
                    [
                        SlotLayout(
                            [str(n) for n in s["names"]],
                            int(s["offset"]),
                            int(s["numel"]),
                            [int(d) for d in s["shape"]],
                            bool(s.get("frozen", False)),
                        )
                        for s in u["slots"]
                    ],
                    int(u.get("trainable_numel", u["padded_numel"])),
                )
                for u in doc["units"]
            ]
            arrays = {
                str(k): ShardMeta.from_dict(v, f"{where} array {k!r}")
                for k, v in doc["arrays"].items()
            }
            origin = Origin(
                float(doc["time"]),
                _optional_str(doc.get("run_id")),
                doc.get("model"),
                _optional_str(doc.get("config_toml")),
                int(doc.get("bytes_copied", 0)),
            )
            return cls(
                int(doc["step"]),
                int(doc["world_size"]),
                str(doc["compute_dtype"]),
                str(doc["config_hash"]),
                units,
                arrays,
                origin,
                dict(doc.get("engine") or {}),
                doc.get("data"),
                dict(doc.get("rng") or {}),
                _rank_rng(doc.get("rank_rng"), int(doc["world_size"])),
                int(doc.get("stage", 3)),
            )
        except CheckpointError:
            raise
        except Exception as e:  # malformed JSON or fields: one sentence, never a traceback
            raise CheckpointError(
                f"{where} is not a readable checkpoint manifest ({type(e).__name__}: "
                f"{e}); the checkpoint is damaged, use another one"
            ) from None

    @classmethod
    def load(cls, checkpoint: Path) -> Manifest:
        """The manifest of `checkpoint`, its checksum verified and its steps agreeing."""
        path = checkpoint / MANIFEST_NAME
        try:
            raw = read_regular(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
        except OSError as e:
            raise CheckpointError(f"cannot read {path} ({e.strerror})") from None
        manifest = cls.from_json(raw, str(path))
        manifest.check_steps(checkpoint)
        return manifest

    def check_steps(self, checkpoint: Path) -> None:
        """The directory's step (when it is named `step-<N>`), the manifest's step and the engine's
        step count must be one number: a checkpoint that disagrees with itself is damaged."""
        named = STEP_DIR.fullmatch(checkpoint.name)
        count = self.engine.get("step_count")
        if (named is not None and int(named.group(1)) != self.step) or count != self.step:
            raise CheckpointError(
                f"checkpoint {checkpoint.name} is damaged: its manifest says step {self.step} "
                f"and step count {count}, which disagree with each other or the directory "
                "name; use another checkpoint"
            )

    def array_dir(self, checkpoint: Path, key: str) -> Path:
        return checkpoint / STATE_DIR / Path(*key.split("/"))

    def check_compatible(
        self, units: list[Unit], world_size: int, compute_dtype: str, where: str, stage: int = 3
    ) -> None:
        """Refuse, in one sentence, a checkpoint of another model shape, world size, dtype or
        (several ranks) ZeRO stage: its param arrays are laid out for that stage."""
        if world_size != self.world_size:
            raise CheckpointError(
                f"{where} was written by {self.world_size} rank(s) but this run has "
                f"{world_size}; resume with the same number of ranks"
            )
        if world_size > 1 and stage != self.stage:
            raise CheckpointError(
                f"{where} was written at ZeRO stage {self.stage} but this run is at stage "
                f"{stage}; resume with --stage {self.stage}"
            )
        mine = layout_of(units)
        if mine != self.units:
            diff = next(
                (
                    f"unit {a.name}: {a.numel:,} params here, {b.numel:,} there"
                    for a, b in zip(mine, self.units)
                    if a != b
                ),
                f"{len(mine)} units here, {len(self.units)} there",
            )
            raise CheckpointError(
                f"{where} is for another model shape ({diff}); resume with the "
                "model and settings that wrote it"
            )
        if compute_dtype != self.compute_dtype:
            raise CheckpointError(
                f"{where} was trained in {self.compute_dtype} but this run computes in "
                f"{compute_dtype}; resume with --dtype matching it"
            )


def _checksum(doc: dict[str, Any]) -> str:
    """sha256 of the manifest's content as canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(
        json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def _optional_str(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def _rank_rng(value: Any, world_size: int) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != world_size
        or not all(isinstance(v, dict) for v in value)
    ):
        raise ValueError(f"rank_rng must list one RNG state per rank ({world_size})")
    return [dict(v) for v in value]
