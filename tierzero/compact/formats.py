"""`StateFormats`: how master weights and Adam moments are stored, piece by piece, on every tier.

The one place that knows a stored piece's dtype and byte size. fp32 master and moments (the
default) are fp32 tensors, stepped by torch's AdamW. bf16 ones are bf16 tensors of the
piece's numel. An int8 moment piece is one uint8 tensor, so every tier, transfer, kept
generation and checkpoint moves it as one array like any other piece:

    [ scales: nblocks fp32, little-endian | codes: numel uint8 ]

`nblocks = ceil(numel / STATE_BLOCK)`; block k covers the piece's values
[k * STATE_BLOCK, (k + 1) * STATE_BLOCK) and code i stands for `code_map(signed)[i] * scales[k]`
(`tierzero.compact.codes`; signed for exp_avg, unsigned for exp_avg_sq). The scales come first
so their fp32 view is aligned whatever the piece's numel. On NVMe the array's zarr attributes
name this layout (`layout`: the scales' and codes' dtype, offset and count, the block and the
code map), so zarr 3 alone can decode a piece. With bf16 compute a bf16 master is not stored
at all: it is the param (`master_is_param`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tierzero.compact import codes as codes_mod
from tierzero.config import STATE_BLOCK, TORCH_DTYPES, DType, FormatSettings, StateFormat, StateKind
from tierzero.storage.base import aligned_empty

MOMENTS = (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
# what an int8 moment's codes are: checkpoints record it, and refuse another (`checkpointing`)
INT8_CODES = "blockwise 8-bit floats, 4 mantissa bits"


@dataclass(frozen=True)
class StateFormats:
    moments: StateFormat = StateFormat.FP32
    master: DType = DType.FP32
    grad: DType = DType.FP32  # planned, not configured: `tierzero.planning.statebytes.grad_dtype`

    def __post_init__(self) -> None:  # the spellings of the config's fields, as enums
        object.__setattr__(self, "moments", StateFormat(self.moments))
        object.__setattr__(self, "master", DType(self.master))
        object.__setattr__(self, "grad", DType(self.grad))

    @classmethod
    def of(cls, settings: FormatSettings, grad: DType = DType.FP32) -> StateFormats:
        return cls(settings.optimizer_state, settings.master, grad)

    @property
    def exact(self) -> bool:
        """fp32 master and moments: the step is torch's AdamW, bitwise."""
        return self.moments is StateFormat.FP32 and self.master is DType.FP32

    def master_is_param(self, compute_dtype: torch.dtype) -> bool:
        """bf16 master and bf16 compute: the param is the master, stored once (no master key)."""
        return self.master is DType.BF16 and compute_dtype == torch.bfloat16

    def describe(self) -> dict[str, str]:
        return {"optimizer_state": self.moments.value, "master": self.master.value}

    def quantised(self, kind: StateKind) -> bool:
        return kind in MOMENTS and self.moments is StateFormat.INT8

    def dtype(self, kind: StateKind) -> torch.dtype:
        """The stored dtype of a piece of `kind` (params are not stored in pieces here)."""
        if kind is StateKind.MASTER:
            return TORCH_DTYPES[self.master]
        if kind in MOMENTS:
            return {
                StateFormat.FP32: torch.float32,
                StateFormat.BF16: torch.bfloat16,
                StateFormat.INT8: torch.uint8,
            }[self.moments]
        assert kind is StateKind.GRAD, kind
        return TORCH_DTYPES[self.grad]

    def stored_numel(self, kind: StateKind, numel: int) -> int:
        """Elements of the stored tensor of a piece of `numel` values."""
        return 4 * codes_mod.nblocks(numel) + numel if self.quantised(kind) else numel

    def nbytes(self, kind: StateKind, numel: int) -> int:
        return self.stored_numel(kind, numel) * self.dtype(kind).itemsize

    def view(self, kind: StateKind, raw: torch.Tensor, numel: int) -> torch.Tensor:
        """The stored tensor of a piece of `numel` values over `raw` bytes (a leased buffer)."""
        return raw.view(torch.uint8)[: self.nbytes(kind, numel)].view(self.dtype(kind))

    def empty(self, kind: StateKind, numel: int) -> torch.Tensor:
        """A 4 KiB-aligned CPU tensor for one stored piece."""
        return aligned_empty(self.stored_numel(kind, numel), self.dtype(kind))

    def encode(self, kind: StateKind, values: torch.Tensor) -> torch.Tensor:
        """fp32 `values` (one piece, CPU) as stored: rounded to the nearest for bf16, quantised for
        int8."""
        out = self.empty(kind, values.numel())
        if not self.quantised(kind):
            return out.copy_(values)
        scales, codes = split(out, values.numel())
        scratch = codes_mod.Scratch(values.numel(), values.device)
        codes_mod.quantise(values.float(), kind is StateKind.EXP_AVG, codes, scales, scratch)
        return out

    def layout(self, key: str, stored: torch.Tensor) -> dict | None:
        """The zarr `layout` attribute of the stored piece under `key` (`NvmeStore(layout=...)`):
        an int8 moment's scales and codes; None for any other array (its dtype says it all)."""
        kind = next((k for k in MOMENTS if key.startswith(f"{k.value}/")), None)
        if kind is None or not self.quantised(kind) or stored.dtype != torch.uint8:
            return None
        return _int8_layout(kind is StateKind.EXP_AVG, stored.numel())

    def decode(self, kind: StateKind, stored: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Fill fp32 `out` (one piece's values) from its stored tensor."""
        if not self.quantised(kind):
            return out.copy_(stored)
        scales, codes = split(stored, out.numel())
        scratch = codes_mod.Scratch(out.numel(), out.device)
        codes_mod.dequantise(codes, scales, kind is StateKind.EXP_AVG, out, scratch)
        return out


@functools.lru_cache(maxsize=64)  # a few piece sizes; the dict is only serialised, never changed
def _int8_layout(signed: bool, nbytes: int) -> dict:
    """`StateFormats.layout` of an int8 moment piece of `nbytes` packed bytes."""
    blocks = -(-nbytes // (STATE_BLOCK + 4))  # numel + 4 bytes per started block
    return {
        "packs": INT8_CODES,
        "block": STATE_BLOCK,
        "scales": {"data_type": "float32", "endian": "little", "offset": 0, "count": blocks},
        "codes": {"data_type": "uint8", "offset": 4 * blocks, "count": nbytes - 4 * blocks},
        "code_map": {"signed": signed, "values": codes_mod.code_map(signed).tolist()},
        "value": "code_map.values[codes[i]] * scales[i // block]",
    }


def split(packed: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 moment piece's scales (fp32) and codes (uint8) as views of its packed bytes."""
    head = 4 * codes_mod.nblocks(numel)
    return packed[:head].view(torch.float32), packed[head : head + numel]
