"""The weights `tierzero generate` runs on: an `Engine` of frozen parameters, filled from a Hugging
Face directory's safetensors or from a run directory's newest intact checkpoint.

Generation needs the weights alone, so every parameter is frozen: the engine stores each unit's
params in the compute dtype in the tier the placement gives them (no grad, master weight or
Adam moment exists) and streams them through the same swap plan as a training forward. A run
directory is read as `export` reads it (`tierzero.checkpoint.export.read_units`: the master
weights, and the params of frozen ones such as a LoRA base, an NF4 base decoded to the values
the run computed with, every chunk checked), one unit at a time as the engine materialises
that unit, so the model is never whole in host memory and a run trained on any number of ranks
generates on one. The model is the run's own config.toml's:
the preset, or the `hf:` directory with its LoRA adapters when the run trained them (generation
runs base + adapters, as training did). The run's own files are only read: the engine's NVMe
store is a fresh temporary directory (inside the run directory by default, on the disk its
state is on), removed on close.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tierzero.checkpoint.catalog import find_checkpoint
from tierzero.checkpoint.export import read_units
from tierzero.checkpoint.manifest import Manifest
from tierzero.config import Config, RunConfig
from tierzero.configfile import load_run_config
from tierzero.errors import CheckpointError, ConfigError
from tierzero.hf import is_hf
from tierzero.precision import check_dtype_supported, resolve_dtype
from tierzero.run.directory import CONFIG_NAME, never_configured
from tierzero.run.generate import Decoder
from tierzero.run.model_load import RunModel, run_model
from tierzero.run.prompts import Codec, Framing, framing_of

if TYPE_CHECKING:
    from tierzero.engine import Engine

STORE_PREFIX = "tierzero-generate-"


@dataclass
class Inference:
    """An open engine's decoder, the model's text, and what the caller should say about them."""

    decoder: Decoder
    codec: Codec
    model: str
    framing: Framing  # how the run's data framed its text: plain prompts are framed so
    step: int | None = None  # the checkpoint's step (None: a model directory's own weights)
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def open_inference(
    model: str | None = None,
    run_dir: str | Path | None = None,
    engine: dict[str, Any] | None = None,
    store: str | Path | None = None,
) -> Iterator[Inference]:
    """An engine over `model` (hf:DIR) or `run_dir`'s newest intact checkpoint; `engine`
    overrides its Config keys (offload, budgets, dtype, device); `store` is where its NVMe
    store's temporary directory is made (default: the run directory, or the system's temp)."""
    overrides = {k: v for k, v in (engine or {}).items() if v is not None}
    run, checkpoint = _source(model, run_dir, overrides)
    folder = _store_dir(store, run_dir)
    try:
        run = run.replace(nvme_path=[str(folder)])
        loaded = run_model(run)
        with _frozen_engine(run, loaded, checkpoint) as eng:
            step, skipped = (checkpoint[1].step, checkpoint[2]) if checkpoint else (None, [])
            framing = framing_of(run.corpus.data) if checkpoint is not None else Framing.TEXT
            notes = [*loaded.notes, *skipped, *eng.notes()]
            yield Inference(
                Decoder.through(eng), Codec.for_model(loaded), run.model, framing, step, notes
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


Found = tuple[Path, Manifest, list[str]]  # a checkpoint, its manifest, newer ones skipped and why


def _source(
    model: str | None, run_dir: str | Path | None, overrides: dict[str, Any]
) -> tuple[RunConfig, Found | None]:
    """The run to build (a model directory's, or a run directory's own) and its checkpoint,
    found and verified once the cheap checks (the device) have passed."""
    if (model is None) == (run_dir is None):
        raise ConfigError("generate from one model: pass --model hf:DIR or --run-dir DIR")
    if model is not None:
        if not is_hf(model):
            raise ConfigError(
                f"--model '{model}' is not hf:DIR; a built-in model generates from its "
                "run's checkpoint: pass --run-dir DIR"
            )
        run = RunConfig(model=model, engine=Config(**overrides))
        _check_device(run.engine)
        return run, None
    run = _run_config(Path(run_dir), overrides)
    _check_device(run.engine)
    return run, find_checkpoint(run_dir, verify=True)


def _check_device(config: Config) -> None:
    """Refuse a device this torch cannot use, or a dtype it cannot compute in, in one line."""
    if config.tiering.device is not None:
        try:
            device = torch.device(config.tiering.device)
        except RuntimeError:
            raise ConfigError(
                f"--device '{config.tiering.device}' is not a device; write cpu or cuda:0"
            ) from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"--device {config.tiering.device} needs a GPU this torch can see, and it sees "
                "none; drop --device to run on the CPU"
            )
    device = config.tiering.resolved_device()
    check_dtype_supported(resolve_dtype(config.precision.dtype, device), device)


def _store_dir(store: str | Path | None, run_dir: str | Path | None) -> Path:
    """A fresh directory for the engine's NVMe store."""
    base = Path(store or run_dir or tempfile.gettempdir())
    try:
        return Path(tempfile.mkdtemp(prefix=STORE_PREFIX, dir=base))
    except OSError as e:
        raise ConfigError(
            f"cannot make the generation's store directory in {base} ({e.strerror}); "
            "pass a writable --nvme-path"
        ) from None


