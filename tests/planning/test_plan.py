"""The ledger, the placement planner, the step-time model and `tierzero plan`, counted by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tierzero.config import Offload, Placement, StateKind, Tier
from tierzero.errors import ConfigError
from tierzero.layout.partition import partition
from tierzero.models import build
from tierzero.models.presets import PRESETS, ModelArgs
from tierzero.planning import machine as machine_probe
from tierzero.planning.ledger import (
    GB,
    Stage,
    activation_memory,
    block_numel,
    ledger,
    nearest_preset,
    nominal_numel,
    parse_count,
    scaled_units,
    units_from_args,
)
from tierzero.planning.placement import (
    Link,
    PlacementChoice,
    PlacementEstimate,
    candidate_placements,
    choose_placement,
    estimate,
    load_profile,
)
from tierzero.planning.workload import Workload

SEVEN_B = units_from_args(PRESETS["7b"])
PROFILE = {
    "nvme": {"read_gbps": 3.0, "write_gbps": 2.0},
    "adam": {"params_per_s": 1e9},
    "compute": {"fp32_tflops": 20.0, "bf16_tflops": 100.0},
    "h2d": {"pinned_gbps": 20.0, "pageable_gbps": 8.0},
}


def write_profile(tmp_path: Path, profile: dict, name: str = "profile.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(profile))
    return path


# --- the ledger ---------------------------------------------------------------------------


def test_seven_b_on_eight_gpus_reproduces_the_seed_account() -> None:
    rows = ledger(nominal_numel("7b"), world_size=8, compute_itemsize=2)
    assert [r.stage for r in rows] == [Stage.DDP, Stage.STAGE1, Stage.STAGE2, Stage.STAGE3]
    assert [r.bytes_per_gpu / GB for r in rows] == [112, 38.5, 26.25, 14]


@pytest.mark.parametrize("n", [1, 2, 3, 16])
def test_stage_formulas(n: int) -> None:
    numel = 1_000_003
    got = [r.bytes_per_param for r in ledger(numel, n, compute_itemsize=2)]
    assert got == pytest.approx([16, 4 + 12 / n, 2 + 14 / n, 16 / n])
    assert [r.bytes_per_gpu for r in ledger(numel, n)] == pytest.approx([b * numel for b in got])


def test_fp32_compute_stores_four_byte_params_and_grads() -> None:
    assert [r.bytes_per_param for r in ledger(10, 2, compute_itemsize=4)] == [20, 14, 12, 10]


def test_ledger_rejects_zero_gpus() -> None:
    with pytest.raises(ConfigError, match="GPUs"):
        ledger(10, 0)


def test_nominal_and_parsed_counts() -> None:
    assert nominal_numel("7b") == 7 * 10**9
    assert nominal_numel("125m") == 125 * 10**6
    assert nominal_numel("tiny") is None
    assert parse_count("7e9") == parse_count("7B") == parse_count("7b") == 7 * 10**9
    assert parse_count("1.5M") == 1_500_000
    for bad in ("0", "-3", "seven", "7GB", ""):
        with pytest.raises(ConfigError, match="not a positive count"):
            parse_count(bad)


# --- units ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_units_add_up_to_the_exact_parameter_count(name: str) -> None:
    """Embedding, blocks, head: as the engine partitions the built model."""
    args = PRESETS[name]
    units = units_from_args(args)
    assert len(units) == args.n_layers + 2
    assert sum(n for _, n in units) == args.param_count()
    built = build(args, device="meta")
    assert units[0] == ("embedding", built.tok_emb.weight.numel())
    assert units[1][1] == sum(p.numel() for p in built.blocks[0].parameters())
    head = built.norm.weight.numel() + (0 if args.tie_embeddings else built.head.weight.numel())
    assert units[-1] == ("head", head)
    assert [name for name, _ in units] == [u.name for u in partition(built)]


def test_block_params_by_hand() -> None:
    args = ModelArgs(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=16, ffn_dim=12)
    # wq, wo: 8x8; wk, wv: 8x4; gate, up, down: 8x12; two norms: 8
    assert block_numel(args) == 2 * 64 + 2 * 32 + 3 * 96 + 16


def test_params_only_are_shaped_like_the_nearest_preset() -> None:
    assert nearest_preset(7 * 10**9) == "7b"
    assert nearest_preset(65 * 10**9) == "70b"
    units = scaled_units(7 * 10**9, PRESETS["7b"])
    assert sum(n for _, n in units) == 7 * 10**9
    assert len(units) == 34


# --- activation memory ------------------------------------------------------------------------


def test_activation_memory_by_hand() -> None:
    args = ModelArgs(
        dim=8, n_layers=3, n_heads=2, n_kv_heads=1, vocab_size=10, ffn_dim=16, max_seq_len=8
    )
    a = activation_memory(
        args, batch_size=2, seq_len=5, compute_itemsize=2, loss_chunk_bytes=4 * 10 * 3
    )
    n = 10  # tokens
    assert a.chunk_tokens == 3  # 120 bytes of fp32 logits per chunk, 10 per token
    assert a.checkpoints_bytes == (3 + 1) * n * 8 * 2
    assert a.block_forward_bytes == n * (3 * 16 + 2 * 8) * 2
    assert a.recompute_bytes == n * (7 * 8 * 2 + 4 * 8 * 4 + 4 * 16 * 2) + n * 2 * 4
    assert a.block_backward_bytes == a.recompute_bytes + n * (3 * 8 + 16) * 2
    assert a.head_backward_bytes == n * 8 * (2 * 4 + 2) + 12 * 3 * 10
    assert a.logits_bytes == 8 * 3 * 10
    assert a.total_bytes == a.checkpoints_bytes + max(
        a.block_forward_bytes, a.logits_bytes, a.block_backward_bytes, a.head_backward_bytes
    )
    assert (
        activation_memory(args, 2, 5, 2).chunk_tokens == n
    )  # no chunk size: the loss in one chunk
    with pytest.raises(ConfigError, match="max_seq_len"):
        activation_memory(args, batch_size=1, seq_len=9, compute_itemsize=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_recompute_estimate_tracks_what_autograd_saves(dtype: torch.dtype) -> None:
    """The docstring's claim: within 10% of the tensors one block saves for backward."""
    args = ModelArgs(
        dim=256, n_layers=1, n_heads=8, n_kv_heads=4, vocab_size=512, ffn_dim=768, max_seq_len=128
    )
    block = build(args, dtype=dtype).blocks[0]
    x = torch.randn(2, 128, args.dim, dtype=dtype, requires_grad=True)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    not_activations = {p.untyped_storage().data_ptr() for p in block.parameters()} | {
        x.untyped_storage().data_ptr()
    }
    saved = sum(nbytes for ptr, nbytes in storages.items() if ptr not in not_activations)
    estimated = activation_memory(args, 2, 128, dtype.itemsize).recompute_bytes
    assert saved <= estimated <= 1.1 * saved


