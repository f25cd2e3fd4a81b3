"""No host-device synchronisation per micro-batch or per unit, counted with the recording fake.

Compared: the implicit syncs (`SyncWatch`: `.item()`, `.cpu()`, blocking `.to(device)`, blocking
copies into device memory) and host waits on the compute stream that the training thread makes over
two steps of micro-batches fed with `train_micro_batch` (the loop reads the losses itself, once per
step), for one configuration and for the same with three times the micro-batches per step, and with
more units, on the horizontal schedule (the vertical one's waiting activations pin host buffers,
which this fake GPU does not provide). The counts must be equal -- what a step syncs (reading the
grad norm to clip with) does not grow with either -- and at most two per step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.support.checks import check_no_host_wait_on_compute
from tests.support.engine import SMALL, batches
from tests.support.fakes.streams import RecordingStreams
from tests.support.watchers import SyncWatch, watch_device_pool
from tierzero import Config, Offload, Placement, Tier, models
from tierzero.engine import Engine
from tierzero.engine.runtime import streams
from tierzero.engine.runtime.batch import BatchStaging
from tierzero.reference import to_device

CASES = {  # placement, overlap_step, clip_grad_norm
    "host-clip": (Placement(*[Tier.HOST] * 5), False, 1.0),
    "nvme-overlap-clip-previous": (Placement(*[Tier.NVME] * 5), True, 1.0),
    "gpu-params": (Placement.for_offload(Offload.HOST), False, None),
}
STEPS = 2


def syncs(tmp_path, monkeypatch, case: str, accumulate: int, n_layers: int) -> list[str]:
    """Where the training thread synchronised with the device over `STEPS` steps."""
    placement, overlap, clip = CASES[case]
    cfg = Config(
        placement=placement,
        nvme_path=[str(tmp_path / f"nvme-{accumulate}-{n_layers}")],
        lr=3e-3,
        warmup_steps=1,
        total_steps=4,
        host_budget="256MiB",
        gpu_budget="256MiB",
        piece_numel=6144,
        overlap_step=overlap,
        accumulate=accumulate,
        schedule="horizontal",
        prefetch_depth=2,
        clip_grad_norm=clip,
        clip_previous_norm=overlap and clip is not None,
    )
    fake = RecordingStreams()
    monkeypatch.setattr(streams, "open_streams", lambda device: fake)
    watch_device_pool(monkeypatch, fake)
    data = batches()
    with Engine(
        models.build(replace(SMALL, n_layers=n_layers), device="meta", seed=cfg.seed), cfg
    ) as engine:
        # a first step outside the count: its first forward sizes the pools
        for _ in range(accumulate):
            engine.train_micro_batch(data.next_batch())
        start = len(fake.log)
        with SyncWatch(fake) as watch:
            for _ in range(STEPS * accumulate):
                engine.train_micro_batch(data.next_batch())
    return watch.where + check_no_host_wait_on_compute(fake.log[start:])


@pytest.mark.parametrize("case", list(CASES))
def test_syncs_do_not_grow_with_micro_batches_or_units(tmp_path, monkeypatch, case: str) -> None:
    base = syncs(tmp_path, monkeypatch, case, accumulate=1, n_layers=2)
    more_micro = syncs(tmp_path, monkeypatch, case, accumulate=3, n_layers=2)
    more_units = syncs(tmp_path, monkeypatch, case, accumulate=1, n_layers=4)
    assert len(more_micro) == len(base), "\n".join(more_micro)
    assert len(more_units) == len(base), "\n".join(more_units)
    assert len(base) <= 2 * STEPS, "\n".join(base)


@pytest.mark.xfail(strict=True, reason="S1: a blocking .to(device) of the batch per micro-batch")
def test_mutation_blocking_batch_copy(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(
        BatchStaging, "to_device", lambda self, batch: to_device(batch, self.streams.device)
    )
    test_syncs_do_not_grow_with_micro_batches_or_units(tmp_path, monkeypatch, "gpu-params")
