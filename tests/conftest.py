"""Shared fixtures: the I/O loop every store test runs its coroutines on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tierzero.storage.io import IOLoop


@pytest.fixture
def io_loop() -> Iterator[IOLoop]:
    with IOLoop(threads=8) as loop:
        yield loop


from hf_helpers import hf_models  # noqa: E402,F401  (a session fixture: the models are saved once)
