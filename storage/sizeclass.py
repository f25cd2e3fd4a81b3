"""Size classes: the few block capacities a buffer pool serves every lease from.

A pool that allocates a block per distinct request size pins (`cudaHostRegister`) a new block
whenever a new size shows up or an old block is dropped to make room for another size: a
synchronising driver call on the hot path. With a handful of capacities known in advance, the
pool allocates and pins its blocks once, at open, and rounds each request up to the smallest
capacity that holds it; what that rounding wastes is chosen to be as little as possible here.

Pure arithmetic: the memory model (`tierzero.planning.memory_model`) uses it to predict the
pool's bytes, the pool (`BufferPool`) to round its leases, so the two agree by construction.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence


def aligned(nbytes: int, alignment: int) -> int:
    """`nbytes` rounded up to a whole number of `alignment` units (at least one)."""
    return max(alignment, -(-nbytes // alignment) * alignment)


def choose_classes(sizes: Mapping[int, int], max_classes: int, alignment: int) -> tuple[int, ...]:
    """At most `max_classes` capacities (ascending) that serve leases of `sizes` (bytes -> how
    many leases of that size) with the fewest bytes lost to rounding.

    Each lease is served by the smallest capacity that holds it, so a class serves a run of
    consecutive sizes and the best capacity for a run is its largest size: a dynamic programme
    over the sorted (aligned) sizes, splitting them into at most `max_classes` runs.
    """
    if max_classes < 1:
        raise ValueError(f"max_classes must be at least 1, got {max_classes}")
    counts: dict[int, int] = {}
    for nbytes, n in sizes.items():
        size = aligned(nbytes, alignment)
        counts[size] = counts.get(size, 0) + n
    xs = sorted(counts)
    if len(xs) <= max_classes:
        return tuple(xs)
    ws = [counts[x] for x in xs]

    def waste(i: int, j: int) -> int:  # sizes xs[i..j] served by xs[j]
        return sum(w * (xs[j] - x) for x, w in zip(xs[i : j + 1], ws[i : j + 1]))

    n = len(xs)
    # best[j]: (least waste, capacities) serving xs[0..j] with the classes used so far
    best: list[tuple[int, tuple[int, ...]]] = [(waste(0, j), (xs[j],)) for j in range(n)]
    for _ in range(max_classes - 1):
        best = [
            min(
                [best[j]]
                + [
                    (best[i - 1][0] + waste(i, j), best[i - 1][1] + (xs[j],))
                    for i in range(1, j + 1)
                ]
            )
            for j in range(n)
        ]
    return best[-1][1]


def class_for(nbytes: int, classes: Sequence[int], alignment: int) -> int:
    """The capacity a lease of `nbytes` takes: the smallest class that holds it, or -- for a
    size above every class (one the pool was not sized for) -- its own aligned size."""
    size = aligned(nbytes, alignment)
    i = bisect.bisect_left(classes, size)
    return classes[i] if i < len(classes) else size
