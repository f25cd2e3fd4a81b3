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
from tierzero.layout.partition import ALIGN_NUMEL
from tierzero.planning.statebytes import FP32_NBYTES, FP32_STATE, StateBytes
from tierzero.storage.base import ALIGN_BYTES
from tierzero.storage.sizeclass import choose_classes

HOST_CLASSES = 8  # the host pool's size classes, at most
HOST_ALIGN = ALIGN_BYTES  # the host pool's block alignment: a page (`HostPool`), direct I/O's too


def key_sizes(
    kind: StateKind,
    shard: list[int],
    state: list[int],
    piece_numel: int,
    itemsize: int,
    home: Tier,
    formats: StateBytes = FP32_STATE,
    one_weight: bool = False,
    grad_itemsize: int = FP32_NBYTES,
) -> Counter[int]:
    """One rank's stored keys of `kind` (`tiers.state_keys`), as bytes -> how many keys: a param
    is one key in a memory tier and pieces of its trainable prefix then its frozen rest on nvme;
    the other kinds, pieces of the trainable prefix in their stored format (grads of
    `grad_itemsize` bytes). With
    `one_weight` the master is the trained params: on nvme its pieces are the param's (which
    keeps its frozen rest), in a memory tier a view of the param's one key (so it has none).
    Counted, not listed: at small pieces a large model has millions of keys, but only a few sizes."""
    keys: Counter[int] = Counter()
    if kind is StateKind.MASTER and one_weight and home is not Tier.NVME:
        return keys
    if kind is not StateKind.PARAM:
        for s in state:
            keys.update(
                {
                    formats.nbytes(kind, n, itemsize, grad_itemsize): k
                    for n, k in piece_counts(s, piece_numel).items()
                }
            )
    elif home is not Tier.NVME:
        keys.update(n * itemsize for n in shard if n > 0)
    else:
        for s, t in zip(shard, state):
            trained = Counter() if one_weight else piece_counts(t, piece_numel)
            for n, k in (trained + piece_counts(s - _aligned_up(t), piece_numel)).items():
                keys[n * itemsize] += k
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
    shard: list[int],
    state: list[int],
    piece_numel: int,
    itemsize: int,
    tied: bool,
    step_on_host: bool,
    extra: Sequence[int] = (),
    formats: StateBytes = FP32_STATE,
    one_weight: bool = False,
    grad_itemsize: int = FP32_NBYTES,
) -> tuple[int, ...]:
    """The host pool's size classes: the fewest bytes lost rounding every size the engine
    leases there, each weighted by how many keys or buffers take it -- host homes' keys,
    nvme keys (staged through the host at open and in the step), param shards (staged and
    cached), the optimizer's pieces when it steps on the host, a tied embedding's grad, and any
    `extra` sizes (a rank's range of a replicated unit, staged for the param sync)."""
    sizes: Counter[int] = Counter()
    for kind in StateKind:  # nvme keys are staged: at open, and (but frozen params) in the step
        home = placement.home(kind)
        if home is not Tier.GPU or (step_on_host and kind is not StateKind.PARAM):
            sizes.update(
                key_sizes(
                    kind,
                    shard,
                    state,
                    piece_numel,
                    itemsize,
                    home,
                    formats,
                    one_weight,
                    grad_itemsize,
                )
            )
    if placement.param is Tier.NVME:  # whole shards on their way to the device, then cached
        sizes.update(s * itemsize for s in shard)
    if tied:  # the stash of a sum: fp32
        sizes[state[0] * FP32_NBYTES] += 1
    sizes.update(extra)
    sizes.pop(0, None)
    return choose_classes(sizes, HOST_CLASSES, HOST_ALIGN)
