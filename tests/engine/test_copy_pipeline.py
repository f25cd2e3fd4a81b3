"""The copy pipeline's stream/event discipline, checked on the CPU with a recording fake.

Compared: `tierzero.Engine` run through `RecordingStreams` (copies land only when their event
is waited for; NaN before) against plain PyTorch (`ReferenceTrainer`): bitwise equal weights
mean no compute read a param buffer, and no host code read a grad piece, before its copy's
event. The log then says what each copy waited for, that the host never waited for the compute
stream (a device synchronisation) anywhere in the steps, that every h2d copy filled a pool buffer
or memory allocated for its stream (or waited for compute), that no I/O worker slept on an
event, that an nvme read's copy was issued by the I/O loop as it landed, and, with params homed
on the device and stepped on the host, that each new param piece went up on the h2d stream
after compute and that compute waited for it before reading the params again.
"""

from __future__ import annotations

import pytest
import torch

from tierzero import Config, Offload, Placement, StateKind, Tier, models
from tierzero.engine import streams, Engine
from tierzero.layout.keys import shard_key
from tierzero.storage.device import DevicePool

from engine_helpers import SMALL, batches, reference_run
from recording_streams import (RecordingStreams, check_d2h_copies_wait_for_their_source,
                               check_h2d_copies_wait_only_for_their_buffer,
                               check_h2d_copies_write_pool_or_h2d_memory, check_no_copy_hazards,
                               check_no_host_wait_on_compute, check_no_host_wait_on_io_threads,
                               check_writes_into_read_before_waited,
                               watch_device_pool)

HOST = Placement(Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST)
NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)
GPU_PARAMS = Placement.for_offload(Offload.HOST)  # params on the device, the step on the host

CASES = {  # (placement, overlap_step, accumulate)
    "host-overlap": (HOST, True, 1),
    "host-accumulate": (HOST, False, 2),
    "nvme-overlap-accumulate": (NVME, True, 2),
    "nvme": (NVME, False, 1),
    "gpu-params-overlap": (GPU_PARAMS, True, 1),
    "gpu-params-accumulate": (GPU_PARAMS, False, 2),
}


def test_the_fake_lands_a_copy_only_at_its_event_and_sees_unordered_copies() -> None:
    """The fake can fail: a read before the event sees NaN, after it the copied values; a copy
    of bytes another stream's copy writes is a hazard unless it waited for that copy."""
    fake = RecordingStreams()
    src, dst, back = torch.arange(4, dtype=torch.float32), torch.zeros(4), torch.zeros(4)
    event = fake.copy(dst, src, fake.h2d)
    assert torch.isnan(dst).all() and not fake.query(event)
    fake.wait(fake.compute, event)
    assert torch.equal(dst, src) and fake.query(event)
    assert not check_no_copy_hazards(fake.log)
    fake.copy(back, dst, fake.d2h, after=fake.record(fake.compute))  # ordered through compute's wait
    assert not check_no_copy_hazards(fake.log)
    fake.copy(dst, src, fake.h2d)  # overwrites what the d2h copy reads, without waiting for it
    assert check_no_copy_hazards(fake.log)


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_waits_only_on_events_and_stays_bitwise(tmp_path, monkeypatch, case: str) -> None:
    placement, overlap, accumulate = CASES[case]
    cfg = Config(placement=placement, nvme_path=[str(tmp_path / "nvme")], lr=3e-3, warmup_steps=1,
                 total_steps=3, host_budget="256MiB", gpu_budget="256MiB", piece_numel=6144,
                 overlap_step=overlap, accumulate=accumulate, prefetch_depth=2)
    fake = RecordingStreams()
    monkeypatch.setattr(streams, "open_streams", lambda device: fake)
    watch_device_pool(monkeypatch, fake)
    ref_losses, ref_weights = reference_run(SMALL, cfg, steps=2)
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        losses = [engine.train_step(data.next_batch()) for _ in range(2 * accumulate)]
        weights = engine.master_state_dict()
        engine.eval_loss(data.next_batch())  # a pass after the last step reads its params
        param_spans = [] if placement.param is not Tier.GPU else [
            (v.data_ptr(), v.data_ptr() + v.numel() * v.element_size())
            for v in (engine.tiers.stores[Tier.GPU].view(shard_key(StateKind.PARAM, u.index, 0)) for u in engine.units)]
    assert losses == ref_losses
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), key
    streams_used = {e[1] for e in fake.log if e[0] == "copy"}
    problems = [p for check in (check_h2d_copies_wait_only_for_their_buffer, check_no_host_wait_on_compute,
                                check_d2h_copies_wait_for_their_source, check_no_copy_hazards,
                                check_h2d_copies_write_pool_or_h2d_memory, check_no_host_wait_on_io_threads)
                for p in check(fake.log)[:2]]
    problems += check_writes_into_read_before_waited(fake.log, param_spans)[:2]
    problems += [f"no copy on the {s} stream" for s in ("h2d", "d2h") if s not in streams_used]
    assert not problems, "\n".join(problems)
    if placement is NVME:  # a landed read's copy is issued by the I/O loop, not at a plan op
        assert any(e[0] == "copy" and e[1] == "h2d" and e[4] == "tierzero-io-loop" for e in fake.log)


def test_a_device_buffer_carries_its_release_event_to_its_next_holder() -> None:
    pool = DevicePool(1 << 20, "cpu")
    with pool:
        buf = pool.lease(4096)
        assert pool.take_ready(buf) is None  # fresh
        release = object()
        pool.give_back(buf, ready=release)
        again = pool.lease(4096)
        assert again.data_ptr() == buf.data_ptr()
        assert pool.take_ready(again) is release and pool.take_ready(again) is None  # taken once
        pool.give_back(again)


def test_cpu_streams_copy_at_once_and_cuda_streams_need_an_indexed_device() -> None:
    cpu = streams.open_streams(torch.device("cpu"))
    assert isinstance(cpu, streams.CpuStreams) and not cpu.separate
    dst = torch.zeros(3)
    event = cpu.copy(dst, torch.ones(3), cpu.h2d)
    assert torch.equal(dst, torch.ones(3)) and cpu.query(event)
    with pytest.raises(ValueError, match="cuda:k"):
        streams.CudaStreams(torch.device("cuda"))