# --- placements ------------------------------------------------------------------------------


def test_candidates_include_the_offload_presets() -> None:
    candidates = candidate_placements()
    assert candidates[0] == Placement()
    assert len(candidates) == 13 and len(set(candidates)) == 13
    assert Placement.for_offload(Offload.HOST) in candidates
    assert Placement.for_offload(Offload.NVME) in candidates


def test_all_nvme_by_hand() -> None:
    """Two blocks of 100 and 300 params (each padded to 2048, one piece), one rank, bf16,
    prefetch 1, no overlap: every byte counted (the parts are `tierzero.planning.memory_model`'s)."""
    work = Workload.from_sizes(
        (("a", 100), ("b", 300)),
        compute_itemsize=2,
        grad_itemsize=2,
        prefetch_depth=1,
        overlap=False,
    )
    e = estimate(Placement(*[Tier.NVME] * 5), work)
    shard = 2048
    # bf16 params and grads, fp32 optimizer
    assert e.resident_bytes[Tier.NVME] == 2 * shard * (2 + 2 + 3 * 4)
    # both param shards in flight (prefetch 1), then b's grads: 300 bf16 + its flat fp32 grad
    # and a piece of it rounded to bf16
    assert e.resident_bytes[Tier.GPU] == 2 * shard * 2 + (300 * 2 + shard * 4 + shard * 2)
    # the optimizer: 1 piece read ahead + 1 writing, a bf16 grad and 3 fp32 states each, one new
    # param piece, and the grad piece being stepped upcast to fp32
    assert e.resident_bytes[Tier.HOST] == 2 * shard * (2 + 3 * 4) + shard * 2 + shard * 4
    assert e.moved_bytes == {
        Link.NVME_TO_HOST: 2 * 400 * 2
        + 400 * 2
        + 400 * 12,  # params twice, grads, optimizer states
        Link.HOST_TO_NVME: 400 * 2 + 400 * 12 + 400 * 2,  # grads, optimizer states, new params
        Link.HOST_TO_GPU: 2 * 400 * 2,
        Link.GPU_TO_HOST: 400 * 2,
    }


