"""Shared fixtures: the I/O loop every store test runs its coroutines on, and the device pin.

The fixtures of `tests.support.hf` (the small Hugging Face models, saved once per session) and of
`tests.support.fakes.pinning` (recorded mappings, the fake CUDA runtime) are loaded as plugins,
so a test names them as parameters without importing them.

Every test runs on the CPU unless it is marked `cuda`: on a GPU machine `Config(device=None)`
would otherwise resolve to the GPU (and bf16) while the plain-PyTorch reference it is compared
with stays on the CPU in fp32. A `cuda` test is skipped where there is no GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tierzero.storage.io import IOLoop

pytest_plugins = ("tests.support.hf", "tests.support.fakes.pinning")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: runs on a CUDA GPU; skipped without one")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if item.get_closest_marker("cuda") is not None:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_unless_marked_cuda(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pin an unmarked test, and the subprocesses it starts, to the CPU on a GPU machine."""
    if request.node.get_closest_marker("cuda") is None and torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def io_loop() -> Iterator[IOLoop]:
    with IOLoop(threads=8) as loop:
        yield loop
