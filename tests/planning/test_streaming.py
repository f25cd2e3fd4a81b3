"""The piece size and prefetch depth the engine chooses when they are left to it, counted by hand.

Three blocks of 4 Mi fp32 parameters, everything on nvme, the CPU device (one RAM), no
overlap_step. With pieces of P MiB of fp32 (a piece larger than a unit is the unit) and
prefetch depth d, and a = max(1, d) + 1 pieces in flight, host memory peaks at (MiB) the
compute pool's params in flight, 16 (d + 1) (at most the three units), one unit's grads, 32
(its weights' and the flat fp32 grad), and the host pool at its busiest phase: forward's staged
params, 16 (d + 1); backward's, at most two units (the first unit backward uses is the one
forward ended with), and a grad pieces written; or the optimizer's 4 states x a pieces plus
one new param piece.
"""

from __future__ import annotations

import pytest

from tierzero.config import Placement, Tier
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.streaming import (MIN_REQUEST_BYTES, Shortfall, Streaming, choose_streaming, ladder,
                                         streamed)
from tierzero.planning.workload import Workload

MiB = Mi = 1 << 20
Ki = 1 << 10
NVME = Placement(*[Tier.NVME] * 5)
WORK = Workload.from_sizes([("blocks.0", 4 * Mi), ("blocks.1", 4 * Mi), ("blocks.2", 4 * Mi)], compute_itemsize=4,
                           device="cpu", overlap=False)


def by_hand(piece: int, depth: int) -> float:
    """Host memory in MiB, as the module docstring counts it."""
    p, a = min(piece, 4 * Mi) * 4 / MiB, max(1, depth) + 1
    forward, backward, optimizer = 16 * min(depth + 1, 3), 16 * min(depth + 1, 2) + a * p, 4 * a * p + p
    return 16 * min(depth + 1, 3) + 32 + max(forward, backward, optimizer)


def test_the_hand_count_is_the_memory_models_on_every_rung() -> None:
    for s in ladder():
        need = peak_memory(streamed(WORK, s), NVME).needs()[Tier.HOST]
        assert need == by_hand(s.piece_numel, s.prefetch_depth) * MiB, s


@pytest.mark.parametrize("budget_mib, chosen", [
    (300, Streaming(16 * Mi, 2)),  # roomy: the defaults (288)
    (210, Streaming(16 * Mi, 1)),  # one unit less in flight (208)
    (150, Streaming(2 * Mi, 1)),  # 4 Mi pieces at depth 1 need 208; 2 Mi at depth 2, 184; at 1, 136
    (100, Streaming(512 * Ki, 1)),  # exactly: 32 + 32 + backward's 32 + 2 pieces of 2 MiB (1 Mi: 104)
    (90, Streaming(1 * Mi, 0)),  # nothing at depth >= 1 (its least, 64 Ki pieces, needs 96.5): depth 0
])
def test_the_first_setting_on_the_ladder_that_fits(budget_mib: int, chosen: Streaming) -> None:
    assert choose_streaming(WORK, NVME, {Tier.HOST: budget_mib * MiB}) == chosen
    assert by_hand(chosen.piece_numel, chosen.prefetch_depth) <= budget_mib
    before = ladder()[:ladder().index(chosen)]
    assert all(by_hand(s.piece_numel, s.prefetch_depth) > budget_mib for s in before)


def test_below_the_smallest_setting_names_the_short_tier_and_its_need() -> None:
    short = choose_streaming(WORK, NVME, {Tier.HOST: 50 * MiB, Tier.GPU: None})
    assert short == Shortfall(Streaming(64 * Ki, 0), {Tier.HOST: int(by_hand(64 * Ki, 0) * MiB)},
                              {Tier.HOST: 50 * MiB})


def test_given_values_are_kept_and_the_other_is_chosen() -> None:
    assert choose_streaming(WORK, NVME, {Tier.HOST: 150 * MiB}, prefetch_depth=2) == Streaming(1 * Mi, 2)  # 2 Mi: 184
    assert choose_streaming(WORK, NVME, {Tier.HOST: 210 * MiB}, piece_numel=4 * Mi) == Streaming(4 * Mi, 1)
    assert choose_streaming(WORK, NVME, {Tier.HOST: 10 * MiB}, piece_numel=8192, prefetch_depth=1) == \
        Shortfall(Streaming(8192, 1), {Tier.HOST: peak_memory(streamed(WORK, Streaming(8192, 1)), NVME).needs()[Tier.HOST]},
                  {Tier.HOST: 10 * MiB})


def test_the_ladder_keeps_requests_of_a_mib_until_nothing_else_fits() -> None:
    """Largest pieces first, each at its deepest read-ahead; then pieces under 1 MiB of fp32;
    a prefetch depth of 0 last. Its top is the engine's old default."""
    rungs = ladder()
    assert rungs[0] == Streaming(16 * Mi, 2)
    floor = [s.piece_numel * 4 >= MIN_REQUEST_BYTES for s in rungs]
    depth0 = [s.prefetch_depth == 0 for s in rungs]
    assert depth0 == sorted(depth0) and floor[:depth0.index(True)] == sorted(floor[:depth0.index(True)], reverse=True)
    assert rungs[-1] == Streaming(64 * Ki, 0)
    assert len(rungs) == len(set(rungs)) == 9 * 3
