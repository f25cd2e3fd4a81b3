"""The optimizer's host work stays off the training thread, and its writes into device memory go
up on the h2d_write stream.

Compared: with overlap_step, the tensor calls `tierzero/engine/step/optim.py` makes on the training
thread (where autograd runs backward on the CPU) while training -- none: the new params' cast
into staging and into a cached nvme shard happen on the optimizer's thread, and the writes are
issued by the I/O loop -- in runs whose weights equal plain PyTorch's bitwise. And through the
recording fake with a write stream of its own, that every param write into device memory is an
h2d_write copy after compute, which compute waits for, still bitwise. And a look-ahead read of
optimizer states against a full pool with a transfer in flight: it returns before the transfer
finishes, having started nothing.
"""

from __future__ import annotations

import concurrent.futures
import threading
import traceback

import pytest
import torch
from test_copy_pipeline import train_through_fake
from tierzero.storage.base import BudgetExceededError
from torch.overrides import TorchFunctionMode

from tests.support.engine import SMALL, batches, reference_run
from tests.support.fakes.streams import RecordingStreams
from tierzero import Config, Offload, Placement, Tier, models
from tierzero.engine import Engine
from tierzero.engine.runtime import streams

_METADATA = {"view", "__getitem__", "__get__", "numel", "size", "element_size", "data_ptr", "dim"}


class OptimizerCalls(TorchFunctionMode):
    """The tensor calls that touch elements (not views of a buffer, not its size) made from
    optim.py on the thread that enters the mode (modes are per thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _METADATA:
            return func(*args, **(kwargs or {}))
        files = [f.filename for f in traceback.extract_stack(limit=12)[:-1]]
        if any(f.endswith("engine/step/optim.py") for f in files) and not any(
            f.endswith("fakes/streams.py") for f in files
        ):
            self.calls.append(
                f"{getattr(func, '__name__', func)} on {threading.current_thread().name}"
            )
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "placement",
    [Placement(*[Tier.NVME] * 5), Placement.for_offload(Offload.HOST)],
    ids=["nvme", "gpu-params"],
)
def test_no_optimizer_tensor_work_on_the_training_thread(
    tmp_path, monkeypatch, placement: Placement
) -> None:
    cfg = Config(
        placement=placement,
        nvme_path=[str(tmp_path / "nvme")],
        lr=3e-3,
        warmup_steps=1,
        total_steps=3,
        host_budget="256MiB",
        gpu_budget="256MiB",
        piece_numel=6144,
        overlap_step=True,
        prefetch_depth=2,
    )
    if placement.param is Tier.GPU:  # device memory apart from the host's: through the fake
        fake = RecordingStreams(separate_writes=True)
        monkeypatch.setattr(streams, "open_streams", lambda device: fake)
    _, ref_weights = reference_run(SMALL, cfg, steps=2)
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        with OptimizerCalls() as watch:
            for _ in range(2):
                engine.train_step(data.next_batch())
        weights = engine.master_state_dict()
    assert not watch.calls, "\n".join(watch.calls[:5])
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), key


@pytest.mark.parametrize("case", ["gpu-params-overlap", "gpu-params-accumulate"])
def test_param_writes_into_device_memory_go_up_on_h2d_write(
    tmp_path, monkeypatch, case: str
) -> None:
    problems, (losses, weights), (ref_losses, ref_weights) = train_through_fake(
        tmp_path, monkeypatch, case, separate_writes=True
    )
    assert losses == ref_losses
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), key
    assert not problems, "\n".join(problems)


def test_a_look_ahead_read_of_optimizer_states_never_waits_for_a_transfer(tmp_path) -> None:
    cfg = Config(
        placement=Placement(*[Tier.NVME] * 5),
        nvme_path=[str(tmp_path / "nvme")],
        lr=3e-3,
        host_budget="256MiB",
        piece_numel=6144,
        overlap_step=True,
    )
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        engine.train_step(batches().next_batch())  # the first forward sizes the host pool
        tiers, optimizer, unit = engine.parts.tiers, engine.opened.optimizer, engine.units[1]
        held: list[torch.Tensor] = []
        in_flight: concurrent.futures.Future = concurrent.futures.Future()
        tiers.pending.add(in_flight, lambda ok: [tiers.host_pool.give_back(b) for b in held])
        while True:  # every block of a piece's size leased
            try:
                held.append(tiers.lease_host(optimizer.works(unit)[0].numel * 4, wait=False))
            except BudgetExceededError:
                break
        # were the look-ahead to wait for the transfer, this would end it (and the test) in a minute
        finish = threading.Timer(60, in_flight.set_result, [None])
        finish.start()
        optimizer.prefetch(unit)
        finish.cancel()
        assert not in_flight.done() and not optimizer._prefetched
        in_flight.set_result(None)
        tiers.pending.drain()
