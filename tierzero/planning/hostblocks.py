"""The host pool's size classes: which block capacities it serves every lease from.

Owns the list of byte sizes the engine leases from the host pool -- each state kind's stored
keys (`tiers.state_keys`), whole param shards on their way to the device, a tied embedding's
grad -- and the choice of at most `HOST_CLASSES` capacities that round them up the least
(`storage.sizeclass`). Arithmetic on unit sizes, like the memory model that uses it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from tierzero.config import Placement, StateKind, Tier
from tierzero.layout.partition import ALIGN_NUMEL
from tierzero.planning.statebytes import FP32_NBYTES, FP32_STATE, StateBytes
from tierzero.storage.base import ALIGN_BYTES
from tierzero.storage.sizeclass import choose_classes

HOST_CLASSES = 8  # the host pool's size classes, at most
HOST_ALIGN = ALIGN_BYTES  # the host pool's block alignment: a page (`HostPool`), direct I/O's too


@dataclass(frozen=True)
class KeySizes:
    """What one rank stores, per unit, for the host pool's arithmetic: the param elements its
    home holds (`shard`: its shard, or the whole unit when replicated) and their bytes as stored
    (`param_nbytes`: a coded base's pieces, `coded` by unit index as bytes -> how many), and the
    elements with grads and optimizer states (`state`); how those are stored (`formats`,
    `grad_itemsize`, `one_weight`) and cut (`piece_numel`) and the compute dtype's `itemsize`."""

    shard: list[int]
    param_nbytes: list[int]
    state: list[int]
    piece_numel: int
    itemsize: int
    formats: StateBytes = FP32_STATE
    one_weight: bool = False
    grad_itemsize: int = FP32_NBYTES
    coded: dict[int, Counter[int]] = field(default_factory=dict)


def key_sizes(kind: StateKind, home: Tier, sizes: KeySizes) -> Counter[int]:
    """One rank's stored keys of `kind` (`tiers.state_keys`), as bytes -> how many keys: a param
    is one key in a memory tier and pieces of its trainable prefix then its frozen rest on nvme
    (a coded unit's as stored); the other kinds, pieces of the trainable prefix in their stored
    format. With `one_weight` the master is the trained params: on nvme its pieces are the
    param's (which keeps its frozen rest), in a memory tier a view of the param's one key (so
    it has none). Counted, not listed: at small pieces a large model has millions of keys, but
    only a few sizes."""
    keys: Counter[int] = Counter()
    s = sizes
    if kind is StateKind.MASTER and s.one_weight and home is not Tier.NVME:
        return keys
    if kind is not StateKind.PARAM:
        for n_state in s.state:
            keys.update(
                {
                    s.formats.nbytes(kind, n, s.itemsize, s.grad_itemsize): k
                    for n, k in piece_counts(n_state, s.piece_numel).items()
                }
            )
    elif home is not Tier.NVME:
        keys.update(n for n in s.param_nbytes if n > 0)
    else:
        for i, (shard, trainable) in enumerate(zip(s.shard, s.state)):
            trained = Counter() if s.one_weight else piece_counts(trainable, s.piece_numel)
            if i in s.coded:  # the trained pieces as values, the frozen rest's as stored
                values = piece_counts(trainable, s.piece_numel) - trained
                keys.update(s.coded[i] - Counter({n * s.itemsize: k for n, k in values.items()}))
                continue
            frozen = piece_counts(shard - _aligned_up(trainable), s.piece_numel)
            for n, k in (trained + frozen).items():
                keys[n * s.itemsize] += k
    return keys


def piece_counts(numel: int, piece_numel: int) -> Counter[int]:
    """How many pieces of each size `piece_ranges(numel, piece_numel)` cuts: whole pieces, then
    the rest (none of a numel <= 0)."""
    whole, rest = divmod(max(0, numel), piece_numel)
    return Counter({n: k for n, k in ((piece_numel, whole), (rest, 1)) if n and k})


def _aligned_up(numel: int) -> int:
    return -(-numel // ALIGN_NUMEL) * ALIGN_NUMEL


def host_classes(
    placement: Placement,
    sizes: KeySizes,
    tied: bool,
    step_on_host: bool,
    extra: Sequence[int] = (),
) -> tuple[int, ...]:
    """The host pool's size classes: the fewest bytes lost rounding every size the engine
    leases there, each weighted by how many keys or buffers take it -- host homes' keys,
    nvme keys (staged through the host at open and in the step), param shards (staged and
    cached, as stored), the optimizer's pieces when it steps on the host, a tied embedding's
    grad, and any `extra` sizes (a rank's range of a replicated unit, staged for the param
    sync)."""
    counted: Counter[int] = Counter()
    for kind in StateKind:  # nvme keys are staged: at open, and (but frozen params) in the step
        home = placement.home(kind)
        if home is not Tier.GPU or (step_on_host and kind is not StateKind.PARAM):
            counted.update(key_sizes(kind, home, sizes))
    if placement.param is Tier.NVME:  # whole shards on their way to the device, then cached
        counted.update(sizes.param_nbytes)
    if tied:  # the stash of a sum: fp32
        counted[sizes.state[0] * FP32_NBYTES] += 1
    counted.update(extra)
    counted.pop(0, None)
    return choose_classes(counted, HOST_CLASSES, HOST_ALIGN)
