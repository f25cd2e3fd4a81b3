"""`IOLoop`: the one owner of I/O threads.

An asyncio event loop runs in its own daemon thread; its default executor is a bounded
`ThreadPoolExecutor`, so every store's blocking work (`loop.run_in_executor(None, ...)`: chunk
reads and writes, copies, fsyncs) lands on these threads and nowhere else. The training thread
hands coroutines over with `submit()` and waits on the `concurrent.futures.Future` it gets back.

Waits for something that merely has to happen (a device copy's event) go to a waiter thread
(`wait_off_workers`), never a worker: a worker asleep on an event is one fewer for the reads
and writes queued behind it. One waiter per `lane` (the engine's lane is a stream): copies on
one stream land in the order they were issued, so one thread per stream suffices, and a wait
for a grad's D2H copy never queues behind a wait for an H2D copy stuck behind other work.
`initializer` runs first on every one of these threads (the engine binds its GPU there: see
`tierzero.engine.runtime.streams.bind_thread`).

Host math -- the optimizer's steps, casts, adds of grads -- runs on one lane, `MATH_LANE`, so
one OpenMP team of `math_threads` (set on that thread alone) does all of it; the workers only
move bytes (host-to-host copies go through numpy: one thread each, no OpenMP team).

Shutdown: `close()` cancels every pending task, lets their cleanup run (stores remove their temp
files), waits for the threads to finish the chunk they are on, and joins the loop thread. It is
idempotent and is what the context manager calls on an exception or Ctrl-C, so nothing hangs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import aiofiles
import aiofiles.os
from tierzero.storage.base import StorageError, os_error
from tierzero.storage.durable import fsync_path

T = TypeVar("T")

MATH_LANE = "math"  # the one thread that runs host math (`IOLoop.run_math`)


class IOLoop:
    """An event loop in a daemon thread with a bounded thread pool of `threads` workers."""

    def __init__(
        self,
        threads: int = 16,
        initializer: Callable[[], None] | None = None,
        math_threads: int | None = None,
    ) -> None:
        if threads < 1:
            raise StorageError(f"IOLoop needs at least one thread, got {threads}")
        self.threads = threads
        self.initializer = initializer
        self.math_threads = math_threads  # the math lane's OpenMP team (None: torch's default)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._waiters: dict[str, concurrent.futures.ThreadPoolExecutor] = {}  # lane -> its thread
        self._waiters_lock = threading.Lock()

    def open(self) -> None:
        if self._loop is not None:
            return
        loop = asyncio.new_event_loop()
        loop.set_default_executor(
            concurrent.futures.ThreadPoolExecutor(
                self.threads, thread_name_prefix="tierzero-io", initializer=self.initializer
            )
        )
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._serve,
            args=(loop, started, self.initializer),
            name="tierzero-io-loop",
            daemon=True,
        )
        self._thread.start()
        started.wait()
        self._loop = loop

    @staticmethod
    def _serve(
        loop: asyncio.AbstractEventLoop,
        started: threading.Event,
        initializer: Callable[[], None] | None,
    ) -> None:
        asyncio.set_event_loop(loop)
        if initializer is not None:
            initializer()
        loop.call_soon(started.set)
        try:
            loop.run_forever()
        finally:
            loop.close()

    def close(self) -> None:
        """Cancel pending work, let it clean up, join the threads. Safe to call twice."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = self._thread = None
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        with self._waiters_lock:
            waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            waiter.shutdown()  # nothing waits on it now: the loop's tasks are done

    @staticmethod
    async def _shutdown() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Work already running on a thread cannot be interrupted; wait for it to finish.
        await asyncio.get_running_loop().shutdown_default_executor()

    def __enter__(self) -> IOLoop:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise StorageError(
                "the I/O loop is not open: call IOLoop.open() or use it as a context manager"
            )
        return self._loop

    async def wait_off_workers(self, wait: Callable[..., None], *args: Any, lane: str = "") -> None:
        """Run a blocking `wait(*args)` on `lane`'s waiter thread (started on first use), never on
        an I/O worker."""
        await asyncio.get_running_loop().run_in_executor(self._waiter(lane), wait, *args)

    async def run_math(self, fn: Callable[..., T], *args: Any) -> T:
        """Run host math `fn(*args)` on the math lane: one thread, one OpenMP team for all of it."""
        return await asyncio.get_running_loop().run_in_executor(self._waiter(MATH_LANE), fn, *args)

    def _waiter(self, lane: str) -> concurrent.futures.ThreadPoolExecutor:
        assert self._loop is not None, "the I/O loop is not open"
        with self._waiters_lock:
            if lane not in self._waiters:
                name = "tierzero-wait" + (f"-{lane}" if lane else "")
                start = self._start_math if lane == MATH_LANE else self.initializer
                self._waiters[lane] = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=name, initializer=start
                )
            return self._waiters[lane]

    def _start_math(self) -> None:
        if self.initializer is not None:
            self.initializer()
        if self.math_threads is not None:
            import torch

            # this thread's team (and torch's default for new threads)
            torch.set_num_threads(self.math_threads)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; the training thread waits on the returned future."""
        try:
            loop = self.loop
        except StorageError:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Submit `coro` and wait for its result; an interrupt while waiting cancels it."""
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise


async def write_durable(path: str, raw: bytes) -> None:
    """Write a small file (a manifest) from the I/O loop and fsync it and its directory.

    aiofiles runs the blocking calls on the loop's executor, so the loop keeps serving chunk
    jobs meanwhile. No temp name: the caller's commit is renaming the directory holding it
    (`durable.write_atomic` is the writer for a file that is its own commit). An OSError
    (ENOSPC, EIO, EACCES) is a `StorageError` naming `path` and the fix."""
    try:
        async with aiofiles.open(path, "wb") as f:
            await f.write(raw)
            await f.flush()
            await aiofiles.os.wrap(os.fsync)(f.fileno())
        await aiofiles.os.wrap(fsync_path)(os.path.dirname(path) or ".")
    except OSError as e:
        raise os_error(e, "writing", path) from e
