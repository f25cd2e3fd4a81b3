"""`ChunkJobs`: the chunk jobs of one store call, run on the I/O threads and always settled.

A store call (one shard's read or write) is many chunk jobs on the I/O loop's executor. This
module owns how they end: a call returns, or raises its first error, only once no I/O thread
can still touch the caller's buffer -- after a failure, after a cancellation, and when several
chunks fail at once. Every job's exception is retrieved, so one ENOSPC across 200 chunks is one
error, not one error and 199 "Future exception was never retrieved" reports. It never names
files or keys.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


class ChunkJobs:
    """The chunk jobs of one call, with an abort flag workers check before touching a file."""

    def __init__(self) -> None:
        self.aborted = False

    async def run(self, jobs: list[Awaitable[Any]]) -> list[Any]:
        """Every job's result; on any failure or cancellation, abort the ones not yet started
        and return (raising the first error) only after every job has finished with the
        caller's buffer.

        `asyncio.wait`, not `gather`: a cancelled gather cancels its executor futures, which
        marks them done while their threads still run."""
        futures = [asyncio.ensure_future(j) for j in jobs]
        try:
            await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((f for f in futures if f.done() and f.exception() is not None), None)
            if failed is not None:
                raise failed.exception()  # type: ignore[misc]
        except BaseException:
            self.aborted = True
            await settle(futures)
            raise
        return [f.result() for f in futures]


async def settle(futures: list[asyncio.Future[Any]]) -> None:
    """Wait until every future is done, even through further cancellations, and retrieve each
    one's exception (the caller raises the one that matters).

    A cancelled `run_in_executor` future is marked done while its thread may still run, so
    these futures are never cancelled: workers see the abort flag instead."""
    pending = [f for f in futures if not f.done()]
    while pending:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            pass
        pending = [f for f in pending if not f.done()]
    for f in futures:
        if not f.cancelled():
            f.exception()  # marks it retrieved: asyncio would log it when collected


async def shielded(future: Awaitable[Any]) -> None:
    """Await an executor job to its end: a cancellation is re-raised only after it finished."""
    fut = asyncio.ensure_future(future)
    cancelled = False
    while True:
        try:
            await asyncio.shield(fut)
            break
        except asyncio.CancelledError:
            if fut.done():
                break
            cancelled = True
    if fut.exception() is not None:
        raise fut.exception()  # type: ignore[misc]
    if cancelled:
        raise asyncio.CancelledError