def test_two_ranks_split_states_and_share_the_machine() -> None:
    work = Workload.from_sizes(
        (("a", 101),),
        compute_itemsize=2,
        grad_itemsize=2,
        world_size=2,
        prefetch_depth=0,
        overlap=False,
    )
    e = estimate(Placement.for_offload(Offload.HOST), work)
    shard = 2048  # 101 padded to two aligned shards
    # both ranks' bf16 grads and fp32 optimizer states, each one's new bf16 params on their way
    # up (in a block of the fp32 pieces' size class) and its grad piece being stepped, in fp32
    assert e.resident_bytes[Tier.HOST] == 2 * shard * 14 + 2 * shard * 2 + 2 * shard * 4
    # param shard, gathered params, then 101 bf16 grads, the flat fp32 grad and its reduced
    # shard, a piece of which is rounded to bf16
    unit_grads = 101 * 2 + 2 * shard * 4 + shard * 4 + shard * 2
    assert e.resident_bytes[Tier.GPU] == shard * 2 + 2 * shard * 2 + unit_grads
    assert e.moved_bytes[Link.GPU_TO_HOST] == 51 * 2
    assert e.moved_bytes[Link.HOST_TO_GPU] == 51 * 2


def choose_7b(**budgets: int | None) -> PlacementChoice:
    return choose_placement(
        Workload.from_sizes(SEVEN_B, 2, grad_itemsize=2),
        **{"gpu_budget": None, "host_budget": None, "nvme_free": None, **budgets},
    )


def test_ample_budgets_choose_all_gpu() -> None:
    choice = choose_7b(gpu_budget=200 * GB, host_budget=1000 * GB, nvme_free=10_000 * GB)
    assert choice.fits and choice.placement == Placement()
    assert choice.shortfall is None
    assert sum(choice.moved_bytes.values()) == 0


def test_small_gpu_pushes_params_off_the_gpu() -> None:
    choice = choose_7b(gpu_budget=8 * GB, host_budget=1000 * GB)
    assert choice.fits
    assert choice.placement.param is not Tier.GPU
    assert choice.resident_bytes[Tier.GPU] <= 8 * GB


