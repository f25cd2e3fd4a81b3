"""The copy pipeline on a real GPU (skipped without CUDA; never run in this project's CI).

Compared: `tierzero.Engine` on `cuda:0` against `ReferenceTrainer` on the same GPU (fp32, one
rank, no clipping: bitwise where the kernels are the same; CPU AdamW vs GPU AdamW is compared
within a tolerance, as the two implementations round differently); pinned blocks through the
h2d and d2h streams and back; and a `torch.profiler` trace of a tiered step in which host->
device copies run while compute kernels do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tierzero.storage.device import DevicePool, DeviceStore
from tierzero.storage.host import HostPool
from tierzero.storage.io import IOLoop

from tests.support.engine import SMALL, batches
from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine
from tierzero.engine.runtime.streams import CudaStreams
from tierzero.models import ModelArgs
from tierzero.reference import ReferenceTrainer

pytestmark = pytest.mark.cuda

# every state on the GPU: the engine's AdamW runs on the GPU like the reference's
ON_GPU = Placement()
HOST = Placement(Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST)
NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)


def run_pair(
    tmp_path, placement: Placement, steps: int = 3
) -> tuple[dict, dict, list[float], list[float]]:
    cfg = Config(
        placement=placement,
        nvme_path=[str(tmp_path / "nvme")],
        lr=3e-3,
        warmup_steps=1,
        total_steps=steps,
        device="cuda:0",
        dtype="fp32",
        piece_numel=6144,
        host_budget="1GiB",
        gpu_budget="1GiB",
    )
    ref = ReferenceTrainer(models.build(SMALL, seed=cfg.seed), cfg, device="cuda:0")
    data = batches()
    ref_losses = [ref.train_step(data.next_batch()) for _ in range(steps)]
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        losses = [engine.train_step(data.next_batch()) for _ in range(steps)]
        weights = engine.master_state_dict()
    return weights, ref.master_state_dict(), losses, ref_losses


@pytest.fixture
def deterministic() -> Iterator[None]:
    """Same kernels, same bits: some CUDA backward kernels (the embedding's) add with atomics."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def test_all_on_gpu_is_bitwise_equal_to_pytorch_on_the_gpu(tmp_path, deterministic) -> None:
    weights, ref, losses, ref_losses = run_pair(tmp_path, ON_GPU)
    assert losses == ref_losses
    for key in ref:
        assert torch.equal(weights[key].cpu(), ref[key].cpu()), key


@pytest.mark.parametrize("placement", [HOST, NVME], ids=["host", "nvme"])
def test_offloaded_placements_track_pytorch_on_the_gpu(tmp_path, placement: Placement) -> None:
    """CPU AdamW (offloaded optimizer) against the reference's GPU AdamW: same maths, different
    kernels, so equal within fp32 rounding, step by step."""
    weights, ref, losses, ref_losses = run_pair(tmp_path, placement)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for key in ref:
        torch.testing.assert_close(weights[key].cpu(), ref[key].cpu(), rtol=1e-5, atol=1e-6)


def test_pinned_blocks_round_trip_through_the_copy_streams() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    streams = CudaStreams(device)
    with HostPool(64 << 20, device=device) as pool:
        assert pool.pin
        src = pool.lease(16 << 20).view(torch.float32)
        src.copy_(torch.randn(src.numel()))
        back = pool.lease(16 << 20).view(torch.float32)
        on_gpu = torch.empty_like(src, device=device)
        there = streams.copy(on_gpu, src, streams.h2d, after=streams.record(streams.compute))
        streams.wait(streams.compute, there)
        on_gpu.mul_(2)  # compute reads only after the copy's event
        done = streams.copy(back, on_gpu, streams.d2h, after=streams.record(streams.compute))
        streams.host_wait(done)
        assert torch.equal(back, src * 2)
        registered = pool.registrations
        pool.give_back(src.view(torch.uint8))
        pool.give_back(back.view(torch.uint8))
        again = pool.lease(16 << 20)  # a block of a size it has: reused, not registered again
        assert pool.registrations == registered
        pool.give_back(again)


def test_device_store_copies_see_compute_queued_before_them() -> None:
    """A GPU store's copies run on its own stream and wait for one event, not a stream: a read
    still sees what compute wrote in place through `view()`, queued behind slow kernels, and a
    write into a block given back with a release event lands after that release."""
    device = torch.device("cuda", torch.cuda.current_device())
    with IOLoop(2) as io, DevicePool(64 << 20, device) as pool:
        store = DeviceStore(pool)
        store.open()
        src = torch.arange(1 << 20, dtype=torch.float32)
        io.submit(store.write("param/u0000/r0", src)).result()
        busy = torch.randn(2048, 2048, device=device)
        for _ in range(50):  # queue slow work on the compute (default) stream
            busy = busy @ busy / 2048
        store.view("param/u0000/r0").mul_(2)  # compute writes the shard in place, after it
        out = torch.empty(1 << 20)
        io.submit(store.read_into("param/u0000/r0", out)).result()
        assert torch.equal(out, src * 2)
        block = pool.lease(4 << 20)
        block.view(torch.float32).fill_(5)  # compute still uses the block ...
        release = torch.cuda.Event()
        release.record()
        pool.give_back(block, ready=release)  # ... until this event
        io.submit(store.write("param/u0001/r0", src)).result()
        assert torch.equal(store.view("param/u0001/r0").cpu(), src)
        store.close()


def test_host_to_device_copies_overlap_compute_kernels(tmp_path) -> None:
    """A torch.profiler trace of tiered steps: some H2D memcpy runs while a compute kernel does."""
    args = ModelArgs(
        dim=1024,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=4096,
        ffn_dim=4096,
        max_seq_len=512,
        tie_embeddings=False,
    )
    cfg = Config(
        placement=HOST,
        nvme_path=[str(tmp_path / "nvme")],
        device="cuda:0",
        dtype="bf16",
        host_budget="8GiB",
        gpu_budget="8GiB",
        prefetch_depth=2,
    )
    data = batches(batch_size=8, seq_len=512)
    with Engine(models.build(args, device="meta", seed=0), cfg) as engine:
        engine.train_step(data.next_batch())  # warm-up: pools and allocator settle
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.train_step(data.next_batch())
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [(e.time_range.start, e.time_range.end) for e in events if "HtoD" in e.name]
    kernels = [
        (e.time_range.start, e.time_range.end)
        for e in events
        if "Memcpy" not in e.name and "Memset" not in e.name
    ]
    assert copies and kernels
    overlapping = [c for c in copies if any(k0 < c[1] and c[0] < k1 for k0, k1 in kernels)]
    assert overlapping, "no host->device copy ran while a compute kernel did"


# Run in a fresh process: this one has used cuda:0 already. `_cuda_hasPrimaryContext` asks the
# driver whether a GPU has this process's context without creating one (PyTorch's own
# test_cuda_primary_ctx checks the same way); `memory_allocated` would miss a bare context.
ONLY_CUDA_1 = """
import sys
import torch
from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine
from tests.support.engine import SMALL, batches

cfg = Config(placement=Placement(*[Tier.NVME] * 5), nvme_path=[sys.argv[1]], device="cuda:1",
             piece_numel=6144, host_budget="1GiB", gpu_budget="1GiB", accumulate=2,
             overlap_step=True)
data = batches()
with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
    for _ in range(4):
        engine.train_step(data.next_batch())
    assert engine.parts.tiers.device_pool.device == torch.device("cuda", 1)
    during = torch._C._cuda_hasPrimaryContext(0)
print("contexts", during, torch._C._cuda_hasPrimaryContext(0), torch._C._cuda_hasPrimaryContext(1))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_an_engine_on_cuda_1_puts_nothing_on_cuda_0(tmp_path) -> None:
    """No context on cuda:0, while training or after: the training thread, autograd's, the I/O
    threads (which step AdamW, lease device buffers and pin host memory) all use cuda:1."""
    repo = str(Path(__file__).parents[2])  # tests.support
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-c", ONLY_CUDA_1, str(tmp_path / "nvme")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-4:] == ["contexts", "False", "False", "True"], run.stdout


@pytest.mark.parametrize("placement", [HOST, NVME], ids=["host", "nvme"])
def test_compact_state_stepped_on_the_gpu_gives_the_cpu_steps_bits(tmp_path, placement) -> None:
    """int8 moments and a bf16 master stepped on the GPU by choice (`--optimizer-device gpu`:
    the states come up through pinned buffers and go back) against the same run stepped by the
    CPU kernel: the torch ops on CUDA and the kernel compute one formula (IEEE sqrt, no fused
    multiply-add), so the weights are equal bitwise."""
    weights = {}
    for side in ("cpu", "gpu"):
        config = Config(
            placement=placement,
            nvme_path=[str(tmp_path / side / "nvme")],
            device="cuda:0",
            dtype="bf16",
            optimizer_state="int8",
            master="bf16",
            optimizer_device=side,
            lr=3e-3,
        )
        data = batches()
        with Engine(models.build(SMALL, device="meta", seed=0), config) as engine:
            for _ in range(3):
                engine.train_step(data.next_batch())
            weights[side] = {k: v.cpu() for k, v in engine.master_state_dict().items()}
    for key in weights["cpu"]:
        assert torch.equal(weights["gpu"][key], weights["cpu"][key]), key
