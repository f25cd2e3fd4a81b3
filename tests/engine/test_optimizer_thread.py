"""With overlap_step every piece's AdamW runs on the optimizer's one thread, never on an I/O
worker: one OpenMP team steps the pieces instead of one full team per worker
competing with the chunk reads and writes. Compared: the threads that ran `adamw_step` in an
overlapped run whose weights still equal plain PyTorch's bitwise."""

from __future__ import annotations

import threading

import torch

from tierzero import Config, Placement, Tier
from tierzero.engine.step import optim

from tests.support.engine import SMALL, engine_weights, reference_run


def test_overlapped_steps_run_on_the_optimizer_thread_and_stay_bitwise(tmp_path, monkeypatch) -> None:
    threads: set[str] = set()
    adamw_step = optim.adamw_step

    def recorded(*args, **kwargs) -> None:
        threads.add(threading.current_thread().name)
        adamw_step(*args, **kwargs)

    monkeypatch.setattr(optim, "adamw_step", recorded)
    cfg = Config(placement=Placement(*[Tier.NVME] * 5), nvme_path=[str(tmp_path / "nvme")], lr=3e-3,
                 warmup_steps=1, total_steps=3, host_budget="256MiB", piece_numel=6144, overlap_step=True,
                 io_threads=4)
    _, ref_weights = reference_run(SMALL, cfg, steps=2)
    weights = engine_weights(SMALL, cfg, steps=2)
    assert threads == {f"tierzero-wait-{optim.OPTIMIZER_LANE}_0"}
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), key
