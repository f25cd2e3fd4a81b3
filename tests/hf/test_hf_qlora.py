"""LoRA on an NF4 base (`--quantize-base nf4`): the base's block linear weights stored in
bitsandbytes' 4-bit format on their home tier and decoded on the compute device per fetch.

A small saved LLaMA under peft's LoRA (fp32 adapters, every state on NVMe, pieces of 8192
values so a unit's frozen rest is several coded pieces). Checked: the weights every unit
computes with are bitwise `dequantize_4bit(quantize_4bit(w))` of bitsandbytes on the base's
own weights; the loss falls; a resume from a checkpoint is bitwise the uninterrupted run; a
flipped byte in a stored code is caught on resume; the base costs about 0.5625 bytes per
quantised weight on the drive; `tierzero train --quantize-base` trains and refuses what it
cannot do in one sentence.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tierzero.cli.app import app
from torch import nn
from typer.testing import CliRunner

from tests.support.hf import sample_text, save_coded_base
from tierzero import Config, Placement, Tier
from tierzero.checkpoint.catalog import checkpoint_dirs
from tierzero.config import PIECE_NUMEL
from tierzero.engine import Engine
from tierzero.errors import CheckpointError
from tierzero.hf import load_model, materialise
from tierzero.models import nf4
from tierzero.models.nf4_shard import CodedShard
from tierzero.run.data import TokenBatches, default_corpus
from tierzero.run.directory import read_metrics

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)
runner = CliRunner()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return save_coded_base(tmp_path_factory.mktemp("qlora") / "base")


def lora_model(base_dir: Path) -> nn.Module:
    torch.manual_seed(0)  # peft draws the adapters' A from torch's generator
    hf = load_model(f"hf:{base_dir}")
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(materialise(hf, seed=0, weights=hf.weights), config)


def config(tmp_path: Path, **changes) -> Config:
    values = {
        "placement": NVME,
        "nvme_path": [str(tmp_path / "nvme")],
        "dtype": "fp32",
        "lr": 1e-2,
        "piece_numel": 8192,
        "quantize_base": "nf4",
        "host_budget": "256MiB",
        "gpu_budget": "256MiB",
    }
    return Config(**{**values, **changes})


def batches() -> TokenBatches:
    return TokenBatches(default_corpus(1 << 15), batch_size=2, seq_len=32, seed=0)


def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The base's linear layers in blocks (not the adapters' own `nn.Linear`s, which train)."""
    return {
        n: m
        for n, m in model.named_modules()
        if type(m) is nn.Linear and ".layers." in n and not m.weight.requires_grad
    }


HOST = Placement(Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST)


