"""The stream layout: which stream carries what, and who waits for it.

Compared: a tied embedding's grad stash with the grad home on the device against plain PyTorch
(bitwise) and against the bytes it moves (none: it never leaves the device); a host wait for one
stream's copy against a stuck wait for another's (the waiter of one stream never holds up the
other's); each stream's events named by their stream. On a GPU (`cuda`): the compute stream is the
caller's current stream, and a device store copies what compute on a side stream wrote, not what the
default stream saw (in both directions). And a look-ahead lease against a full pool, which never
waits.
"""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch
from tierzero.storage.base import BudgetExceededError
from tierzero.storage.device import DevicePool, DeviceStore
from tierzero.storage.io import IOLoop

from tests.support.engine import SMALL, batches, reference_run
from tests.support.fakes.streams import RecordingStreams
from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine
from tierzero.engine.runtime import streams
from tierzero.engine.runtime.tiers import Tiers

ON_DEVICE = Placement(Tier.GPU, Tier.GPU, Tier.GPU, Tier.GPU, Tier.GPU)


def test_a_tied_units_stash_stays_on_the_device_with_a_device_grad_home(
    tmp_path, monkeypatch
) -> None:
    """Both uses of the tied embedding sum on the compute stream: nothing is stashed in a store
    (a round trip through it crossed PCIe four times), and the weights stay bitwise PyTorch's
    over accumulated micro-batches."""
    assert SMALL.tie_embeddings
    cfg = Config(
        placement=ON_DEVICE,
        nvme_path=[str(tmp_path)],
        lr=3e-3,
        warmup_steps=1,
        total_steps=3,
        host_budget="256MiB",
        gpu_budget="256MiB",
        piece_numel=6144,
        accumulate=2,
    )
    fake = RecordingStreams()
    monkeypatch.setattr(streams, "open_streams", lambda device: fake)
    stored: list[str] = []
    write = DeviceStore.write
    monkeypatch.setattr(
        DeviceStore, "write", lambda self, key, src: stored.append(key) or write(self, key, src)
    )
    ref_losses, ref_weights = reference_run(SMALL, cfg, steps=2)
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        losses = [engine.train_step(data.next_batch()) for _ in range(4)]
        weights = engine.master_state_dict()
    assert losses == ref_losses
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), key
    assert stored and not [k for k in stored if k.startswith("grad_uses/")]


def test_a_stuck_wait_on_one_stream_does_not_hold_up_another_streams() -> None:
    """Waits on `h2d` and `d2h` run on their own waiter threads: a d2h wait completes while an
    h2d wait is still blocked (one shared waiter would serve them in issue order)."""
    release = threading.Event()
    waited_on: dict[str, str] = {}

    def wait(lane: str, until: threading.Event | None) -> None:
        waited_on[lane] = threading.current_thread().name
        if until is not None:
            assert until.wait(timeout=60), "never released"  # the timeout only stops a hang

    with IOLoop(threads=1) as io:
        stuck = io.submit(io.wait_off_workers(wait, "h2d", release, lane="h2d"))
        io.submit(io.wait_off_workers(wait, "d2h", None, lane="d2h")).result(timeout=60)
        assert not stuck.done()
        release.set()
        stuck.result(timeout=60)
    assert waited_on == {"h2d": "tierzero-wait-h2d_0", "d2h": "tierzero-wait-d2h_0"}


def test_events_name_their_stream_and_writes_share_h2d_where_there_is_one() -> None:
    fake = RecordingStreams()
    assert fake.h2d_write == fake.h2d  # one h2d stream: writes are ordered after fetches
    event = fake.copy(torch.zeros(2), torch.ones(2), fake.d2h)
    assert fake.lane(event) == "d2h"
    cpu = streams.CpuStreams()
    assert cpu.h2d_write == cpu.h2d == cpu.h2d_act and cpu.lane(None) == "copy"


@pytest.mark.cuda
def test_cuda_compute_is_the_callers_current_stream_and_writes_have_their_own() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    s = streams.CudaStreams(device)
    assert len({s.h2d, s.h2d_write, s.h2d_act, s.d2h, s.comm}) == 5
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        assert s.compute == side
    assert s.compute == torch.cuda.current_stream(device)
    pinned = torch.empty(4, pin_memory=True)
    assert s.lane(s.copy(pinned, torch.ones(4, device=device), s.d2h)) == "d2h"


@pytest.mark.cuda
def test_a_device_store_copies_after_compute_on_the_callers_stream() -> None:
    """Compute on a side stream writes a tensor after a long sleep; a store write issued on that
    stream right after must copy the written values (ordered after the side stream, not the
    device's default stream, which has nothing queued)."""
    device = torch.device("cuda", torch.cuda.current_device())
    with IOLoop(threads=2) as io, DevicePool(1 << 20, device) as pool:
        store = DeviceStore(pool)
        store.open()
        side = torch.cuda.Stream(device)
        with torch.cuda.stream(side):
            src = torch.zeros(1 << 16, device=device)
            torch.cuda._sleep(200_000_000)  # about a tenth of a second of device time
            src.fill_(7.0)
            pending = io.submit(store.write("u0", src))
        pending.result()
        assert bool((store.view("u0") == 7.0).all())
        out = torch.empty_like(src)
        with torch.cuda.stream(side):  # compute writes the store in place (`view`), then it is read
            torch.cuda._sleep(200_000_000)
            store.view("u0").fill_(9.0)
            io.submit(store.read_into("u0", out)).result()
        assert bool((out == 9.0).all())
        store.close()


def test_a_look_ahead_lease_takes_what_finished_jobs_freed_and_never_waits_for_one(
    tmp_path,
) -> None:
    """Autograd's thread issues prefetches: with the pool full, a lease without `wait` reaps
    finished transfers and otherwise fails at once (the plan fetches the unit at its wait)
    instead of blocking on the oldest transfer in flight."""
    cfg = Config(
        placement=Placement(*[Tier.HOST] * 5),
        nvme_path=[str(tmp_path)],
        io_threads=1,
        host_budget="1MiB",
        gpu_budget="1MiB",
    )
    tiers = Tiers(cfg.tiering, cfg.streaming, cfg.formats, torch.device("cpu"), {Tier.HOST}).open()
    try:
        held = tiers.lease_host(1 << 20)
        finished: concurrent.futures.Future = concurrent.futures.Future()
        finished.set_result(None)
        tiers.pending.add(finished, lambda ok: tiers.host_pool.give_back(held))
        again = tiers.lease_host(1 << 20, wait=False)  # the finished job's buffer
        in_flight: concurrent.futures.Future = concurrent.futures.Future()
        tiers.pending.add(in_flight, lambda ok: tiers.host_pool.give_back(again))
        with pytest.raises(BudgetExceededError):
            tiers.lease_host(1 << 20, wait=False)  # a blocking lease would wait here forever
        in_flight.set_result(None)
        tiers.pending.drain()
    finally:
        tiers.close()
