"""Export: a checkpoint's fp32 master weights as safetensors, streamed one unit at a time.

The output is what `safetensors.torch.load_file` reads and `model.load_state_dict` takes:
every parameter under each of its names (tied aliases are written once per name, as
`model.state_dict()` lists them; safetensors refuses shared storage, so the bytes repeat).

Why a writer of our own: `safetensors.torch.save_file` needs every tensor in memory at once,
and the point of a checkpoint is that the model may not fit. The format is simple enough to
stream (`tierzero.checkpoint.safetensors_out`). The manifest gives every shape upfront, so
headers and file boundaries are decided before a byte of data is read (`plan_export`, a
value), and the writer then reads
each unit's master shards from every rank into one reused flat buffer and appends its tensors.
Peak host memory is the largest unit's flat fp32 buffer plus one tensor in bf16 (plus, for
tensors save_pretrained computes from a fused one, that one parameter's saved tensors).

A checkpoint of a Hugging Face model (`--model hf:<dir>`) records the model's `config.json`
in its manifest; export writes it back next to the weights (its dtype set to the export's),
so the directory loads with `from_pretrained`: its tensors named and laid out as
`save_pretrained` writes them (a Mixture-of-Experts layer's experts one tensor each, as on the
hub; `tierzero.checkpoint.hf_format`), or with `tensors="model"` as the model holds them
(fused experts), which `from_pretrained` loads too; the tokenizer files
of the directory the run started from are copied beside them. A LoRA (peft) run exports a peft
adapter, or with `merge` its merged base (`tierzero.checkpoint.lora`).

Durability: every file is written under a temporary name in the destination directory,
fsynced, and renamed into place only after all of them are complete (the sharded layout's
`.index.json` last), so a failure or Ctrl-C leaves no half-written output behind.
This module never prints; the CLI reports progress through `on_unit`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tierzero.checkpoint.catalog import find_checkpoint
from tierzero.checkpoint.files import remove_stale_temps
from tierzero.checkpoint.hf_files import copy_tokenizer, hf_config, write_json
from tierzero.checkpoint.hf_format import Converted, SavedFormat, meta_model
from tierzero.checkpoint.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_config,
    adapter_entries,
    merged_entries,
    peft_adapters,
)
from tierzero.checkpoint.manifest import Manifest, UnitLayout
from tierzero.checkpoint.nf4_read import coded_units, read_coded
from tierzero.checkpoint.safetensors_out import (
    DTYPES,
    ExportFile,
    ExportPlan,
    StreamingWriter,
    TensorEntry,
)
from tierzero.config import StateKind
from tierzero.errors import CheckpointError, ConfigError, TierzeroError
from tierzero.layout.keys import shard_key
from tierzero.storage.base import StorageError
from tierzero.storage.nvme.arrays import read_array

# a Hugging Face model's tensors as save_pretrained writes them, or as it holds them
TENSORS = ("saved", "model")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # the Hugging Face default for save_pretrained
SUFFIX = ".safetensors"


@dataclass
class ExportResult:
    step: int
    checkpoint: Path
    dtype: str
    files: list[Path]
    index: Path | None
    tensors: int
    nbytes: int
    # config.json (a peft adapter's adapter_config.json) beside the weights
    config: Path | None = None
    tokenizer: list[Path] = field(default_factory=list)  # its tokenizer files, copied beside them
    skipped: list[str] = field(default_factory=list)  # newer checkpoints passed over, each with why


def manifest_entries(manifest: Manifest) -> list[TensorEntry]:
    """Every tensor of the checkpoint under each of its names, in unit order."""
    entries = []
    for unit in manifest.units:
        for slot in unit.slots:
            if (
                math.prod(slot.shape) != slot.numel
                or slot.offset < 0
                or slot.offset + slot.numel > unit.padded_numel
            ):
                raise CheckpointError(
                    f"checkpoint step {manifest.step} lays out {slot.names[0]} as {slot.numel} "
                    f"values of shape {slot.shape} at offset {slot.offset} of a "
                    f"{unit.padded_numel}-value unit: its manifest is damaged; "
                    "export another step with --step"
                )
            entries += [
                TensorEntry(name, unit.index, slot.offset, slot.numel, tuple(slot.shape))
                for name in slot.names
            ]
    return entries


def plan_export(
    manifest: Manifest,
    out_name: str,
    dtype: str = "fp32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    entries: list[TensorEntry] | None = None,
) -> ExportPlan:
    """Lay `entries` (default: the checkpoint's tensors) out in unit order and cut files at
    `max_shard_bytes` (a tensor larger than that gets a file of its own). One file keeps `out_name`;
    several are named `<stem>-00001-of-0000K.safetensors` beside `<stem>.safetensors.index.json`."""
    itemsize = DTYPES[dtype][0].itemsize
    groups: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in manifest_entries(manifest) if entries is None else entries:
        nbytes = entry.numel * itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    stem = out_name[: -len(SUFFIX)]
    names = (
        [out_name]
        if len(groups) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(groups):05d}{SUFFIX}" for i in range(len(groups))]
    )
    files = [ExportFile(n, g, sum(e.numel for e in g) * itemsize) for n, g in zip(names, groups)]
    index = None if len(files) == 1 else f"{stem}{SUFFIX}.index.json"
    return ExportPlan(manifest.step, dtype, files, index)


def export_checkpoint(
    run_dir: str | Path,
    out: str | Path,
    step: int | None = None,
    dtype: str = "fp32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    on_unit: Callable[[int, int], None] | None = None,
    merge: bool = False,
    tensors: str = "saved",
) -> ExportResult:
    """Write the checkpoint at `step` (default: the newest complete one) of `run_dir` as
    safetensors at `out` (a `.safetensors` path, or a directory for `model.safetensors`); a LoRA
    run's as a peft adapter directory, or with `merge` as its base model with the adapter merged
    in (`tierzero.checkpoint.lora`). A Hugging Face model's tensors are laid out as
    `save_pretrained` writes them (`tensors` "saved": a Mixture-of-Experts layer's experts one
    tensor each, `tierzero.checkpoint.hf_format`) or as the model holds them ("model": fused).
    `on_unit(done, total)` is called after each unit."""
    _check_options(dtype, max_shard_bytes, tensors)
    out_dir, out_name = _destination(Path(out))
    checkpoint, manifest, skipped = find_checkpoint(run_dir, step)
    entries = manifest_entries(manifest)
    adapters = peft_adapters(manifest.origin.model, [e.name for e in entries])
    if merge and adapters is None:
        raise ConfigError(
            "--merge merges a LoRA run's adapter into its base, and this run has none; drop --merge"
        )
    extra: tuple[str, dict] | None = hf_config(manifest, dtype)
    if adapters is not None:
        [(adapter, peft_config)] = adapters.items()
        entries = (
            merged_entries(entries, adapter, peft_config)
            if merge
            else adapter_entries(entries, adapter)
        )
        if not merge:
            if out_name != "model" + SUFFIX:
                raise ConfigError(
                    f"a LoRA run exports a peft adapter directory; give --out a directory, not "
                    f"'{out_name}' (or add --merge for whole merged weights)"
                )
            out_name = ADAPTER_WEIGHTS
            extra = (
                ADAPTER_CONFIG,
                adapter_config(peft_config, (manifest.origin.model or {}).get("hf")),
            )
    # whole Hugging Face weights: laid out as `save_pretrained` writes them
    if tensors == "saved" and extra is not None and extra[0] == "config.json":
        entries = SavedFormat(meta_model(extra[1])).saved(entries, _converted_entry)
    plan = plan_export(manifest, out_name, dtype, max_shard_bytes, entries)
    _make_dir(out_dir)
    remove_stale_temps(out_dir)  # an export killed before it could remove its own
    writer = StreamingWriter(out_dir, plan, {"format": "pt", "step": str(manifest.step)})
    written = writer.write(read_units(checkpoint, manifest), len(manifest.units), on_unit)
    tensors = sum(len(f.entries) for f in plan.files)
    index = out_dir / plan.index_name if plan.index_name else None
    config = write_json(out_dir, *extra) if extra is not None else None
    tokenizer = copy_tokenizer(out_dir, manifest)
    return ExportResult(
        manifest.step,
        checkpoint,
        dtype,
        written,
        index,
        tensors,
        plan.total_bytes,
        config,
        tokenizer,
        skipped,
    )


def _check_options(dtype: str, max_shard_bytes: int, tensors: str) -> None:
    """Refuse bad options, and a machine whose bytes export cannot write, before reading
    anything."""
    if tensors not in TENSORS:
        raise ConfigError(
            f"--tensors '{tensors}' is not a layout of exported tensors; "
            f"choose one of {'|'.join(TENSORS)}"
        )
    if dtype not in DTYPES:
        raise ConfigError(
            f"--dtype '{dtype}' is not an export dtype; choose one of {'|'.join(DTYPES)}"
        )
    if max_shard_bytes <= 0:
        raise ConfigError(f"--max-shard-size must be positive, got {max_shard_bytes}")
    if sys.byteorder != "little":  # safetensors is little-endian; we write host bytes as they are
        raise TierzeroError(
            "export writes host bytes as they are and needs a little-endian machine; "
            "run it on x86-64 or ARM64"
        )


def _converted_entry(
    name: str, unit: int, shape: tuple[int, ...], converted: Converted
) -> TensorEntry:
    return TensorEntry(name, unit, -1, math.prod(shape), shape, converted=converted)


def _destination(out: Path) -> tuple[Path, str]:
    """The directory and file name `--out` names: an existing directory or a name without a
    suffix (a directory, created at the end with its parents) takes `model.safetensors`."""
    if out.is_dir() or (not out.suffix and not out.exists()):
        return out, "model" + SUFFIX
    if not out.name.endswith(SUFFIX) or out.name == SUFFIX:
        raise TierzeroError(
            f"--out '{out}' is not a {SUFFIX} file name; name one like "
            f"model{SUFFIX} or give a directory"
        )
    if not out.parent.is_dir():
        raise TierzeroError(f"the directory of --out '{out}' does not exist; create it first")
    return out.parent, out.name


def _make_dir(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TierzeroError(
            f"cannot create --out directory {out_dir} ({e.strerror or e}); choose a writable --out"
        ) from None


def read_units(checkpoint: Path, manifest: Manifest) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (unit index, flat fp32 buffer) per unit: every rank's master shard end to end (and
    its param shard under it where the unit has frozen parameters, which have no master, or bf16
    ones that are their master; at stages 1 and 2, rank 0's whole param), each chunk checked
    against the manifest's crc32c. One buffer, sized for the largest unit, is reused: finish with
    a unit before the next."""
    buffer = torch.empty(max(u.padded_numel for u in manifest.units), dtype=torch.float32)
    master = not (
        manifest.compute_dtype == "bfloat16" and (manifest.engine or {}).get("master") == "bf16"
    )
    coded = coded_units(manifest)  # an NF4 base's blocks: their params decoded
    for unit in manifest.units:
        flat = buffer[: unit.padded_numel]
        shard = unit.padded_numel // manifest.world_size
        # rank 0's params are whole units
        replicated = manifest.world_size > 1 and manifest.stage <= 2
        if replicated and (unit.trainable_numel < unit.padded_numel or not master):
            _read_shard(checkpoint, manifest, unit, 0, flat, StateKind.PARAM)
        for rank in range(manifest.world_size):
            out = flat[rank * shard : (rank + 1) * shard]
            trained = min(shard, max(0, unit.trainable_numel - rank * shard)) if master else 0
            if unit.index in coded:
                read_coded(checkpoint, manifest, coded[unit.index], out)
            elif trained < shard and not replicated:
                _read_shard(checkpoint, manifest, unit, rank, out, StateKind.PARAM)
            if trained:
                _read_shard(checkpoint, manifest, unit, rank, out[:trained], StateKind.MASTER)
        yield unit.index, flat


def _read_shard(
    checkpoint: Path,
    manifest: Manifest,
    unit: UnitLayout,
    rank: int,
    out: torch.Tensor,
    kind: StateKind,
) -> None:
    """One rank's shard of `kind`: one array, or (as the engine stores it) one array per piece."""
    key = shard_key(kind, unit.index, rank)
    pieces = sorted(k for k in manifest.arrays if k.startswith(key + "/p"))
    if not pieces:
        _read_array(checkpoint, manifest, key, out)
        return
    start = 0
    for piece in pieces:
        numel = manifest.arrays[piece].numel
        _read_array(checkpoint, manifest, piece, out[start : start + numel])
        start += numel
    if start != out.numel():
        raise CheckpointError(
            f"checkpoint {checkpoint.name}'s pieces of {key} hold {start} values where the "
            f"layout needs {out.numel()}: it is damaged; export another step with --step"
        )


def _read_array(checkpoint: Path, manifest: Manifest, key: str, out: torch.Tensor) -> None:
    """Read a master (fp32 or bf16) or param array into fp32 `out`, through a buffer where it is
    not fp32."""
    meta = manifest.arrays.get(key)
    if meta is None:
        raise CheckpointError(
            f"checkpoint {checkpoint.name} has no array {key}: it is damaged; "
            "export another step with --step"
        )
    master = key.startswith(StateKind.MASTER.value + "/")
    if (
        (master and meta.dtype not in (torch.float32, torch.bfloat16))
        or not meta.dtype.is_floating_point
        or meta.numel != out.numel()
    ):
        raise CheckpointError(
            f"checkpoint {checkpoint.name} array {key} holds {meta.numel} "
            f"{meta.dtype} values where the layout needs {out.numel()} "
            f"{'float32 or bfloat16' if master else 'floating-point'}: it is damaged; "
            "export another step with --step"
        )
    try:
        if meta.dtype == out.dtype:
            read_array(str(manifest.array_dir(checkpoint, key)), meta, out=out)
        else:
            out.copy_(read_array(str(manifest.array_dir(checkpoint, key)), meta))
    except StorageError as e:
        raise CheckpointError(
            f"checkpoint {checkpoint.name} is damaged: {e}; export another step with --step"
        ) from None
