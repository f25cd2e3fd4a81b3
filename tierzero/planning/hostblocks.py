"""The host pool's size classes: which block capacities it serves every lease from.

Owns the list of byte sizes the engine leases from the host pool -- each state kind's stored
keys (`tiers.state_keys`), whole param shards on their way to the device, a tied embedding's
grad -- and the choice of at most `HOST_CLASSES` capacities that round them up the least
(`storage.sizeclass`). Arithmetic on unit sizes, like the memory model that uses it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from tierzero.config import Placement, StateKind, Tier
from tierzero.planning.ledger import FP32_NBYTES
from tierzero.layout.partition import ALIGN_NUMEL, piece_ranges
from tierzero.storage.base import ALIGN_BYTES
from tierzero.storage.sizeclass import choose_classes

HOST_CLASSES = 8  # the host pool's size classes, at most
HOST_ALIGN = ALIGN_BYTES  # the host pool's block alignment: a page (`HostPool`), direct I/O's too


def key_sizes(kind: StateKind, shard: list[int], state: list[int], piece_numel: int, itemsize: int,
              home: Tier) -> list[int]:
    """One rank's stored keys of `kind`, in bytes (`tiers.state_keys`): a param is one key in a
    memory tier and pieces of its trainable prefix then its frozen rest on nvme; the other
    kinds, pieces of the trainable prefix."""
    def split(n: int) -> list[int]:
        return [b - a for a, b in piece_ranges(n, piece_numel)]

    if kind is not StateKind.PARAM:
        return [p * FP32_NBYTES for s in state for p in split(s)]
    if home is not Tier.NVME:
        return [s * itemsize for s in shard]
    return [p * itemsize for s, t in zip(shard, state) for p in split(t) + split(s - _aligned_up(t))]


def _aligned_up(numel: int) -> int:
    return -(-numel // ALIGN_NUMEL) * ALIGN_NUMEL


def host_classes(placement: Placement, shard: list[int], state: list[int], piece_numel: int, itemsize: int,
                 tied: bool, step_on_host: bool, extra: Sequence[int] = ()) -> tuple[int, ...]:
    """The host pool's size classes: the fewest bytes lost rounding every size the engine
    leases there, each weighted by how many keys or buffers take it -- host homes' keys,
    nvme keys (staged through the host at open and in the step), param shards (staged and
    cached), the optimizer's pieces when it steps on the host, a tied embedding's grad, and any
    `extra` sizes (a rank's range of a replicated unit, staged for the param sync)."""
    sizes: Counter[int] = Counter()
    for kind in StateKind:  # nvme keys are staged: at open, and (but frozen params) in the step
        home = placement.home(kind)
        if home is not Tier.GPU or (step_on_host and kind is not StateKind.PARAM):
            sizes.update(key_sizes(kind, shard, state, piece_numel, itemsize, home))
    if placement.param is Tier.NVME:  # whole shards on their way to the device, then cached
        sizes.update(s * itemsize for s in shard)
    if tied:
        sizes[state[0] * FP32_NBYTES] += 1
    sizes.update(extra)
    sizes.pop(0, None)
    return choose_classes(sizes, HOST_CLASSES, HOST_ALIGN)
