"""`tierzero train --nproc 2`: two gloo ranks started through torchrun's launcher, on the CPU.

One uninterrupted two-rank run is shared by the assertions (launches are the expensive part):
- its exported weights equal a one-rank run of the same global batches within 5e-5 (the
  two-rank tolerance of test_engine_two_ranks: a different summation order, through Adam);
- each rank's store holds half of each unit's state, read from the arrays on disk;
- with the host budget at the memory model's per-rank figure (what `tierzero plan --gpus 2`
  reports per rank), every rank's measured pool peaks (rank 0 logs them all) are within 10%
  of the predicted ones, and `tierzero report` shows the busiest rank's;
- a second run, with rank 1 killed (SIGKILL) during step 4, after the step-2 checkpoint, ends
  with an error naming rank 1 (not a hang), keeps step 2 as its newest complete checkpoint,
  and resumed on two ranks finishes bitwise equal to the uninterrupted run. The resume goes
  through the multi-machine path: two torchrun agents, one rank each, meeting at a c10d
  rendezvous, as two machines would.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tierzero.cli.app import app
from typer.testing import CliRunner

from tierzero import models
from tierzero.checkpoint.catalog import checkpoint_dirs, newest_checkpoint
from tierzero.checkpoint.manifest import Manifest
from tierzero.config import Placement, Tier
from tierzero.planning.ledger import activation_memory
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.peaks import MemoryModel
from tierzero.planning.workload import Workload
from tierzero.run.charts import load_run, summarize
from tierzero.run.directory import read_metrics

ARGS = [
    "--steps",
    "4",
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--dtype",
    "fp32",
    "--offload",
    "nvme",
    "--checkpoint-every",
    "2",
    "--keep-checkpoints",
    "5",
    "--comm-timeout",
    "60",
]
HANG_GUARD_S = 300  # a guard against a hang, not a timing threshold


def per_rank_prediction(stage: int = 3) -> MemoryModel:
    """One rank's share of the memory model for ARGS on two ranks at ZeRO `stage`: every state
    on nvme, fp32, the CPU device, overlap_step, each rank's micro-batch 2 x 32."""
    args = models.get_preset("tiny")
    act = activation_memory(args, 2, 32, 4, models.llama.LOSS_CHUNK_BYTES)
    return peak_memory(
        Workload.from_preset(
            args,
            4,
            world_size=2,
            device="cpu",
            prefetch_depth=2,
            overlap=True,
            activations=act,
            stage=stage,
        ),
        Placement(*[Tier.NVME] * 5),
    ).per_rank()


def launch(run_dir: Path, *extra: str, budget_stage: int = 3) -> subprocess.Popen:
    """At the host budget stage `budget_stage` needs (so auto picks it), which the pools fill:
    their peaks are measurable."""
    budget = str(per_rank_prediction(budget_stage).host_total_bytes)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tierzero.cli",
            "train",
            "--nproc",
            "2",
            *ARGS,
            "--host-budget",
            budget,
            "--run-dir",
            str(run_dir),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def launch_as_two_nodes(run_dir: Path, *extra: str) -> list[subprocess.Popen]:
    """Two torchrun agents of one rank each, meeting at a c10d rendezvous on this machine."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    budget = str(per_rank_prediction().host_total_bytes)
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"localhost:{port}",
                "--rdzv-id",
                "test",
                "-m",
                "tierzero.cli",
                "train",
                *ARGS,
                "--host-budget",
                budget,
                "--run-dir",
                str(run_dir),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=HANG_GUARD_S)
    return proc.returncode, out, err


def export(run_dir: Path, out: Path, step: int | None = None) -> dict[str, torch.Tensor]:
    result = CliRunner().invoke(
        app, ["export", str(run_dir), "--out", str(out), *(["--step", str(step)] if step else [])]
    )
    assert result.exit_code == 0, result.output
    return load_file(str(out))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ranks") / "run"
    code, out, err = finish(launch(run_dir))
    assert code == 0, err
    (run_dir.parent / "stdout.txt").write_text(out)
    return run_dir


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The exported weights of a one-rank run of ARGS (the same global batches)."""
    root = tmp_path_factory.mktemp("one")
    one = CliRunner().invoke(app, ["train", *ARGS, "--run-dir", str(root / "run")])
    assert one.exit_code == 0, one.output
    return export(root / "run", root / "one.safetensors")


def test_two_ranks_equal_one_rank_with_the_same_global_batch(two_ranks, one_rank, tmp_path) -> None:
    ref = one_rank
    got = export(two_ranks, tmp_path / "two.safetensors")
    assert got.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=0, atol=5e-5)
    manifest = Manifest.load(newest_checkpoint(two_ranks)[0])
    assert manifest.world_size == 2 and manifest.data is not None and len(manifest.rank_rng) == 2
    records = [r for r in read_metrics(two_ranks) if "loss" in r]  # one writer: rank 0
    assert [r["step"] for r in records] == list(range(1, 5))