def _frozen_engine(run: RunConfig, loaded: RunModel, checkpoint: Found | None) -> Engine:
    """The run's model on meta with every parameter frozen (params only: nothing is trained),
    filled from its directory's weights or, unit by unit, from `checkpoint`."""
    from tierzero.engine import Engine

    meta = loaded.on_meta().requires_grad_(False)
    if checkpoint is None:
        return Engine(meta, run.engine, weights=loaded.engine_weights)
    path, manifest, _ = checkpoint
    meta.init_unit = CheckpointUnits(meta, path, manifest)
    eng = Engine(meta, run.engine)
    if len(eng.units) != len(manifest.units):
        raise CheckpointError(
            f"checkpoint step {manifest.step} holds {len(manifest.units)} units but the "
            f"model {run.model} of {CONFIG_NAME} makes {len(eng.units)}; was the run's "
            "config.toml changed?"
        )
    return eng


def _run_config(run_dir: Path, overrides: dict[str, Any]) -> RunConfig:
    """The run's config.toml, with generation's engine keys over it."""
    if not run_dir.is_dir():
        raise CheckpointError(
            f"run directory '{run_dir}' does not exist; pass the directory `tierzero train` "
            "wrote with --run-dir"
        )
    if (why := never_configured(run_dir)) is not None or not (run_dir / CONFIG_NAME).is_file():
        raise CheckpointError(
            why
            or f"'{run_dir}' has no {CONFIG_NAME}, so it is no run directory; pass the "
            "directory `tierzero train` wrote with --run-dir"
        )
    run = load_run_config(run_dir / CONFIG_NAME)
    # the step's formats and schedule mean nothing to frozen params; the run's budgets do
    # a placement the run named gives way to an offload given here (generate's default: auto)
    placement = None if "offload" in overrides else run.engine.tiering.placement
    run = run.replace(
        optimizer_state="fp32",
        master="fp32",
        # an NF4 base is read decoded (`read_units`): the values the run computed with, kept
        # in the compute dtype; coding it again would code the frozen adapters too
        quantize_base="none",
        accumulate=1,
        piece_numel=None,
        placement=placement,
        **overrides,
    )
    return run


class CheckpointUnits:
    """A model's `init_unit(seed, which)` that fills the unit from a checkpoint (seed unused):
    the engine materialises units in order, and the checkpoint is read in that order, one unit's
    fp32 values at a time, each parameter copied in by name."""

    def __init__(self, model: nn.Module, checkpoint: Path, manifest: Manifest) -> None:
        self.model = model
        self.manifest = manifest
        self.units = read_units(checkpoint, manifest)

    def __call__(self, seed: int, which: int | str) -> None:
        last = len(self.manifest.units) - 1
        index = (
            {"embedding": 0, "root": 0, "head": last}.get(which)
            if isinstance(which, str)
            else which + 1
        )
        # the units before `index` had nothing to take (a root's blocks)
        flat = next((flat for read, flat in self.units if read == index), None)
        if flat is None:
            raise CheckpointError(
                f"checkpoint step {self.manifest.step} has no unit {index} for the model's "
                f"{which}; was the run's config.toml changed?"
            )
        with torch.no_grad():
            for slot in self.manifest.units[index].slots:
                value = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
                for name in slot.names:
                    try:
                        param = self.model.get_parameter(name)
                    except AttributeError:
                        raise CheckpointError(
                            f"checkpoint step {self.manifest.step} holds '{name}', which the "
                            "model of the run's config.toml does not have"
                        ) from None
                    param.copy_(value)