def test_small_host_pushes_the_optimizer_to_nvme() -> None:
    choice = choose_7b(gpu_budget=24 * GB, host_budget=32 * GB, nvme_free=1000 * GB)
    assert choice.fits
    assert all(
        choice.placement.home(k) is Tier.NVME
        for k in (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
    )
    assert choice.resident_bytes[Tier.HOST] <= 32 * GB


def test_impossible_budgets_name_the_tiers_and_the_missing_bytes() -> None:
    """107.8 GB of state against 24 + 32 + 10 GB: the nearest miss, and each short tier's bytes."""
    budgets = {Tier.GPU: 24 * GB, Tier.HOST: 32 * GB, Tier.NVME: 10 * GB}
    choice = choose_7b(gpu_budget=24 * GB, host_budget=32 * GB, nvme_free=10 * GB)
    assert not choice.fits
    assert choice.shortfall_bytes
    for tier, missing in choice.shortfall_bytes.items():
        assert missing == choice.resident_bytes[tier] - budgets[tier] > 0
        assert f"{missing / GB:.2f} GB more" in choice.shortfall
    work = Workload.from_sizes(SEVEN_B, 2, grad_itemsize=2)
    fewest = min(
        sum(estimate(p, work).overflow_bytes(budgets).values()) for p in candidate_placements()
    )
    assert sum(choice.shortfall_bytes.values()) == fewest
    assert "\n" not in choice.shortfall


def test_gpu_too_small_for_one_unit_is_a_gpu_shortfall() -> None:
    choice = choose_7b(gpu_budget=1 * GB)
    assert not choice.fits and set(choice.shortfall_bytes) == {Tier.GPU}
    assert "gpu memory" in choice.shortfall and "prefetch depth" in choice.shortfall


def test_profile_predicts_step_time_monotone_in_bandwidth(tmp_path: Path) -> None:
    times = []
    for gbps in (1.0, 2.0, 4.0, 8.0):
        prof = dict(PROFILE, nvme={"read_gbps": gbps, "write_gbps": gbps})
        profile = load_profile(write_profile(tmp_path, prof))
        work = Workload.from_sizes(SEVEN_B, 2, grad_itemsize=2, tokens_per_step=4096)
        times.append(estimate(Placement(*[Tier.NVME] * 5), work, profile).predicted_step_s)
    assert all(t is not None for t in times)
    assert times == sorted(times, reverse=True) and times[0] > times[-1]


def test_step_time_by_hand(tmp_path: Path) -> None:
    """All on host, one unit: I/O-bound forward/backward, then Adam-bound optimizer."""
    profile = load_profile(write_profile(tmp_path, PROFILE))
    work = Workload.from_sizes((("u", 10**9),), 2, grad_itemsize=2, tokens_per_step=1000)
    e = estimate(Placement(Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST), work, profile)
    compute = 8 * 10**9 * 1000 / 100e12
    pcie = (2 * 2e9 + 2e9) / 20e9  # params in twice, grads out once
    adam = 10**9 / 1e9
    assert e.predicted_step_s == pytest.approx(max(compute, pcie) + adam)


def test_choice_minimises_step_time_with_a_profile_and_nvme_traffic_without(tmp_path: Path) -> None:
    budgets = {Tier.GPU: 24 * GB, Tier.HOST: 90 * GB, Tier.NVME: 1000 * GB}
    kwargs = dict(gpu_budget=24 * GB, host_budget=90 * GB, nvme_free=1000 * GB)
    profile = load_profile(
        write_profile(tmp_path, dict(PROFILE, h2d={"pinned_gbps": 0.5, "pageable_gbps": 0.1}))
    )
    work = Workload.from_sizes(SEVEN_B, 2, grad_itemsize=2, tokens_per_step=4096)
    fitting = [
        e
        for e in (estimate(p, work, profile) for p in candidate_placements())
        if not e.overflow_bytes(budgets)
    ]
    assert len(fitting) > 1
    timed = choose_placement(work, profile=profile, **kwargs)
    assert timed.predicted_step_s == min(e.predicted_step_s for e in fitting)
    untimed = choose_placement(work, **kwargs)
    assert untimed.predicted_step_s is None
    assert nvme_bytes(untimed) == min(nvme_bytes(e) for e in fitting)


def nvme_bytes(e: PlacementEstimate | PlacementChoice) -> int:
    return e.moved_bytes[Link.NVME_TO_HOST] + e.moved_bytes[Link.HOST_TO_NVME]


def test_cpu_only_profile_makes_pcie_free(tmp_path: Path) -> None:
    profile = load_profile(write_profile(tmp_path, dict(PROFILE, h2d=None)))
    assert profile.h2d_pinned_gbps is None
    work = Workload.from_sizes((("u", 10**6),), 4, grad_itemsize=4, tokens_per_step=0)
    e = estimate(Placement(Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST), work, profile)
    assert e.predicted_step_s == pytest.approx(10**6 / 1e9)  # Adam only


def test_load_profile_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="malformed"):
        load_profile(write_profile(tmp_path, {"nvme": {"read_gbps": 1.0}}))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="malformed"):
        load_profile(bad)
    with pytest.raises(ConfigError, match="positive"):
        load_profile(write_profile(tmp_path, dict(PROFILE, adam={"params_per_s": 0})))


