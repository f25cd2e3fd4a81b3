"""Export: the safetensors written from a checkpoint equal the model's own `state_dict`.

Checkpoints are built by hand (`tests.support.checkpoints`) from a model's weights, so the oracle is
that model: fp32 export is bitwise its `state_dict()` (every tied name included) and loads
back with `load_state_dict`; bf16 export is bitwise `.to(torch.bfloat16)` of it. Peak memory is
measured in a subprocess, from the kernel's high-water mark of resident memory.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tierzero.cli.app import app
from typer.testing import CliRunner

from tests.support.checkpoints import files_under, flip_byte, write_checkpoint
from tests.support.engine import SMALL
from tierzero import models
from tierzero.checkpoint.export import export_checkpoint
from tierzero.config import StateKind
from tierzero.errors import CheckpointError, TierzeroError

runner = CliRunner()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return models.build(SMALL, seed=0)


@pytest.fixture(scope="module", params=[1, 2], ids=["ranks1", "ranks2"])
def run(request, model, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp(f"run{request.param}")
    write_checkpoint(run_dir, model, step=7, world_size=request.param)
    return run_dir


@pytest.fixture(scope="module")
def one_rank_run(model, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    write_checkpoint(run_dir, model, step=7)
    return run_dir


def _load_all(files: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def test_fp32_export_is_the_state_dict_bitwise_and_loads(run, model, tmp_path):
    result = export_checkpoint(run, tmp_path / "model.safetensors")
    assert result.files == [tmp_path / "model.safetensors"] and result.index is None
    loaded = load_file(str(tmp_path / "model.safetensors"))
    expected = model.state_dict()
    assert set(loaded) == set(expected)
    for name, value in expected.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], value), name
    # tied: the embedding and the head are one parameter, exported under both names
    assert torch.equal(loaded["tok_emb.weight"], loaded["head.weight"])
    fresh = models.build(SMALL, seed=1)
    fresh.load_state_dict(loaded)  # strict: every key present, none extra
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), expected.values()))
    assert fresh.head.weight is fresh.tok_emb.weight
    assert result.tensors == len(expected) and result.step == 7
    assert files_under(tmp_path) == {"model.safetensors"}  # no temp file left


def test_bf16_export_rounds_like_torch(run, model, tmp_path):
    export_checkpoint(run, tmp_path / "m.safetensors", dtype="bf16")
    loaded = load_file(str(tmp_path / "m.safetensors"))
    for name, value in model.state_dict().items():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], value.to(torch.bfloat16)), name


def test_header_is_padded_and_carries_metadata(run, tmp_path):
    path = tmp_path / "model.safetensors"
    export_checkpoint(run, path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert n % 8 == 0 and raw[8 : 8 + n].rstrip(b" ").endswith(b"}")
    assert header["__metadata__"] == {"format": "pt", "step": "7"}
    ends = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
    assert 8 + n + ends[-1][1] == len(raw)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "step": "7"}


def test_sharded_export_writes_the_index_layout(run, model, tmp_path):
    result = export_checkpoint(run, tmp_path / "model.safetensors", max_shard_bytes=100_000)
    k = len(result.files)
    assert k > 2
    assert [f.name for f in result.files] == [
        f"model-{i:05d}-of-{k:05d}.safetensors" for i in range(1, k + 1)
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert result.index == tmp_path / "model.safetensors.index.json"
    expected = model.state_dict()
    assert set(index["weight_map"]) == set(expected)
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in expected.values())
    for name, file in index["weight_map"].items():
        with safe_open(str(tmp_path / file), framework="pt") as f:
            assert name in f.keys()
    for f in result.files[:-1]:  # only a lone oversized tensor may exceed the limit
        tensors = load_file(str(f))
        assert len(tensors) == 1 or sum(t.numel() * 4 for t in tensors.values()) <= 100_000
    loaded = _load_all(result.files)
    assert all(torch.equal(loaded[n], v) for n, v in expected.items())
    models.build(SMALL, seed=1).load_state_dict(loaded)
    assert not (tmp_path / "model.safetensors").exists()
    assert files_under(tmp_path) == {f.name for f in result.files} | {
        "model.safetensors.index.json"
    }


def test_newest_complete_checkpoint_by_default_and_step_picks(tmp_path):
    first, second = models.build(SMALL, seed=0), models.build(SMALL, seed=3)
    run_dir = tmp_path / "run"
    write_checkpoint(run_dir, first, step=1)
    write_checkpoint(run_dir, second, step=2)
    (run_dir / "checkpoints" / "step-00000003" / "state").mkdir(parents=True)  # being written
    assert export_checkpoint(run_dir, tmp_path / "a.safetensors").step == 2
    a = load_file(str(tmp_path / "a.safetensors"))
    assert all(torch.equal(a[n], v) for n, v in second.state_dict().items())
    export_checkpoint(run_dir, tmp_path / "b.safetensors", step=1)
    b = load_file(str(tmp_path / "b.safetensors"))
    assert all(torch.equal(b[n], v) for n, v in first.state_dict().items())


def test_flipped_byte_fails_naming_the_file_and_leaves_nothing(tmp_path, model):
    checkpoint = write_checkpoint(tmp_path / "run", model, step=4, world_size=2, chunk_bytes=4096)
    bad = flip_byte(checkpoint, "master/u0002/r1")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CheckpointError) as info:
        export_checkpoint(tmp_path / "run", out / "model.safetensors", max_shard_bytes=50_000)
    assert bad in str(info.value) and "crc32c" in str(info.value)
    assert "\n" not in str(info.value)
    assert files_under(out) == set()


def test_interrupt_mid_export_leaves_nothing(run, tmp_path):
    def interrupt(done: int, total: int) -> None:
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(
            run, tmp_path / "model.safetensors", max_shard_bytes=100_000, on_unit=interrupt
        )
    assert files_under(tmp_path) == set()


def test_missing_master_array_is_named(tmp_path, model):
    write_checkpoint(tmp_path / "run", model, step=1, kinds=(StateKind.PARAM,))
    with pytest.raises(CheckpointError, match="has no array master/u0000/r0"):
        export_checkpoint(tmp_path / "run", tmp_path / "m.safetensors")


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_run", "does not exist"),
        ("no_checkpoint", "has no complete checkpoint"),
        ("bad_step", "has no checkpoint at step 99 (steps: 7)"),
        ("no_parent", "does not exist; create it"),
        ("bad_suffix", "is not a .safetensors file name"),
        ("unwritable", "cannot write /proc/model.safetensors"),
        ("bad_dtype", "--dtype 'fp8' is not an export dtype"),
    ],
)
def test_errors_are_one_sentence(case, message, tmp_path, one_rank_run):
    kwargs = {"run_dir": one_rank_run, "out": tmp_path / "m.safetensors"}
    if case == "no_run":
        kwargs["run_dir"] = tmp_path / "nope"
    elif case == "no_checkpoint":
        kwargs["run_dir"] = tmp_path
    elif case == "bad_step":
        kwargs["step"] = 99
    elif case == "no_parent":
        kwargs["out"] = tmp_path / "missing" / "m.safetensors"
    elif case == "bad_suffix":
        kwargs["out"] = tmp_path / "m.bin"
    elif case == "unwritable":
        kwargs["out"] = Path("/proc/model.safetensors")
    elif case == "bad_dtype":
        kwargs["dtype"] = "fp8"
    with pytest.raises(TierzeroError) as info:
        export_checkpoint(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_cli_json_and_human(run, model, tmp_path):
    out = tmp_path / "cli.safetensors"
    result = runner.invoke(
        app, ["export", str(run), "--out", str(out), "--json", "--dtype", "bf16"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (
        doc["step"] == 7
        and doc["dtype"] == "bf16"
        and doc["files"] == [str(out)]
        and doc["index"] is None
    )
    assert doc["tensors"] == len(model.state_dict())
    result = runner.invoke(
        app, ["export", str(run), "--out", str(tmp_path), "--max-shard-size", "200KB"]
    )
    assert result.exit_code == 0, result.output
    assert "exported step 7" in result.stdout and "model.safetensors.index.json" in result.stdout
    assert (tmp_path / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--step", "3"], "no checkpoint at step 3"),
        (["--max-shard-size", "lots"], "--max-shard-size 'lots' is not a size"),
        (["--dtype", "fp16"], "not an export dtype"),
    ],
)
def test_cli_errors_are_one_line_exit_2(run, tmp_path, args, message):
    result = runner.invoke(
        app, ["export", str(run), "--out", str(tmp_path / "m.safetensors"), *args]
    )
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]


# Peak memory: the export's resident high-water mark grows by about one unit, not the model.
# /proc/self/status's VmHWM, reset to the current RSS through clear_refs, is used rather than
# ru_maxrss: after fork+exec, ru_maxrss starts at the *parent's* RSS (here several hundred MB),
# which would hide the child's growth entirely.
_MEASURE = """
import sys
import tierzero.checkpoint.export
def kb(field):
    return int(open('/proc/self/status').read().split(field + ':')[1].split()[0])
