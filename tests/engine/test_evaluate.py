"""One evaluation in one pass over the weights (`Engine.evaluate`) against the per-window path.

fp32, one rank, every state on NVMe, the built-in model tied and untied, after a training step
(so the evaluation reads stepped weights): each window's summed loss equals
`eval_loss(window, summed=True)` bitwise; the transfer counters show every unit's params read
once for the whole set (a tied embedding twice: the head binds it again), where the per-window
path reads them once per window; nothing is written (no grad reaches its home); with the waiting
activations forced into a small host budget they spill to NVMe and the losses stay equal.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.engine import SMALL, batches, engine_config
from tierzero import Engine, models
from tierzero.engine.vertical.chain import chain_of
from tierzero.engine.vertical.evaluate import EvalLayout, EvalPass, join

WINDOW_TOKENS = 2 * 32  # batches of 2 rows of 32 tokens


def _param_bytes(engine: Engine) -> int:
    """Bytes of one read of every unit's params per use: a tied embedding's again for the head."""
    units = engine.units
    return sum(u.param_numel * 4 for u in units) + sum(
        units[v].param_numel * 4 for u in units for v in u.uses_with
    )


@pytest.mark.parametrize("tied", [False, True])
def test_one_pass_equals_each_window_and_reads_each_unit_once(tmp_path, tied: bool) -> None:
    args = dataclasses.replace(SMALL, tie_embeddings=tied)
    data = batches(batch_size=2, seq_len=32)
    windows = data.val_batches(24 * WINDOW_TOKENS)
    assert len(windows) == 24
    with Engine(models.build(args, device="meta"), engine_config(tmp_path, dtype="fp32")) as engine:
        engine.train_step(data.next_batch())
        engine.stats()
        one_pass = engine.evaluate(windows)
        read_once = engine.stats()
        per_window = [engine.eval_loss(w, summed=True) for w in windows]
        read_each = engine.stats()
        assert engine.parts.model.training  # the mode is restored
        assert engine.notes() == []  # no fallback to windows
    assert one_pass == per_window  # bitwise: each window's head runs on its own rows
    fetched = read_once["bytes_host->gpu"]
    assert fetched == _param_bytes(engine)
    assert (
        read_once.get("bytes_nvme->host", 0) + read_once.get("bytes_host_cache_hit", 0) == fetched
    )
    assert read_each["bytes_host->gpu"] == len(windows) * fetched
    written = {k: v for k, v in read_once.items() if k.startswith("bytes_") and k.endswith("nvme")}
    # no grad, no activation, no write
    assert written == {} and read_once.get("bytes_gpu->host", 0) == 0


def test_waiting_activations_spilled_to_nvme_stay_exact(tmp_path) -> None:
    """A host budget of three windows' hidden states: the rest wait on NVMe and come back."""
    data = batches(batch_size=2, seq_len=32)
    windows = data.val_batches(12 * WINDOW_TOKENS)
    with Engine(
        models.build(SMALL, device="meta"), engine_config(tmp_path, dtype="fp32")
    ) as engine:
        engine.train_step(data.next_batch())
        chain = chain_of(engine.parts.model, engine.units)
        entry = WINDOW_TOKENS * SMALL.dim * 4
        layout = EvalLayout(join(windows, WINDOW_TOKENS), store_bytes=3 * entry)
        parts = engine.parts
        eval_pass = EvalPass(parts.layout, parts.device, parts.tiers, engine.opened, chain, layout)
        with torch.no_grad():
            spilled = eval_pass.run(windows)
        per_window = [engine.eval_loss(w, summed=True) for w in windows]
    assert eval_pass.store.spilled >= (len(windows) - 3) * (len(engine.units) - 2)
    assert eval_pass.store.peak_bytes <= 3 * entry
    assert spilled == per_window


def test_micro_batches_join_consecutive_windows_of_one_length() -> None:
    ids = [
        torch.zeros(2, 8),
        torch.zeros(2, 8),
        torch.zeros(2, 4),
        torch.zeros(2, 4),
        torch.zeros(2, 4),
    ]
    windows = [(x, x) for x in ids]
    assert join(windows, 32) == [[0, 1], [2, 3, 4]]
    assert join(windows, 16) == [[0], [1], [2, 3], [4]]
    assert join(windows, 1) == [[0], [1], [2], [3], [4]]  # never less than one window


def test_batches_that_are_not_pairs_are_evaluated_window_by_window(tmp_path) -> None:
    data = batches(batch_size=2, seq_len=32)
    windows = [{"idx": x, "targets": y} for x, y in data.val_batches(3 * WINDOW_TOKENS)]
    with Engine(
        models.build(SMALL, device="meta"), engine_config(tmp_path, dtype="fp32")
    ) as engine:
        one_pass = engine.evaluate(windows)
        assert one_pass == [engine.eval_loss(w, summed=True) for w in windows]
        assert any(
            "window by window" in note and "not (token ids, targets) pairs" in note
            for note in engine.notes()
        )