# --- the CLI ------------------------------------------------------------------------------------

MACHINE = ["--gpu-mem", "80GB", "--host-mem", "512GB", "--nvme-free", "2TB"]


def run_ok(*args: str) -> str:
    from tierzero.cli.app import app

    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_plan_json_reproduces_the_seed_account() -> None:
    report = json.loads(run_ok("--model", "7b", "--gpus", "8", "--dtype", "bf16", "--json"))
    assert [row["gb_per_gpu"] for row in report["ledger"]] == [112, 38.5, 26.25, 14]
    assert report["model"]["params"] == PRESETS["7b"].param_count()
    assert report["model"]["ledger_params"] == 7 * 10**9


def test_plan_json_verdict_and_placements() -> None:
    report = json.loads(
        run_ok(
            "--model",
            "7b",
            "--gpus",
            "1",
            "--gpu-mem",
            "24GB",
            "--host-mem",
            "32GB",
            "--nvme-free",
            "1TB",
            "--json",
        )
    )
    assert len(report["placements"]) == 13
    assert report["verdict"]["fits"] is True
    assert report["verdict"]["placement"]["master"] == "nvme"
    assert report["machine"]["detected"] == []


@pytest.mark.parametrize(
    "flags,kwargs",
    [
        (
            ["--model", "7b", "--gpu-mem", "24GB", "--host-mem", "32GB", "--nvme-free", "1TB"],
            dict(model="7b", gpu_mem="24GB", host_mem="32GB", nvme_free="1TB"),
        ),
        (
            [
                "--params",
                "68B",
                "--gpus",
                "2",
                "--dtype",
                "fp32",
                "--batch-size",
                "2",
                "--seq-len",
                "1024",
                *MACHINE,
            ],
            dict(
                params="68B",
                gpus=2,
                dtype="fp32",
                batch_size=2,
                seq_len=1024,
                gpu_mem="80GB",
                host_mem="512GB",
                nvme_free="2TB",
            ),
        ),
    ],
)
def test_python_plan_returns_what_the_cli_prints(flags: list[str], kwargs: dict) -> None:
    import tierzero

    printed = json.loads(run_ok(*flags, "--json"))
    report = tierzero.plan(**kwargs)
    assert json.loads(json.dumps(report.as_dict(), default=str)) == printed
    assert {
        k.value: t.value for k, t in zip(StateKind, (report.placement.home(k) for k in StateKind))
    } == printed["verdict"]["placement"]


def test_plan_tables_and_params(tmp_path: Path) -> None:
    text = run_ok("--model", "7b", "--gpus", "8", *MACHINE)
    assert "112" in text and "26.25" in text and "fits:" in text
    profile = str(write_profile(tmp_path, PROFILE))
    assert "shaped like 70b" in run_ok(
        "--params", "68B", "--gpus", "2", "--profile", profile, *MACHINE
    )
    report = json.loads(
        run_ok("--params", "68B", "--gpus", "2", "--profile", profile, *MACHINE, "--json")
    )
    assert report["model"] == {
        "preset": None,
        "shape": "70b",
        "params": 68 * 10**9,
        "ledger_params": 68 * 10**9,
        "units": 82,
        "largest_unit_params": report["model"]["largest_unit_params"],
        "vocab_size": 32000,
    }
    assert all(p["predicted_step_s"] > 0 for p in report["placements"])


