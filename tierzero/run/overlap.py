"""How well a run's steps overlap their links, from each step's `busy_s/<link>` metrics.

Per step, each link (NVMe reads and writes, host<->device copies, the optimizer's compute) was
busy for some time; the slowest link's time is the `bound` a perfectly overlapped step would
take, and the sum of them what a fully serialised one would. `step / bound` places the step
between the two: 1.0 is overlapped, `serial / bound` is serial. Forward and backward are no
link: `compute_s` is the training thread's time not blocked on a transfer (`step_s - io_wait_s`),
and `step / floor` sets the step against max(bound, compute). Every figure is the median over
the logged steps, each ratio taken per step first (so one slow step does not skew it).
"""

from __future__ import annotations

from statistics import median
from typing import Any

from tierzero.engine.runtime.transfers import BUSY_LINKS

BUSY = "busy_s/"
PREDATES = "the run predates the busy-time measurement (no busy_s/ metrics): train again to see it"
IN_MEMORY = "an in-memory run: no tier links to overlap"


def busy_links(steps: list[dict[str, Any]]) -> list[str]:
    """The links any step logged busy time for, in the engine's order (unknown ones after)."""
    logged = {k[len(BUSY) :] for r in steps for k in r if k.startswith(BUSY)}
    return [link for link in BUSY_LINKS if link in logged] + sorted(logged - set(BUSY_LINKS))


def overlap(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's overlap figures (`measured: False` with a `note` for a run without them)."""
    steps = [
        r for r in records if "loss" in r and "step_s" in r and any(k.startswith(BUSY) for k in r)
    ]
    links = busy_links(steps)
    if not steps:
        tiered = any(k.startswith("bytes_") for r in records if "loss" in r for k in r)
        return {"measured": False, "note": PREDATES if tiered else IN_MEMORY}
    per_link = {link: _link_figures(steps, link) for link in links}
    bounds = [max(r.get(BUSY + link, 0.0) for link in links) for r in steps]
    serial = [sum(r.get(BUSY + link, 0.0) for link in links) for r in steps]
    ratios = [(r["step_s"] / b, s / b) for r, b, s in zip(steps, bounds, serial) if b > 0]
    # the training thread's time not blocked on a transfer: forward and backward compute (and
    # host overhead) as the loop sees it, so the step's floor is max(bound, compute)
    compute = [max(0.0, r["step_s"] - r.get("io_wait_s", 0.0)) for r in steps]
    floors = [max(b, c) for b, c in zip(bounds, compute)]
    bound_link = max(links, key=lambda link: per_link[link]["busy_s"]) if links else None
    return {
        "measured": True,
        "steps": len(steps),
        "links": per_link,
        "step_s": median(r["step_s"] for r in steps),
        "bound_s": median(bounds),
        "bound_link": bound_link,
        "step_over_bound": median(r for r, _ in ratios) if ratios else None,
        "serial_over_bound": median(s for _, s in ratios) if ratios else None,
        "compute_s": median(compute),
        "step_over_floor": median(r["step_s"] / f for r, f in zip(steps, floors) if f > 0),
    }


def _link_figures(steps: list[dict[str, Any]], link: str) -> dict[str, float | None]:
    """A link's median busy seconds, and bytes per second while busy (None: no bytes logged,
    the optimizer's compute, or never busy)."""
    busy = [r.get(BUSY + link, 0.0) for r in steps]
    rates = [r[f"bytes_{link}"] / b for r, b in zip(steps, busy) if b > 0 and f"bytes_{link}" in r]
    return {"busy_s": median(busy), "bytes_per_s": median(rates) if rates else None}
