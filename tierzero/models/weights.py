"""Local `.safetensors` weights, read one tensor at a time with plain file reads.

A weights path is a `.safetensors` file or a directory: with a `*.safetensors.index.json`
(the Hugging Face sharded layout) the index's `weight_map` names the files, else every
`*.safetensors` file in it is read. Nothing is downloaded.

Why not `safetensors.safe_open`: it memory-maps each file, and every page a read touches stays in
the process's resident set while the handle is open, so loading a whole model unit by unit would
still grow RSS by the whole model. Here each tensor is `readinto` a fresh buffer from the offsets in
the file's JSON header (8 bytes of little-endian length, then the header; the format
`tierzero.checkpoint.export` writes), so peak host memory is one tensor plus what the caller keeps.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import torch

from tierzero.errors import ConfigError

INDEX_SUFFIX = ".safetensors.index.json"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 << 20


def weight_files(path: str | Path) -> list[Path]:
    """The `.safetensors` files behind `path` (a file, a directory, or a sharded directory with
    an index), or a clear error."""
    p = Path(path)
    if p.is_dir():
        indexes = sorted(p.glob("*" + INDEX_SUFFIX))
        files = _indexed_files(indexes[0]) if len(indexes) == 1 else sorted(p.glob("*.safetensors"))
    else:
        files = [p]
    if not files or not all(f.is_file() and f.suffix == ".safetensors" for f in files):
        raise ConfigError(
            f"weights '{path}' is not a .safetensors file or a directory of them; check the path"
        )
    return files


def _indexed_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(
            f"weights index '{index}' is not a JSON object with a weight_map; "
            "re-save the model with save_pretrained"
        ) from None
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise ConfigError(
            f"weights index '{index}' names {missing[0]}, which is not in "
            f"{index.parent}; copy every shard the index lists"
        )
    return [index.parent / n for n in names]


class _TensorFile:
    """The header of one `.safetensors` file, and reads of single tensors from it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > _MAX_HEADER_BYTES:
                    raise ValueError("header too long")
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error):
            raise ConfigError(
                f"weights file '{path}' is not a readable .safetensors file; "
                "re-save it with safetensors"
            ) from None
        self.data_start = 8 + length
        self.entries = {k: v for k, v in header.items() if k != "__metadata__"}

    def holds(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        dtype = _DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ConfigError(
                f"weights file '{self.path}' stores '{name}' as {entry.get('dtype')}, "
                "which tierzero does not load; convert it to F32, F16 or BF16"
            )
        shape = tuple(entry["shape"])
        start, end = entry["data_offsets"]
        out = torch.empty(shape, dtype=dtype)
        if end - start != out.numel() * out.element_size():
            raise ConfigError(
                f"weights file '{self.path}' is damaged: '{name}' has {end - start} bytes "
                f"for shape {shape}; re-save it"
            )
        if out.numel():
            with open(self.path, "rb") as f:
                f.seek(self.data_start + start)
                if f.readinto(memoryview(out.view(-1).view(torch.uint8).numpy())) != end - start:
                    raise ConfigError(f"weights file '{self.path}' is truncated; re-save it")
        return out


class WeightFiles:
    """Tensors by name across local `.safetensors` files, read one tensor at a time."""

    def __init__(self, path: str | Path) -> None:
        if sys.byteorder != "little":  # safetensors is little-endian; reads are raw bytes
            raise ConfigError(
                "reading .safetensors needs a little-endian machine; use x86-64 or ARM64"
            )
        self._where: dict[str, _TensorFile] = {}
        for f in weight_files(path):
            tensors = _TensorFile(f)
            self._where.update({k: tensors for k in tensors.entries})

    def names(self) -> set[str]:
        return set(self._where)

    def holds(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` as stored (its dtype and shape)."""
        return self._where[name].read(name)

    def load(self, names: tuple[str, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The first of `names` the files hold, as fp32, checked against `shape`."""
        for name in names:
            if name in self._where:
                stored = tuple(self._where[name].entries[name]["shape"])
                if stored != shape:
                    raise ConfigError(
                        f"weights have '{name}' of shape {stored} but the model "
                        f"expects {shape}; load weights made for this model"
                    )
                return self._where[name].read(name).float()
        raise ConfigError(
            f"weights have no tensor named {' or '.join(names)}; load weights made for this model"
        )
