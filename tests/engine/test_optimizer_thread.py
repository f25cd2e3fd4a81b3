"""With overlap_step every piece's AdamW runs on the I/O loop's one host-math thread, never on
an I/O worker: one OpenMP team steps the pieces instead of one full team per worker
competing with the chunk reads and writes. Compared: the threads that ran `adamw_step` in an
overlapped run whose weights still equal plain PyTorch's bitwise."""

from __future__ import annotations

import threading

import torch
from tierzero.storage.io import MATH_LANE, IOLoop

from tests.support.engine import SMALL, engine_weights, reference_run
from tierzero import Config, Placement, Tier
from tierzero.engine.step import optim


def test_overlapped_steps_run_on_the_optimizer_thread_and_stay_bitwise(
    tmp_path, monkeypatch
) -> None:
    threads: set[str] = set()
    adamw_step = optim.adamw_step

    def recorded(*args, **kwargs) -> None:
        threads.add(threading.current_thread().name)
        adamw_step(*args, **kwargs)

    monkeypatch.setattr(optim, "adamw_step", recorded)
    cfg = Config(
        placement=Placement(*[Tier.NVME] * 5),
        nvme_path=[str(tmp_path / "nvme")],
        lr=3e-3,
        warmup_steps=1,
        total_steps=3,
        host_budget="256MiB",
        piece_numel=6144,
        overlap_step=True,
        io_threads=4,
    )
    _, ref_weights = reference_run(SMALL, cfg, steps=2)
    weights = engine_weights(SMALL, cfg, steps=2)
    assert threads == {f"tierzero-wait-{MATH_LANE}_0"}
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), key


def test_backward_waiting_for_the_optimizers_buffers_is_counted(tmp_path, monkeypatch) -> None:
    """Backward hands each unit to the optimizer and leases its pieces' buffers; when the
    steps in flight hold the pool's buffers, backward waits, and that wait is reported as
    `wait_optimizer_s` (part of `io_wait_s`), here forced by a step slowed to 50 ms a piece."""
    from tests.support.engine import batches
    from tierzero import models
    from tierzero.engine import Engine

    adamw_step = optim.adamw_step

    def slow(*args, **kwargs) -> None:
        threading.Event().wait(0.05)
        adamw_step(*args, **kwargs)

    monkeypatch.setattr(optim, "adamw_step", slow)
    cfg = Config(
        placement=Placement(*[Tier.NVME] * 5),
        nvme_path=[str(tmp_path / "nvme")],
        lr=3e-3,
        total_steps=2,
        piece_numel=6144,
        overlap_step=True,
        prefetch_depth=1,
    )
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        engine.stats()
        engine.train_step(data.next_batch())
        stats = engine.stats()
    assert 0 < stats["wait_optimizer_s"] <= stats["io_wait_s"]


def test_host_math_runs_on_one_thread_with_its_own_openmp_team() -> None:
    """The math lane's team is set on that thread alone: the caller's stays as it was."""
    before = torch.get_num_threads()
    try:
        with IOLoop(2, math_threads=1) as io:
            seen = io.run(
                io.run_math(lambda: (threading.current_thread().name, torch.get_num_threads()))
            )
        assert seen == (f"tierzero-wait-{MATH_LANE}_0", 1)
        assert torch.get_num_threads() == before
    finally:
        # torch starts new threads with the last count set anywhere: put it back for later tests
        restore = threading.Thread(target=torch.set_num_threads, args=(before,))
        restore.start()
        restore.join()
