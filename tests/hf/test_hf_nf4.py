"""The NF4 format of a frozen base (`tierzero.models.nf4`) against bitsandbytes itself.

A small saved LLaMA under peft's LoRA (its base frozen), partitioned into units as the engine
does. Each block unit's flat param buffer, in fp32 and bf16, is coded piece by piece (pieces of
4096 values, so pieces cut through weights and hold norms and padding too) and decoded: every
quantised weight comes back bitwise equal to `dequantize_4bit(quantize_4bit(w))` of
bitsandbytes on that weight alone, everything else (adapters, norms) unchanged, and the stored
bytes are 0.5625 per quantised value.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.hf import save_model
from tierzero.errors import ConfigError
from tierzero.hf import load_model
from tierzero.hf.lora import LoraSpec, add_lora, materialise_lora
from tierzero.layout.partition import Unit, partition
from tierzero.models import nf4

PIECE = 4096


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    base = save_model(
        "llama",
        tmp_path_factory.mktemp("nf4") / "base",
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=2,
        vocab_size=512,
    )
    hf = load_model(base)
    model = add_lora(hf, LoraSpec(r=8, alpha=16.0, targets=("q_proj", "v_proj")), base)
    units = partition(model)
    return materialise_lora(model, seed=0, device="cpu"), units


def flat(unit: Unit, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(unit.padded_numel, dtype=dtype)
    for slot in unit.slots:
        module, attr = slot.module_attrs[0]
        out[slot.offset : slot.end] = getattr(module, attr).detach().reshape(-1).to(dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoded_weights_are_bitsandbytes_own_dequantized_codes(lora_model, dtype):
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    _, units = lora_model
    blocks = [u for u in units if u.kind == "block"]
    assert blocks and all(u.has_frozen for u in blocks)
    for unit in blocks:
        values, coded = flat(unit, dtype), nf4.QuantizedBlocks(unit)
        decoded, stored = torch.full_like(values, float("nan")), 0
        for lo in range(0, unit.padded_numel, PIECE):
            hi = min(lo + PIECE, unit.padded_numel)
            packed = nf4.encode(values[lo:hi], coded.of(lo, hi))
            assert packed.dtype == torch.uint8 and packed.numel() == coded.stored_nbytes(
                lo, hi, dtype
            )
            nf4.decode(packed, coded.of(lo, hi), decoded[lo:hi])
            stored += packed.numel()
        quantized = 0
        for slot in unit.slots:
            module, attr = slot.module_attrs[0]
            got = decoded[slot.offset : slot.end]
            if nf4.quantizable(unit, module, attr, slot.frozen):
                weight = values[slot.offset : slot.end].view(slot.shape)
                expected = dequantize_4bit(*quantize_4bit(weight, blocksize=64, quant_type="nf4"))
                assert expected.dtype == dtype and torch.equal(got.view(slot.shape), expected), (
                    slot.names
                )
                assert not torch.equal(got, values[slot.offset : slot.end]), (
                    slot.names
                )  # it was quantised
                quantized += slot.numel
            else:  # adapters, norms: as they were
                assert torch.equal(got, values[slot.offset : slot.end]), slot.names
        names = {
            n.rpartition(".")[0].rpartition(".")[2]
            for s in unit.slots
            for n in s.names
            if nf4.quantizable(unit, *s.module_attrs[0], s.frozen)
        }
        assert names == {"base_layer", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        assert quantized == coded.quantized_numel
        raw = unit.padded_numel - quantized
        assert (
            stored == quantized * 9 // 16 + raw * dtype.itemsize
        )  # 0.5 + 4/64 bytes per NF4 value


def test_the_embedding_norms_and_head_stay_in_the_compute_dtype(lora_model):
    _, units = lora_model
    for unit in units:
        if unit.kind != "block":
            assert nf4.QuantizedBlocks(unit).quantized_numel == 0, unit.name


def test_a_weight_that_does_not_fill_whole_blocks_is_refused():
    linear = nn.Linear(10, 10, bias=False).requires_grad_(False)
    model = nn.Module()
    model.blocks = nn.ModuleList(
        [nn.Sequential(linear), nn.Sequential(nn.Linear(10, 10, bias=False))]
    )
    unit = next(u for u in partition(model) if u.kind == "block")
    with pytest.raises(ConfigError, match="does not fill whole blocks of 64 values"):
        nf4.QuantizedBlocks(unit)