base = kb('VmRSS')
try:
    open('/proc/self/clear_refs', 'w').write('5')  # VmHWM := VmRSS
except OSError:
    base = kb('VmHWM')
tierzero.checkpoint.export.export_checkpoint(sys.argv[1], sys.argv[2], dtype=sys.argv[3])
print(base * 1024, kb('VmHWM') * 1024)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from Linux /proc")
def test_peak_memory_is_about_one_unit(tmp_path):
    args = models.ModelArgs(
        dim=256, n_layers=24, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=1024, max_seq_len=64
    )
    model = models.build(args, device="meta")
    model.to_empty(device="cpu")  # values do not matter here, only sizes: skip the slow init
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * (i + 1) * 1e-6)
    model_bytes = sum(p.numel() for p in model.parameters()) * 4
    assert model_bytes > 90e6
    write_checkpoint(
        tmp_path / "run",
        model,
        step=1,
        world_size=2,
        chunk_bytes=8 << 20,
        kinds=(StateKind.MASTER,),
    )
    expected = {k: v.clone() for k, v in list(model.state_dict().items())[:3]}
    del model
    out = tmp_path / "model.safetensors"
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path / "run"), str(out), "fp32"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    base, peak = map(int, done.stdout.split())
    assert (peak - base) * 4 <= model_bytes, (
        f"peak RSS grew {(peak - base) / 1e6:.1f} MB for {model_bytes / 1e6:.1f} MB"
    )
    with safe_open(str(out), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(k), v) for k, v in expected.items())
