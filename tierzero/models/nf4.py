"""NF4: the stored format of a frozen base's linear weights (bitsandbytes' 4-bit NormalFloat).

A LoRA run's base is frozen, so its weights are only ever read: stored in 4 bits they cost
0.5 + 4/64 bytes per value (codes and one fp32 absmax per 64 values) instead of 2 (bf16), on
every tier and on every read. The codes are bitsandbytes' own: `quantize_4bit(w,
quant_type="nf4", blocksize=64)` of the weight in the compute dtype, without double
quantisation (`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`'s defaults),
so adapters trained here see the base that users loading it that way get, bit for bit.

What is quantised: the frozen `weight` of every plain `nn.Linear` inside a block unit (what
bitsandbytes replaces by `Linear4bit`). The embedding, norms, biases and the head stay in the
compute dtype, as do the trainable adapters.

Blocks of 64 values are independent in bitsandbytes' format, so a stretch of a unit's flat
param buffer is coded block by block wherever every quantised weight starts at a multiple of
64 in it and holds a multiple of 64 values (`QuantizedBlocks` checks this): a piece of the
frozen rest, which starts and ends at multiples of 2048, is then stored on its own as

    [ absmax: nq fp32 | codes: nq * 32 uint8 | raw: the other blocks' values, compute dtype ]

where nq is the number of its 64-value blocks inside quantised weights (their codes in block
order, two per byte, the high nibble first, as bitsandbytes packs them) and the raw part holds
every other block (norms, biases, padding) as it is. Decoding is a table lookup times the
block's absmax in fp32, rounded once to the compute dtype: bitsandbytes' `dequantize_4bit`,
bitwise (tests/hf/test_hf_nf4.py). This module only codes values; it moves no bytes.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tierzero.errors import ConfigError
from tierzero.layout.partition import Unit

QUANT_BLOCK = 64  # values per absmax: bitsandbytes' blocksize for NF4
DECODE_BLOCKS = 65536  # blocks decoded at once: 4Mi values, 40 MiB of temporaries
# bitsandbytes' NF4 code values (`get_4bit_type("nf4")`): quantiles of N(0, 1), as fp32
NF4_VALUES = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


def quantizable(unit: Unit, module: nn.Module, attr: str, frozen: bool) -> bool:
    """Whether a parameter is stored in NF4: a frozen plain linear layer's weight in a block
    (a subclass of `nn.Linear` may compute something else: Llama 4's router)."""
    return frozen and unit.kind == "block" and type(module) is nn.Linear and attr == "weight"


class QuantizedBlocks:
    """Which 64-value blocks of a unit's flat param buffer lie in NF4 weights."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit
        self.mask = torch.zeros(-(-unit.padded_numel // QUANT_BLOCK), dtype=torch.bool)
        for slot in unit.slots:
            module, attr = slot.module_attrs[0]
            if not quantizable(unit, module, attr, slot.frozen):
                continue
            if slot.offset % QUANT_BLOCK or slot.numel % QUANT_BLOCK:
                raise ConfigError(
                    f"{slot.names[0]} ({slot.numel} values at {slot.offset} in its unit) "
                    f"does not fill whole blocks of {QUANT_BLOCK} values, so its NF4 codes "
                    "would not be bitsandbytes'; keep this model's base in the compute dtype"
                )
            self.mask[slot.offset // QUANT_BLOCK : slot.end // QUANT_BLOCK] = True

    @property
    def quantized_numel(self) -> int:
        """Values of the unit stored in NF4."""
        return int(self.mask.sum()) * QUANT_BLOCK

    def of(self, lo: int, hi: int) -> torch.Tensor:
        """The blocks of the flat buffer's values [lo, hi) (multiples of 64): True where NF4."""
        assert lo % QUANT_BLOCK == 0 and hi % QUANT_BLOCK == 0, (lo, hi)
        return self.mask[lo // QUANT_BLOCK : hi // QUANT_BLOCK]

    def stored_nbytes(self, lo: int, hi: int, dtype: torch.dtype) -> int:
        """Bytes of the values [lo, hi) as stored (`encode`)."""
        return stored_nbytes(self.of(lo, hi), dtype)


def stored_nbytes(blocks: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes of a stretch whose 64-value blocks are NF4 where `blocks` is True."""
    nq = int(blocks.sum())
    return nq * (4 + QUANT_BLOCK // 2) + (blocks.numel() - nq) * QUANT_BLOCK * dtype.itemsize


def encode(values: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """A stretch of compute-dtype `values` (CPU) as stored: the blocks where `blocks` is True
    quantised by bitsandbytes itself, the others as they are; one uint8 tensor."""
    try:
        from bitsandbytes.functional import quantize_4bit
    except ImportError:
        raise ConfigError("an NF4 base needs bitsandbytes; pip install bitsandbytes") from None
    by_block = values.reshape(-1, QUANT_BLOCK)
    nq = int(blocks.sum())
    out = torch.empty(stored_nbytes(blocks, values.dtype), dtype=torch.uint8)
    absmax, codes, raw = _split(out, nq, values.dtype)
    if nq:
        packed, state = quantize_4bit(
            by_block[blocks].reshape(-1), blocksize=QUANT_BLOCK, quant_type="nf4"
        )
        absmax.copy_(state.absmax)
        codes.copy_(packed.reshape(-1))
    raw.copy_(by_block[~blocks].reshape(-1))
    return out


def decode(stored: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Fill `out` (the stretch's values, compute dtype, on the compute device) from its stored
    bytes: NF4 codes looked up and scaled by their block's absmax in fp32, then rounded to
    `out`'s dtype once, as bitsandbytes' `dequantize_4bit` does."""
    nq = int(blocks.sum())
    absmax, codes, raw = _split(stored, nq, out.dtype)
    by_block = out.view(-1, QUANT_BLOCK)
    pairs = _pair_table(out.device)  # one lookup per byte: its two values, high nibble first
    if nq and nq == blocks.numel():  # the common piece: every block coded, decoded in chunks
        for lo in range(0, nq, DECODE_BLOCKS):  # so its temporaries stay small
            hi = min(lo + DECODE_BLOCKS, nq)
            packed = codes[lo * QUANT_BLOCK // 2 : hi * QUANT_BLOCK // 2]
            by_block[lo:hi].copy_(pairs[packed.int()].view(-1, QUANT_BLOCK) * absmax[lo:hi, None])
        return out
    if nq:
        values = pairs[codes.int()].view(nq, QUANT_BLOCK) * absmax[:, None]
        by_block[blocks.to(out.device)] = values.to(out.dtype)
    by_block[~blocks.to(out.device)] = raw.view(-1, QUANT_BLOCK)
    return out


@functools.lru_cache(maxsize=8)
def _pair_table(device: torch.device) -> torch.Tensor:
    """The two NF4 values of every byte, (256, 2) fp32 on `device`: built once per device."""
    table = torch.tensor(NF4_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack((table[byte >> 4], table[byte & 15]), dim=-1).to(device)


def _split(packed: torch.Tensor, nq: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The absmax (fp32), codes (uint8) and raw values (`dtype`) of a stored stretch, as views."""
    codes_at = 4 * nq
    raw_at = codes_at + nq * QUANT_BLOCK // 2
    return (
        packed[:codes_at].view(torch.float32),
        packed[codes_at:raw_at],
        packed[raw_at:].view(dtype),
    )