@pytest.mark.parametrize(
    ("placement", "dtype"),
    [(NVME, torch.float32), (HOST, torch.bfloat16)],
    ids=["nvme-fp32", "host-bf16"],
)
def test_units_compute_with_bitsandbytes_own_dequantized_base(
    base_dir, tmp_path, placement, dtype
) -> None:
    """On NVMe the base is stored as coded pieces, in a host home as one key of them end to end."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    model = lora_model(base_dir)
    linears = block_linears(model)
    expected = {
        n: dequantize_4bit(
            *quantize_4bit(m.weight.detach().to(dtype), blocksize=64, quant_type="nf4")
        )
        for n, m in linears.items()
    }
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in linears}
    for name, module in linears.items():
        module.register_forward_pre_hook(
            lambda m, _, name=name: seen[name].append(m.weight.detach().clone())
        )
    settings = {
        "placement": placement,
        "dtype": "fp32" if dtype == torch.float32 else "bf16",
    }
    data = batches()
    with Engine(model, config(tmp_path, **settings)) as engine:
        losses = [engine.train_step(data.next_batch()) for _ in range(4)]
        weights = engine.master_state_dict()
    assert losses[-1] < losses[0] - 0.05, losses
    assert len(linears) == 2 * 7  # q (its base layer), k, v (its base layer), o, gate, up, down
    for name, want in expected.items():
        assert seen[name] and all(torch.equal(got, want) for got in seen[name]), name
        assert torch.equal(weights[f"{name}.weight"], want.float()), name
    adapters = [w for n, w in weights.items() if "lora_B" in n]
    assert adapters and any(w.abs().sum() > 0 for w in adapters)


def test_the_drive_holds_the_base_in_nf4(base_dir, tmp_path) -> None:
    def drive(quantize: str) -> tuple[int, Engine]:
        with Engine(
            lora_model(base_dir), config(tmp_path / quantize, quantize_base=quantize)
        ) as engine:
            engine.train_step(batches().next_batch())
        nvme = (
            tmp_path / quantize / "nvme"
        )  # allocated bytes: chunk files are sparse past their data
        return sum(f.stat().st_blocks * 512 for f in (nvme / "param").rglob("c/*")), engine

    coded, engine = drive("nf4")
    plain, _ = drive("none")
    shards = engine.parts.shards.coded
    assert sorted(shards) == [1, 2]  # the blocks; the embedding and head stay fp32
    assert plain - coded == sum(s.param_numel * 4 - s.stored_nbytes for s in shards.values())
    # at the default piece size the 4 KiB padding of a piece is lost in its bytes: 0.5625 per
    # quantised value, the rest (norms, adapters, padding) as it is
    for index in shards:
        unit = engine.units[index]
        whole = CodedShard(unit, 0, PIECE_NUMEL, torch.float32)
        quantized = nf4.QuantizedBlocks(unit).quantized_numel
        raw = unit.padded_numel - quantized
        assert whole.stored_nbytes - (quantized * 9 // 16 + raw * 4) < 2 * 4096


def train_and_save(
    base_dir: Path,
    tmp_path: Path,
    steps: int,
    save: set[int],
    placement: Placement = NVME,
) -> tuple[list[float], dict]:
    data = batches()
    with Engine(lora_model(base_dir), config(tmp_path, placement=placement)) as engine:
        losses = []
        for step in range(1, steps + 1):
            losses.append(engine.train_step(data.next_batch()))
            if step in save:
                engine.save_checkpoint(tmp_path / "run", data=data.state_dict())
        return losses, engine.master_state_dict()


def resume(
    base_dir: Path, tmp_path: Path, steps: int, placement: Placement = NVME
) -> tuple[list[float], dict, list[str], int]:
    data = batches()
    with Engine(lora_model(base_dir), config(tmp_path, placement=placement)) as engine:
        manifest = engine.load_checkpoint(tmp_path / "run")
        data.load_state_dict(manifest.data)
        losses = [engine.train_step(data.next_batch()) for _ in range(steps - manifest.step)]
        return losses, engine.master_state_dict(), engine.notes(), manifest.step


@pytest.mark.parametrize("placement", [NVME, HOST], ids=["nvme", "host"])
def test_a_resume_is_bitwise_the_uninterrupted_run(base_dir, tmp_path, placement) -> None:
    """NVMe: the checkpoint links the coded pieces; a host home: it writes them out."""
    whole, final = train_and_save(base_dir, tmp_path / "whole", 4, set(), placement)
    first, _ = train_and_save(base_dir, tmp_path / "cut", 2, {2}, placement)
    rest, resumed, _, step = resume(base_dir, tmp_path / "cut", 4, placement)
    assert step == 2 and first + rest == whole
    assert final.keys() == resumed.keys()
    assert all(torch.equal(final[n], resumed[n]) for n in final)


def test_a_flipped_byte_in_a_stored_code_is_caught_on_resume(base_dir, tmp_path) -> None:
    """The base's codes are never rewritten, so every checkpoint links the same chunks (the
    codes are stored once per run): a flipped code damages them all, and resume says so."""
    train_and_save(base_dir, tmp_path, 2, {1, 2})
    steps = [path for _, path in checkpoint_dirs(tmp_path / "run")]
    frozen = max((steps[-1] / "state" / "param" / "u0001" / "r0").iterdir())
    chunk = frozen / "c" / "0"  # the last piece of a block: its frozen rest, coded
    assert all(
        (s / chunk.relative_to(steps[-1])).stat().st_ino == chunk.stat().st_ino for s in steps
    )
    raw = bytearray(chunk.read_bytes())
    raw[300] ^= 0x10  # past the piece's absmax: a code
    chunk.write_bytes(raw)
    with pytest.raises(CheckpointError, match=f"{frozen.name}/c/0 fails its crc32c check"):
        resume(base_dir, tmp_path, 2)


def cli_train(base_dir: Path, tmp_path: Path, *args: str):
    data = tmp_path / "corpus.txt"
    data.write_text(sample_text())
    return runner.invoke(
        app,
        [
            "train",
            "--model",
            f"hf:{base_dir}",
            "--data",
            str(data),
            "--steps",
            "4",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--lr",
            "1e-2",
            "--dtype",
            "fp32",
            "--offload",
            "nvme",
            "--eval-every",
            "0",
            "--run-dir",
            str(tmp_path / "run"),
            *args,
        ],
    )


def test_tierzero_train_quantize_base_nf4_with_lora_trains(base_dir, tmp_path) -> None:
    result = cli_train(base_dir, tmp_path, "--lora-r", "8", "--quantize-base", "nf4")
    assert result.exit_code == 0, result.output
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0], losses


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--quantize-base", "nf4"], "have none frozen; train adapters (--lora-r)"),
        (
            ["--lora-r", "8", "--quantize-base", "int3"],
            "must be nf4 or none, got 'int3'",
        ),
        (
            ["--lora-r", "8", "--quantize-base", "nf4", "--offload", "none"],
            "pass --offload host",
        ),
    ],
)
def test_what_an_nf4_base_cannot_do_is_refused_in_one_sentence(
    base_dir, tmp_path, args, said
) -> None:
    result = cli_train(base_dir, tmp_path, *args)
    assert result.exit_code == 2, result.output
    assert said in result.output and "Traceback" not in result.output, result.output


def test_export_writes_the_adapter_and_merges_into_the_dequantized_base(base_dir, tmp_path) -> None:
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    result = cli_train(base_dir, tmp_path, "--lora-r", "8", "--quantize-base", "nf4")
    assert result.exit_code == 0, result.output
    for args in ([], ["--merge"]):
        out = tmp_path / ("merged" if args else "adapter")
        result = runner.invoke(app, ["export", str(tmp_path / "run"), "--out", str(out), *args])
        assert result.exit_code == 0, result.output
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    base = AutoModelForCausalLM.from_pretrained(base_dir).state_dict()
    for name, weight in base.items():
        if ".layers." in name and name.endswith("proj.weight"):
            coded = dequantize_4bit(*quantize_4bit(weight, blocksize=64, quant_type="nf4"))
            if "q_proj" in name or "v_proj" in name:  # adapted: the base plus scaling * B @ A
                stem = "base_model.model." + name.removesuffix(".weight")
                delta = adapter[f"{stem}.lora_B.weight"] @ adapter[f"{stem}.lora_A.weight"]
                assert delta.abs().sum() > 0
                torch.testing.assert_close(merged[name], coded + 2.0 * delta)
            else:
                assert torch.equal(merged[name], coded), name
        else:  # the embedding, norms and head: as they were
            assert torch.equal(merged[name], weight), name


def test_a_resume_with_another_quantize_base_is_refused(base_dir, tmp_path) -> None:
    train_and_save(base_dir, tmp_path, 1, {1})
    engine = Engine(lora_model(base_dir), config(tmp_path, quantize_base="none"))
    with (
        engine,
        pytest.raises(CheckpointError, match="resume with --quantize-base nf4$"),
    ):
        engine.load_checkpoint(tmp_path / "run")


def test_a_piece_longer_than_one_decode_chunk_is_bitsandbytes_own() -> None:
    """Decoding runs `DECODE_BLOCKS` blocks at a time: a stretch of two chunks and a bit."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    torch.manual_seed(0)
    values = torch.randn((nf4.DECODE_BLOCKS + 5) * nf4.QUANT_BLOCK)
    blocks = torch.ones(values.numel() // nf4.QUANT_BLOCK, dtype=torch.bool)
    out = nf4.decode(nf4.encode(values, blocks), blocks, torch.empty_like(values))
    expected = dequantize_4bit(*quantize_4bit(values, blocksize=64, quant_type="nf4"))
    assert torch.equal(out, expected.reshape(-1))


def test_the_engine_sizes_its_pools_by_the_coded_base(base_dir, tmp_path) -> None:
    """A host budget between the NF4 base's stored bytes and the same base in the compute dtype
    opens (the engine's memory model counts what `plan` counts), and trains."""
    with Engine(lora_model(base_dir), config(tmp_path / "probe", placement=HOST)) as probe:
        sizing = probe.parts.sizing
        coded = sizing.memory(HOST, 1).needs()[Tier.HOST]
        sizing.coded = None  # the same workload with the base in the compute dtype
        plain = sizing.memory(HOST, 1).needs()[Tier.HOST]
    assert coded < plain
    budget = (coded + plain) // 2
    cfg = config(tmp_path / "tight", placement=HOST, host_budget=budget, gpu_budget=budget)
    with Engine(lora_model(base_dir), cfg) as engine:
        losses = [engine.train_step(batches().next_batch()) for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(losses)))