def test_plan_detects_the_machine_when_sizes_are_not_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sizes not given are `tierzero train`'s defaults: half the free RAM (not all of it)."""
    monkeypatch.setattr(machine_probe, "available_host_bytes", lambda: 24 * GB)
    report = json.loads(run_ok("--model", "tiny", "--nvme-path", str(tmp_path), "--json"))
    machine = report["machine"]
    assert len(machine["detected"]) == 3
    if not torch.cuda.is_available():  # the gpu tier is host memory, inside the host budget
        assert machine["device"] == "cpu" and machine["gpu_budget_bytes"] is None
        assert machine["host_budget_bytes"] == 12 * GB
    else:
        assert all(machine[f"{t.value}_budget_bytes"] > 0 for t in Tier)


def run_failing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> str:
    """Through the installed entry point, which turns domain errors into exit code 2."""
    from tierzero.cli.app import main

    monkeypatch.setattr(sys, "argv", ["tierzero", "plan", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return " ".join(err.split())  # rich wraps long lines at the console width


def test_missing_nvme_path_is_an_error_when_free_space_is_detected(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    err = run_failing(
        monkeypatch, capsys, "--model", "tiny", "--nvme-path", str(tmp_path / "absent")
    )
    assert "is not a directory" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nope"], "unknown model preset 'nope'"),
        (["--gpus", "0"], "number of GPUs must be an integer >= 1"),
        (["--gpu-mem", "12XB"], "--gpu-mem '12XB' is not a size"),
        (["--params", "lots"], "--params 'lots' is not a positive count"),
        (["--model", "7b", "--params", "7e9"], "give --model or --params, not both"),
        (["--dtype", "fp8"], "--dtype 'fp8' is not valid"),
        (
            ["--profile", "/nonexistent/profile.json"],
            "profile '/nonexistent/profile.json' does not exist",
        ),
        (["--model", "tiny", "--seq-len", "4096"], "exceeds the model's max_seq_len"),
        (["--model", "tiny", "--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
        (
            ["--model", "tiny", "--accumulate", "0"],
            "--accumulate must be an integer >= 1, got 0",
        ),  # was planned
        (
            ["--model", "tiny", "--prefetch-depth", "-1"],
            "--prefetch-depth must be an integer >= 0, got -1",
        ),
        (
            ["--model", "tiny", "--piece-numel", "0"],
            "--piece-numel must be a positive multiple of 2048",
        ),  # crashed
    ],
)
def test_plan_bad_input_is_one_error_and_exit_2(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    err = run_failing(monkeypatch, capsys, *MACHINE, *args)
    assert err.startswith("error:") and message in err


def test_frozen_parameters_move_as_params_only() -> None:
    """With a unit's trainable prefix given, grads, optimizer states and the stepped params move
    for it alone; params still move whole for compute."""
    units = (("embedding", 8192), ("blocks.0", 8192), ("head", 8192))
    nvme = Placement(*[Tier.NVME] * 5)
    dense = estimate(nvme, Workload.from_sizes(units, 2, grad_itemsize=4, prefetch_depth=1))
    lora = estimate(
        nvme,
        Workload.from_sizes(units, 2, grad_itemsize=4, prefetch_depth=1, trainable=(0, 2048, 0)),
    )
    params = 3 * 8192 * 2
    # every param is read twice (forward, backward); the trainable ones' grads are written, and
    # the optimizer reads grad, master and both moments (fp32) and writes those three and the param
    assert lora.moved_bytes[Link.NVME_TO_HOST] == 2 * params + 2048 * 4 * 4
    assert lora.moved_bytes[Link.HOST_TO_NVME] == 2048 * 4 + 2048 * 4 * 3 + 2048 * 2
    assert dense.moved_bytes[Link.NVME_TO_HOST] == 2 * params + 3 * 8192 * 4 * 4
    assert lora.memory.tiers[Tier.NVME].homes_bytes == params + 2048 * 16
