"""Collectives on their own stream, checked on the CPU with two ranks and the recording fake.

The fake's `comm` stream runs each all-gather and reduce-scatter as NCCL does: after what the
issuing stream has queued, its output NaN until something waits for its event, its input read
when it runs (a change before then is named). Compared: two gloo ranks whose collectives go
through the fake (`nccl_like_collectives`) against plain PyTorch on the whole batch (within the
two-rank test's 5e-5: the mean over ranks sums in another order), and the fake's checks of each
rank's log; then a mutation of the engine that only the comm stream's ordering exposes (the
gather issued without waiting for its shard's host-to-device copy: the compute stream waited
for the copy, so the values were there, but on a GPU NCCL's stream could read the shard first).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from tests.support.checks import (
    check_allocator_memory_kept_alive,
    check_collectives_waited_for,
    check_d2h_copies_wait_for_their_source,
    check_no_copy_hazards,
    check_no_host_wait_on_compute,
    check_no_host_wait_on_io_threads,
)
from tests.support.engine import SMALL, batches, reference_run
from tests.support.fakes.comm import nccl_like_collectives
from tests.support.fakes.streams import RecordingStreams
from tests.support.watchers import watch_device_pool, watch_host_pool
from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine
from tierzero.engine.runtime import streams
from tierzero.engine.runtime.swaprunner import ParamShard, SwapRunner

STEPS = 2


def test_a_collective_lands_at_its_event_and_names_an_input_changed_before() -> None:
    fake = RecordingStreams()
    inp, out = torch.arange(4.0), torch.zeros(8)
    event = fake.collective(out, torch.cat([inp, inp]), inp)
    assert torch.isnan(out).all() and check_collectives_waited_for(fake.log)
    fake.wait(fake.compute, event)
    assert torch.equal(out, torch.cat([inp, inp])) and not check_collectives_waited_for(fake.log)
    assert not check_no_copy_hazards(fake.log)

    event = fake.collective(out, torch.cat([inp, inp]), inp)
    inp += 1  # the input buffer reused while the collective is in flight
    fake.wait(fake.compute, event)
    assert any("input of comm collective" in p for p in check_no_copy_hazards(fake.log))


def test_a_collective_is_ordered_after_its_issuing_stream_only() -> None:
    """Issued on comm, it reads a buffer an h2d copy fills: a hazard unless comm waited for the
    copy (compute waiting is not enough); issued on compute, it follows what compute waited for."""
    for waiter, hazard in (("comm", False), ("compute", True)):
        fake = RecordingStreams()
        shard, full = torch.zeros(4), torch.zeros(8)
        copied = fake.copy(shard, torch.ones(4), fake.h2d)
        fake.wait(getattr(fake, waiter), copied)
        with fake.current(fake.comm):
            fake.wait(fake.compute, fake.collective(full, torch.ones(8), shard))
        assert bool(check_no_copy_hazards(fake.log)) == hazard, waiter
    fake = RecordingStreams()
    copied = fake.copy(shard, torch.ones(4), fake.h2d)
    fake.wait(fake.compute, copied)
    fake.wait(fake.compute, fake.collective(full, torch.ones(8), shard))  # current: compute
    assert not check_no_copy_hazards(fake.log)


class _Patch:
    """`monkeypatch`'s `setattr` in a spawned rank, which lives only for the test."""

    setattr = staticmethod(setattr)


def _gather_before_its_copy(self: SwapRunner, record: ParamShard):
    """`SwapRunner._issue_gather` without ordering the comm stream after the shard's copy."""
    self.streams.wait(self.streams.comm, record.written)
    with self.streams.current(self.streams.comm):
        return self.comm.all_gather_async(self._shard(record.unit))


def _train(rank: int, root: str, name: str) -> None:
    """Train two steps through a fresh fake; write the fake's findings (and rank 0's weights)."""
    fake = RecordingStreams(separate_writes=True)
    streams.open_streams = lambda device: fake
    watch_device_pool(_Patch, fake)
    watch_host_pool(_Patch, fake)
    nccl_like_collectives(fake)
    cfg = Config(
        placement=Placement(*[Tier.HOST] * 5),
        stage=3,
        lr=3e-3,
        total_steps=STEPS,
        host_budget="256MiB",
        gpu_budget="256MiB",
        piece_numel=6144,
        overlap_comm=True,
    )
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=0), cfg) as engine:
        for _ in range(STEPS):
            x, y = data.next_batch()
            engine.train_step((x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
        weights = engine.master_state_dict()
    problems = [
        p
        for check in (
            check_no_host_wait_on_compute,
            check_d2h_copies_wait_for_their_source,
            check_no_copy_hazards,
            check_no_host_wait_on_io_threads,
            check_collectives_waited_for,
        )
        for p in check(fake.log)[:2]
    ]
    problems += check_allocator_memory_kept_alive(fake.log, fake.device_spans)[:2]
    if not any(e[0] == "collective" for e in fake.log):
        problems.append("no collective went through the comm stream")
    with open(f"{root}/{name}-problems-{rank}.json", "w") as f:
        json.dump(problems, f)
    if rank == 0:
        save_file(
            {k: v.contiguous() for k, v in weights.items() if k != "head.weight"},
            f"{root}/{name}-weights.safetensors",
        )


def _rank(rank: int, root: str) -> None:
    """One spawn for both runs (spawning costs more than training): the engine, then the
    mutation."""
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2
    )
    from tierzero.distributed import comm

    collectives = comm.all_gather_tensor, comm.reduce_scatter_tensor
    try:
        _train(rank, root, "engine")
        comm.all_gather_tensor, comm.reduce_scatter_tensor = collectives
        SwapRunner._issue_gather = _gather_before_its_copy
        _train(rank, root, "mutation")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_fake_ranks(tmp_path_factory) -> dict[str, tuple[list[str], dict[str, torch.Tensor]]]:
    """For the engine and its mutation: each rank's findings, and rank 0's weights."""
    root = tmp_path_factory.mktemp("fake-ranks")
    mp.spawn(_rank, args=(str(root),), nprocs=2, join=True)
    return {
        name: (
            [
                f"rank {r}: {p}"
                for r in range(2)
                for p in json.loads((root / f"{name}-problems-{r}.json").read_text())
            ],
            load_file(str(root / f"{name}-weights.safetensors")),
        )
        for name in ("engine", "mutation")
    }


def test_two_ranks_collectives_on_the_comm_stream_wait_only_on_events(two_fake_ranks) -> None:
    problems, weights = two_fake_ranks["engine"]
    _, ref = reference_run(SMALL, Config(offload="none", lr=3e-3, total_steps=STEPS), steps=STEPS)
    for key, value in weights.items():
        torch.testing.assert_close(value, ref[key], rtol=0, atol=5e-5)
    assert not problems, "\n".join(problems)


@pytest.mark.xfail(
    strict=True,
    reason="the all-gather is not ordered after its shard's host-to-device copy: "
    "NCCL's stream may read the shard before it lands",
)
def test_mutation_gather_before_its_copy(two_fake_ranks) -> None:
    problems, _ = two_fake_ranks["mutation"]
    assert not problems, "\n".join(problems)
