"""The safetensors files an export writes: their plan (which tensors go in which file, at what
offsets: a value decided from the manifest before any I/O) and the writer that streams each
unit's tensors into them under temporary names, publishing them only once all are complete.

The format: 8 bytes of little-endian header length, a JSON header (dtype, shape and
data_offsets per tensor, plus `__metadata__`) padded with spaces to a multiple of 8, then the
raw little-endian bytes in header order (`tierzero.checkpoint.export` says why we stream it).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from tierzero.checkpoint.hf_format import Converted
from tierzero.checkpoint.lora import Merge
from tierzero.errors import TierzeroError

# --dtype spelling -> (torch dtype, safetensors dtype code)
DTYPES = {"fp32": (torch.float32, "F32"), "bf16": (torch.bfloat16, "BF16")}


@dataclass(frozen=True)
class TensorEntry:
    """One output tensor: where its values sit in its unit's flat buffer."""

    name: str
    unit: int
    offset: int
    numel: int
    shape: tuple[int, ...]
    merge: Merge | None = None  # a LoRA-wrapped weight exported with its adapter merged in
    # a tensor save_pretrained computes from others (one expert's)
    converted: Converted | None = None

    def values(self, flat: torch.Tensor) -> torch.Tensor:
        """This tensor's values, flat, from its unit's flat buffer."""
        if self.converted is not None:
            return self.converted.take(self.name, flat).reshape(-1)
        values = flat[self.offset : self.offset + self.numel]
        return (
            values
            if self.merge is None
            else self.merge.apply(values.view(self.shape), flat).reshape(-1)
        )


@dataclass
class ExportFile:
    """One output file and the tensors it holds, in the order their bytes follow the header."""

    name: str
    entries: list[TensorEntry] = field(default_factory=list)
    data_bytes: int = 0

    def header(self, code: str, itemsize: int, metadata: dict[str, str]) -> bytes:
        """The length prefix and the space-padded JSON header (its length a multiple of 8)."""
        doc: dict[str, object] = {"__metadata__": metadata}
        start = 0
        for e in self.entries:
            end = start + e.numel * itemsize
            doc[e.name] = {"dtype": code, "shape": list(e.shape), "data_offsets": [start, end]}
            start = end
        raw = json.dumps(doc, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw


@dataclass
class ExportPlan:
    """Every output file, its tensors and sizes, decided from the manifest before any I/O."""

    step: int
    dtype: str
    files: list[ExportFile]
    index_name: str | None  # set when the export is split into several files

    @property
    def total_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)

    def index_json(self) -> bytes:
        weight_map = {e.name: f.name for f in self.files for e in f.entries}
        return json.dumps(
            {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, indent=2
        ).encode()


class StreamingWriter:
    """Appends tensors to the plan's files in order, each under a temp name until all are done."""

    def __init__(self, out_dir: Path, plan: ExportPlan, metadata: dict[str, str]) -> None:
        self.out_dir = out_dir
        self.plan = plan
        self.metadata = metadata
        self.dtype, self.code = DTYPES[plan.dtype]
        self.temps: list[Path] = []

    def write(
        self,
        units: Iterator[tuple[int, torch.Tensor]],
        total: int,
        on_unit: Callable[[int, int], None] | None,
    ) -> list[Path]:
        by_unit: dict[int, list[tuple[int, TensorEntry]]] = {}
        for i, f in enumerate(self.plan.files):
            for e in f.entries:
                by_unit.setdefault(e.unit, []).append((i, e))
        handle: BinaryIO | None = None
        current = -1
        try:
            for done, (index, flat) in enumerate(units, start=1):
                for file_index, entry in by_unit.get(index, []):
                    if file_index != current:
                        if handle is not None:
                            self._finish(handle, current)
                        current, handle = file_index, self._start(file_index)
                    self._append(handle, entry.values(flat), current)
                if on_unit is not None:
                    on_unit(done, total)
            if handle is not None:
                self._finish(handle, current)
                handle = None
            return self._publish()
        except BaseException:  # Ctrl-C included: leave nothing half-written behind
            if handle is not None:
                handle.close()
            for temp in self.temps:
                temp.unlink(missing_ok=True)
            raise

    def _temp(self, name: str) -> Path:
        return self.out_dir / f".{name}.{os.getpid()}.tmp"

    def _start(self, file_index: int) -> BinaryIO:
        f = self.plan.files[file_index]
        temp = self._temp(f.name)
        try:
            handle = open(temp, "wb")
        except OSError as e:
            raise self._error(f.name, e) from None
        self.temps.append(temp)
        self._io(handle.write, f.header(self.code, self.dtype.itemsize, self.metadata), file_index)
        return handle

    def _append(self, handle: BinaryIO, values: torch.Tensor, file_index: int) -> None:
        if self.dtype != values.dtype:
            values = values.to(self.dtype)  # round to nearest even, as torch's .to() does
        self._io(handle.write, memoryview(values.view(torch.uint8).numpy()), file_index)

    def _finish(self, handle: BinaryIO, file_index: int) -> None:
        self._io(handle.flush, None, file_index)
        self._io(os.fsync, handle.fileno(), file_index)
        handle.close()

    def _io(self, call: Callable, arg: object, file_index: int) -> None:
        try:
            call() if arg is None else call(arg)
        except OSError as e:
            raise self._error(self.plan.files[file_index].name, e) from None

    def _error(self, name: str, e: OSError) -> TierzeroError:
        return TierzeroError(
            f"cannot write {self.out_dir / name} ({e.strerror or e}); choose a "
            "writable --out with enough free space"
        )

    def _publish(self) -> list[Path]:
        """Rename every file into place, the index last, then make the renames durable."""
        finals = [self.out_dir / f.name for f in self.plan.files]
        if self.plan.index_name is not None:
            temp = self._temp(self.plan.index_name)
            self.temps.append(temp)
            try:
                with open(temp, "wb") as handle:
                    handle.write(self.plan.index_json())
                    handle.flush()
                    os.fsync(handle.fileno())
            except OSError as e:
                raise self._error(self.plan.index_name, e) from None
        targets = finals + ([self.out_dir / self.plan.index_name] if self.plan.index_name else [])
        assert len(targets) == len(self.temps), "every planned file was started, in order"
        for temp, final in zip(self.temps, targets):
            os.replace(temp, final)
        fd = os.open(self.out_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return finals
