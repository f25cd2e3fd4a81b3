"""A memory store copies on the stream it is handed (the engine's `Streams.store_copy`), not on
one of its own: a copy queued behind work already on that stream finishes after that work."""

from __future__ import annotations

import pytest
import torch
from tierzero.storage.device import DevicePool, DeviceStore
from tierzero.storage.io import IOLoop


@pytest.mark.cuda
def test_a_device_store_copies_on_the_stream_it_is_handed(io_loop: IOLoop) -> None:
    stream = torch.cuda.Stream()
    with DevicePool(1 << 20, "cuda") as pool:
        store = DeviceStore(pool, stream)
        store.open()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)  # work queued ahead of the store's copy
            ahead = torch.cuda.Event()
            ahead.record(stream)
        io_loop.run(store.write("k", torch.ones(1000)))
        assert ahead.query(), "the write returned before the work queued ahead of it on its stream"
        assert store.stream is stream