def test_each_rank_stores_half_of_every_unit(two_ranks) -> None:
    units = Manifest.load(newest_checkpoint(two_ranks)[0]).units
    for rank in (0, 1):
        store = two_ranks / "nvme" / f"rank{rank}"
        for kind, itemsize in (
            ("master", 4),
            ("exp_avg", 4),
            ("exp_avg_sq", 4),
            ("grad", 4),
            ("param", 4),
        ):
            for unit in units:
                shard = store / kind / f"u{unit.index:04d}" / f"r{rank}"
                nbytes = sum(
                    _current_array_nbytes(piece) for piece in shard.iterdir() if piece.is_dir()
                )
                assert nbytes == unit.padded_numel // 2 * itemsize, (rank, kind, unit.name)
                # half, padding aside
                assert unit.numel / 2 <= nbytes / itemsize < unit.numel / 2 + 4096
                assert not (store / kind / f"u{unit.index:04d}" / f"r{1 - rank}").exists()


def test_inspect_shows_each_ranks_store(two_ranks) -> None:
    result = CliRunner().invoke(app, ["inspect", str(two_ranks), "--json"])
    assert result.exit_code == 0, result.output
    stores = json.loads(result.stdout)["stores"]
    assert [Path(s["path"]).name for s in stores] == ["rank0", "rank1"]
    assert all(
        set(s["kinds"]) == {"param", "grad", "master", "exp_avg", "exp_avg_sq"} for s in stores
    )
    assert stores[0]["nbytes"] == stores[1]["nbytes"] > 0


def test_measured_pool_peaks_match_the_per_rank_prediction(two_ranks) -> None:
    predicted = per_rank_prediction()
    last = [r for r in read_metrics(two_ranks) if "loss" in r][-1]  # peaks since open
    # rank 0's at the top
    assert [last[k] for k in ("peak_host_bytes", "peak_gpu_bytes")] == [
        last["ranks"][0][k] for k in ("peak_host_bytes", "peak_gpu_bytes")
    ]
    for rank, counters in enumerate(last["ranks"]):
        for tier in (Tier.HOST, Tier.GPU):
            measured = counters[f"peak_{tier.value}_bytes"]
            assert (
                0.9 * predicted.tiers[tier].pool_bytes
                <= measured
                <= predicted.tiers[tier].pool_bytes
            ), (rank, tier)
    peaks = summarize(load_run(two_ranks))["peak_bytes"]
    assert peaks["host"] == max(
        c["peak_host_bytes"] for r in read_metrics(two_ranks) if "loss" in r for c in r["ranks"]
    )


