"""Loading a sharded Hugging Face checkpoint unit by unit holds about one unit in host memory.

Measured from the kernel's high-water mark of resident memory (VmHWM, reset to the current
RSS through /proc/self/clear_refs) while every unit's flat fp32 buffer is filled from the
shards (`init.flat_unit`, what `Engine.open` does before writing each unit to its tiers). glibc's
malloc thresholds are pinned first, as the engine pins them, so every buffer of 128 KiB or
more is a fresh mapping that the high-water mark counts, and freed ones leave RSS: a loader
that kept the model (or safetensors' memory maps) resident would grow by the whole model.
In this process, not a subprocess, to spare a second import of torch and transformers.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tests.support.hf import config
from tierzero.engine.runtime.tiers import pin_malloc_thresholds
from tierzero.hf import load_model
from tierzero.layout.partition import partition
from tierzero.models.init import WeightFiles, flat_unit


def _kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="reads VmHWM from Linux /proc"
)
def test_loading_a_sharded_checkpoint_holds_about_one_unit(tmp_path):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # values do not matter here, only sizes: skip the slow init
        model = AutoModelForCausalLM.from_config(
            config(
                "llama",
                hidden_size=256,
                intermediate_size=1024,
                num_hidden_layers=16,
                tie_word_embeddings=False,
            )
        )
    model.to_empty(device="cpu")
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * (i + 1) * 1e-6)
    expected = model.get_parameter("model.layers.7.mlp.up_proj.weight").detach().clone()
    model.save_pretrained(tmp_path, max_shard_size="10MB")
    del model
    assert len(list(tmp_path.glob("*.safetensors"))) > 4  # sharded, with an index

    pin_malloc_thresholds()
    hf = load_model(tmp_path)
    units = partition(hf.model)
    files = WeightFiles(hf.weights)
    unit_bytes, model_bytes = (
        max(u.padded_numel for u in units) * 4,
        sum(u.numel for u in units) * 4,
    )
    gc.collect()
    base = _kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    for unit in units:
        flat = flat_unit(hf.model, unit, 0, files)
        if unit.index == 8:
            slot = next(s for s in unit.slots if s.names == ("model.layers.7.mlp.up_proj.weight",))
            assert torch.equal(flat[slot.offset : slot.end].view(slot.shape), expected)
        del flat
    growth = (_kb("VmHWM") - base) * 1024
    assert model_bytes > 60e6 and unit_bytes * 15 < model_bytes
    # one unit's flat buffer plus the tensor being read (measured: 1.25 units)
    assert growth <= 2 * unit_bytes, (
        f"peak RSS grew {growth / 1e6:.1f} MB; one unit is {unit_bytes / 1e6:.1f} MB"
    )
