"""The piece size and prefetch depth chosen when they are left open, counted by hand.

Three blocks of 4 Mi fp32 parameters, everything on nvme, the CPU device (one RAM), no
overlap_step. With pieces of p MiB of fp32 (a piece larger than a unit is the unit) and
prefetch depth d, and a = max(1, d) + 1 pieces in flight, host memory peaks at (MiB) the
compute pool's params in flight, 16 (d + 1) (at most the three units), one unit's grads, 32
(its weights' and the flat fp32 grad), and the host pool at its busiest phase: forward's staged
params, 16 (d + 1); backward's, at most two units (the first unit backward uses is the one
forward ended with), and a grad pieces written; or the optimizer's 4 states x a pieces plus
one new param piece.
"""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from tierzero.cli.output import Output
from tierzero.cli.plan import _print_report

import tierzero.planning.streaming as streaming_mod
from tierzero import models
from tierzero.config import Placement, Tier
from tierzero.layout.partition import partition
from tierzero.models import ModelArgs
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.planreport import make_plan
from tierzero.planning.streaming import (
    DEFAULT,
    MIN_REQUEST_BYTES,
    Shortfall,
    Streaming,
    choose_streaming,
    ladder,
    streamed,
)
from tierzero.planning.workload import Workload

MiB = Mi = 1 << 20
Ki = 1 << 10
NVME = Placement(*[Tier.NVME] * 5)
HOST = Placement(*[Tier.HOST] * 5)
WORK = Workload.from_sizes(
    [("blocks.0", 4 * Mi), ("blocks.1", 4 * Mi), ("blocks.2", 4 * Mi)],
    compute_itemsize=4,
    device="cpu",
    overlap=False,
)


def by_hand(piece: int, depth: int) -> float:
    """Host memory in MiB, as the module docstring counts it."""
    p, a = min(piece, 4 * Mi) * 4 / MiB, max(1, depth) + 1
    forward, backward, optimizer = (
        16 * min(depth + 1, 3),
        16 * min(depth + 1, 2) + a * p,
        4 * a * p + p,
    )
    return 16 * min(depth + 1, 3) + 32 + max(forward, backward, optimizer)


def test_the_hand_count_is_the_memory_models_on_every_rung() -> None:
    for s in ladder():
        assert (
            peak_memory(streamed(WORK, s), NVME).needs()[Tier.HOST]
            == by_hand(s.piece_numel, s.prefetch_depth) * MiB
        )


@pytest.mark.parametrize(
    "budget_mib, chosen",
    [
        (300, Streaming(16 * Mi, 2)),  # roomy: the defaults (288)
        (210, Streaming(16 * Mi, 1)),  # one unit less in flight (208)
        (
            150,
            Streaming(2 * Mi, 1),
        ),  # pieces of a unit or more need 208 at depth 1; 2 Mi at depth 2, 184; at 1, 136
        (130, Streaming(1 * Mi, 1)),  # 1 Mi at depth 2 needs 132; at 1, 104
        (100, Streaming(512 * Ki, 1)),  # exactly: 32 + 32 + backward's 32 + 2 pieces of 2 MiB
        (
            97,
            Streaming(128 * Ki, 1),
        ),  # 256 Ki (1 MiB requests) at depth 1 needs 98: smaller requests
        (96.5, Streaming(64 * Ki, 1)),  # the last rung, exactly
    ],
)
def test_the_defaults_or_else_the_first_rung_that_fits(
    budget_mib: float, chosen: Streaming
) -> None:
    assert choose_streaming(WORK, NVME, {Tier.HOST: int(budget_mib * MiB)}) == chosen
    assert by_hand(chosen.piece_numel, chosen.prefetch_depth) <= budget_mib
    before = ladder()[: ladder().index(chosen)]
    assert all(by_hand(s.piece_numel, s.prefetch_depth) > budget_mib for s in before)


def test_below_the_last_rung_the_shortfall_is_counted_there() -> None:
    short = choose_streaming(WORK, NVME, {Tier.HOST: 96 * MiB, Tier.GPU: None})
    assert short == Shortfall(
        Streaming(64 * Ki, 1), {Tier.HOST: int(by_hand(64 * Ki, 1) * MiB)}, {Tier.HOST: 96 * MiB}
    )