def test_plan_reports_one_ranks_share(tmp_path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "--model",
            "tiny",
            "--gpus",
            "2",
            "--host-mem",
            "8GB",
            "--nvme-free",
            "1TB",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    machine, rank = report["verdict"]["memory"], report["per_rank"]
    assert rank["ranks"] == 2 and rank["host_budget_bytes"] == 4 * 10**9
    assert rank["peak_bytes"]["host"] * 2 == machine["host_total_bytes"]
    assert rank["peak_bytes"]["nvme"] * 2 == machine["tiers"]["nvme"]["peak_bytes"]


def _current_array_nbytes(piece: Path) -> int:
    """shape x itemsize of the current generation of one stored piece, from its zarr.json."""
    group = json.loads((piece / "zarr.json").read_text())
    array = json.loads(
        (piece / group["attributes"]["tierzero"]["current"] / "zarr.json").read_text()
    )
    return array["shape"][0] * {"float32": 4, "uint16": 2}[array["data_type"]]


def test_a_killed_rank_ends_the_run_and_it_resumes_bitwise(two_ranks, tmp_path) -> None:
    run_dir = tmp_path / "killed"
    proc = launch(run_dir)
    try:
        _wait_for_step(run_dir, 3, proc)
        os.kill(_worker_pid(proc.pid, rank=1), signal.SIGKILL)  # during step 4
        code, _, err = finish(proc)
    finally:
        proc.kill()
    assert code == 2, err
    assert "rank 1 was killed by SIGKILL" in err, err
    assert "Traceback" not in err, err
    path, _, skipped = newest_checkpoint(run_dir)  # every array checked against its checksums
    assert path.name == "step-00000002" and not skipped
    assert [step for step, _ in checkpoint_dirs(run_dir)] == [2]

    for code, _, err in [finish(node) for node in launch_as_two_nodes(run_dir, "--resume")]:
        assert code == 0, err
    resumed = export(run_dir, tmp_path / "resumed.safetensors")
    uninterrupted = export(two_ranks, tmp_path / "uninterrupted.safetensors")
    for key in uninterrupted:
        assert torch.equal(resumed[key], uninterrupted[key]), key


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and any(
            r.get("step") == step and "loss" in r for r in read_metrics(run_dir)
        ):
            return
        time.sleep(0.02)
    raise AssertionError(f"step {step} never finished")


def _worker_pid(launcher: int, rank: int) -> int:
    """The pid of the worker torchrun started as `rank` (a child of the launcher process)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(
            next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))
        )
        if ppid == launcher and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no worker of rank {rank} under pid {launcher}")


# -- ZeRO stages 1 and 2 through the CLI (stage 3 is the `two_ranks` run above: its budget is
# stage 3's, so the automatic choice is 3) ------------------------------------------------------


@pytest.fixture(scope="module")
def stage_two(tmp_path_factory) -> tuple[Path, str]:
    """A two-rank run at the host budget stage 2 needs, stage unset: the engine picks 2."""
    run_dir = tmp_path_factory.mktemp("stage2") / "run"
    code, out, err = finish(launch(run_dir, budget_stage=2))
    assert code == 0, err
    return run_dir, out


def test_the_stage_is_chosen_by_the_budget_and_printed(two_ranks, stage_two) -> None:
    tight = (two_ranks.parent / "stdout.txt").read_text()
    assert "ZeRO stage 3 (replicated params do not fit the budgets)" in tight
    assert "ZeRO stage 2 (replicated params fit the budgets)" in stage_two[1]
    assert Manifest.load(newest_checkpoint(two_ranks)[0]).stage == 3
    assert Manifest.load(newest_checkpoint(stage_two[0])[0]).stage == 2


def test_stage_two_equals_one_rank_and_stage_three(
    stage_two, one_rank, two_ranks, tmp_path
) -> None:
    """Stage 2 (chosen) within 5e-5 of the one-rank run and of the stage-3 run. Stage 1 differs
    from stage 2 only under accumulation, which tests/engine/test_stages.py checks in-process (a CLI
    run of it here would cost the suite ~25 s for the same numbers)."""
    stage3 = export(two_ranks, tmp_path / "stage3.safetensors")
    got = export(stage_two[0], tmp_path / "s2.safetensors")
    assert got.keys() == one_rank.keys()
    for key in one_rank:
        torch.testing.assert_close(got[key], one_rank[key], rtol=0, atol=5e-5)
        torch.testing.assert_close(got[key], stage3[key], rtol=0, atol=5e-5)


def test_stage_two_stores_whole_params_and_half_the_rest(stage_two) -> None:
    run_dir = stage_two[0]
    units = Manifest.load(newest_checkpoint(run_dir)[0]).units
    for rank in (0, 1):
        store = run_dir / "nvme" / f"rank{rank}"
        for kind, itemsize in (("master", 4), ("exp_avg", 4), ("exp_avg_sq", 4), ("param", 4)):
            for unit in units:
                shard = store / kind / f"u{unit.index:04d}" / f"r{rank}"
                nbytes = sum(
                    _current_array_nbytes(piece) for piece in shard.iterdir() if piece.is_dir()
                )
                if kind == "param":  # the whole unit on every rank
                    assert nbytes == unit.padded_numel * itemsize, (rank, kind, unit.name)
                    assert unit.numel <= nbytes / itemsize < unit.numel + 4096
                else:
                    assert nbytes == unit.padded_numel // 2 * itemsize, (rank, kind, unit.name)
                    assert unit.numel / 2 <= nbytes / itemsize < unit.numel / 2 + 4096


def test_stage_two_pool_peaks_match_its_prediction(stage_two) -> None:
    predicted = per_rank_prediction(stage=2)
    last = [r for r in read_metrics(stage_two[0]) if "loss" in r][-1]  # peaks since open
    for rank, counters in enumerate(last["ranks"]):
        for tier in (Tier.HOST, Tier.GPU):
            measured = counters[f"peak_{tier.value}_bytes"]
            assert (
                0.9 * predicted.tiers[tier].pool_bytes
                <= measured
                <= predicted.tiers[tier].pool_bytes
            ), (rank, tier)


def test_plan_prints_the_stage(tmp_path) -> None:
    def plan(*extra: str) -> dict:
        result = CliRunner().invoke(
            app, ["plan", "--model", "tiny", "--gpus", "2", "--nvme-free", "1TB", "--json", *extra]
        )
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    roomy = ("--host-mem", "64GB", "--gpu-mem", "80GB")
    assert (
        plan(*roomy)["stage"]["stage"] == 2
        and plan(*roomy, "--accumulate", "2")["stage"]["stage"] == 1
    )
    # stage 3 fits, replicated params do not
    tight = plan("--host-mem", "50MB", "--gpu-mem", "24MB")
    assert tight["stage"]["stage"] == 3 and tight["verdict"]["fits"], tight["stage"]
    forced = plan(*roomy, "--stage", "3")
    assert forced["stage"] == {
        "stage": 3,
        "reason": "forced",
        "text": "params, grads and optimizer states partitioned",
    }
    # replicated params: a rank's param home holds the whole model, not half
    assert plan(*roomy)["per_rank"]["peak_bytes"]["gpu"] > forced["per_rank"]["peak_bytes"]["gpu"]
    text = CliRunner().invoke(
        app,
        [
            "plan",
            "--model",
            "tiny",
            "--gpus",
            "2",
            "--nvme-free",
            "1TB",
            "--host-mem",
            "64GB",
            "--gpu-mem",
            "80GB",
        ],
    )
    assert "ZeRO stage 2 (replicated params fit the budgets)" in text.output
