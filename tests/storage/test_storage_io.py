"""IOLoop: results and errors cross the thread boundary, close() never hangs, and cancelled
writes leave no temp files."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from tierzero.storage.base import StorageError
from tierzero.storage.io import IOLoop
from tierzero.storage.nvme import chunkfile
from tierzero.storage.nvme.store import NvmeStore


def close_within(loop: IOLoop, seconds: float) -> None:
    closer = threading.Thread(target=loop.close, daemon=True)
    closer.start()
    closer.join(seconds)
    assert not closer.is_alive(), "IOLoop.close() hung"


def test_results_and_exceptions_cross_threads() -> None:
    async def work(x: int) -> int:
        return await asyncio.get_running_loop().run_in_executor(None, lambda: x * 2)

    async def boom() -> None:
        raise ValueError("inside the loop")

    with IOLoop(threads=2) as loop:
        assert loop.run(work(21)) == 42
        with pytest.raises(ValueError, match="inside the loop"):
            loop.run(boom())
        assert loop.submit(work(1)).result() == 2


def test_close_after_an_exception_cancels_pending_work_without_hanging() -> None:
    loop = IOLoop(threads=2)
    loop.open()
    sleeper = loop.submit(asyncio.sleep(3600))
    with pytest.raises(RuntimeError):
        loop.run(_raise())
    close_within(loop, 10)
    assert sleeper.cancelled()
    loop.close()  # idempotent
    with pytest.raises(StorageError, match="not open"):
        loop.run(asyncio.sleep(0))


async def _raise() -> None:
    raise RuntimeError("failed step")


def test_context_manager_closes_on_keyboard_interrupt() -> None:
    with pytest.raises(KeyboardInterrupt):
        with IOLoop(threads=2) as loop:
            pending = loop.submit(asyncio.sleep(3600))
            raise KeyboardInterrupt
    assert pending.cancelled()


def test_cancelled_writes_leave_no_temp_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = chunkfile.write_chunk

    def slow(*args, **kwargs):
        time.sleep(0.01)
        real(*args, **kwargs)

    monkeypatch.setattr(chunkfile, "write_chunk", slow)
    loop = IOLoop(threads=4)
    loop.open()
    with NvmeStore([tmp_path], chunk_bytes=16 << 10) as store:
        shards = [torch.full((64 << 10,), float(i)) for i in range(8)]  # 16 chunks each
        futures = [loop.submit(store.write(f"master/u{i:04d}/r0", s)) for i, s in enumerate(shards)]
        time.sleep(0.05)  # some chunks written, most queued
        close_within(loop, 30)
        assert any(f.cancelled() for f in futures)
        assert [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")] == []
        # Whatever finished before the cancel committed whole; the rest left nothing.
        with IOLoop(threads=2) as again:
            for i, src in enumerate(shards):
                key = f"master/u{i:04d}/r0"
                if again.run(store.exists(key)):
                    out = torch.empty_like(src)
                    again.run(store.read_into(key, out, verify=True))
                    assert torch.equal(out, src)


def test_every_thread_runs_the_initializer_and_a_wait_never_holds_a_worker() -> None:
    """The engine binds its GPU on every I/O thread (`initializer`); waits sleep on the waiter,
    so with both workers' worth of waits asleep, a worker's job still runs."""
    bound, waited_on = set(), []
    release = threading.Event()

    def wait() -> None:
        waited_on.append(threading.current_thread().name)
        release.wait()

    async def on_every_worker() -> None:  # both workers busy at once: both threads exist
        barrier = threading.Barrier(2)
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, barrier.wait) for _ in range(2)))

    async def job() -> int:
        return await asyncio.get_running_loop().run_in_executor(None, lambda: 7)

    with IOLoop(threads=2, initializer=lambda: bound.add(threading.current_thread().name)) as io:
        io.run(on_every_worker())
        waits = [io.submit(io.wait_off_workers(wait)) for _ in range(2)]
        assert io.submit(job()).result(timeout=60) == 7  # the timeout only stops a hang
        release.set()
        for w in waits:
            w.result()
    assert waited_on == ["tierzero-wait_0"] * 2
    assert bound == {"tierzero-io-loop", "tierzero-io_0", "tierzero-io_1", "tierzero-wait_0"}