def test_given_values_are_kept_and_the_other_is_chosen() -> None:
    assert choose_streaming(WORK, NVME, {Tier.HOST: 150 * MiB}, prefetch_depth=2) == Streaming(
        1 * Mi, 2
    )  # 2 Mi: 184
    assert choose_streaming(WORK, NVME, {Tier.HOST: 210 * MiB}, piece_numel=4 * Mi) == Streaming(
        4 * Mi, 1
    )
    assert choose_streaming(WORK, NVME, {Tier.HOST: 100 * MiB}, prefetch_depth=0) == Streaming(
        1 * Mi, 0
    )  # 2 Mi: 120
    need = peak_memory(streamed(WORK, Streaming(8192, 1)), NVME).needs()[Tier.HOST]
    assert choose_streaming(
        WORK, NVME, {Tier.HOST: 10 * MiB}, piece_numel=8192, prefetch_depth=1
    ) == Shortfall(Streaming(8192, 1), {Tier.HOST: need}, {Tier.HOST: 10 * MiB})


def test_the_ladder_keeps_requests_of_a_mib_and_never_chooses_depth_0() -> None:
    """The defaults first; each piece size at depth 2 then 1; pieces of 1 MiB of fp32 or more
    before smaller ones; a prefetch depth of 0 (every fetch waits) only when given."""
    rungs = ladder()
    assert rungs[0] == DEFAULT == Streaming(16 * Mi, 2) and rungs[-1] == Streaming(64 * Ki, 1)
    large = [s.piece_numel * 4 >= MIN_REQUEST_BYTES for s in rungs]
    assert large == sorted(large, reverse=True) and large.count(True) == 7 * 2
    assert all(s.prefetch_depth in (1, 2) for s in rungs) and len(rungs) == len(set(rungs)) == 9 * 2


def test_it_evaluates_one_setting_when_the_defaults_fit_and_none_when_the_homes_do_not(
    monkeypatch,
) -> None:
    """Cheap by construction: the planner asks it for every candidate placement."""
    calls = []
    monkeypatch.setattr(
        streaming_mod, "peak_memory", lambda w, p: calls.append(w.piece_numel) or peak_memory(w, p)
    )
    assert choose_streaming(WORK, NVME, {Tier.HOST: 300 * MiB}) == DEFAULT and calls == [16 * Mi]
    calls.clear()
    homes = 12 * Mi * (4 + 4 + 12)  # every state of 12 Mi params homed in host memory: 240 MiB
    assert choose_streaming(WORK, HOST, {Tier.HOST: 200 * MiB}) == Shortfall(
        DEFAULT, {Tier.HOST: homes}, {Tier.HOST: 200 * MiB}
    )
    assert calls == []
    calls.clear()
    assert isinstance(choose_streaming(WORK, NVME, {Tier.HOST: 90 * MiB}), Shortfall)
    assert calls == [16 * Mi, 64 * Ki]  # the top, then the last rung: nothing between is walked


def test_plan_keeps_the_defaults_where_they_fit_and_prints_the_choice_where_not() -> None:
    """Issue 22's case: 134M parameters (GPT-3 small's shape with LLaMA's blocks, vocab 32000,
    untied) in fp32 on the CPU, batches of 1 x 128 tokens. With 64 GB of host memory nothing
    moves; with 512 MiB the defaults need over 1 GB, and everything on nvme fits with pieces of
    1 Mi elements (4 MiB requests) at depth 1, which `plan` prints."""
    args = ModelArgs(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000, ffn_dim=2048
    )
    assert args.param_count() == 134_105_856 and not args.tie_embeddings
    units = partition(models.build(args, device="meta"), 1, None)
    kw = dict(units=units, args=args, dtype="fp32", batch_size=1, seq_len=128, nvme_free="1TB")
    roomy = make_plan("134m", host_mem="64GB", **kw)
    assert roomy.streaming == DEFAULT and roomy.as_dict()["streaming"]["default"]
    report = make_plan("134m", host_mem="512MiB", **kw)
    assert report.choice.fits and report.device == "cpu" and report.placement == NVME
    assert report.streaming == Streaming(1 * Mi, 1) and report.chosen == (
        "piece_numel",
        "prefetch_depth",
    )
    at_defaults = peak_memory(streamed(report.workload, DEFAULT), NVME).needs()[Tier.HOST]
    assert at_defaults > 1000 * MiB and report.choice.resident_bytes[Tier.HOST] <= 512 * MiB
    out, printer = io.StringIO(), Output()
    printer.console = Console(file=out, width=80)
    _print_report(printer, report)
    assert (
        "Streaming: pieces of 1 Mi elements (4.2 MB of fp32), prefetch depth 1 (chosen: the "
        "defaults do not fit)" in " ".join(out.getvalue().split())
    )
