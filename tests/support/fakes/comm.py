"""NCCL-like collectives for two gloo ranks through the recording fake's `comm` stream: the real
collective runs at issue, its output lands only when something waits for its event."""

from __future__ import annotations

import torch

from tests.support.fakes.streams import FakeEvent, RecordingStreams


class _FakeWork:
    """A collective's work handle: `wait()` makes the current stream wait for it (NCCL's)."""

    def __init__(self, fake: RecordingStreams, event: FakeEvent) -> None:
        self.fake, self.event = fake, event

    def wait(self) -> bool:
        self.fake.wait(self.fake.current_stream(), self.event)
        return True


def nccl_like_collectives(fake: RecordingStreams, patch=setattr) -> None:
    """Route `tierzero.distributed.comm`'s asynchronous all-gathers and reduce-scatters through
    `fake.collective`: the real (gloo) collective runs at issue into a scratch buffer, and the
    output the engine sees lands only when its event is waited for. `patch`: a monkeypatch's
    `setattr` in a test, plain `setattr` in a spawned rank."""
    from tierzero.distributed import comm

    def deferred(real):
        def collective(out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
            if not async_op:
                return real(out, inp)
            result = torch.empty_like(out)
            real(result, inp)
            return _FakeWork(fake, fake.collective(out, result, inp))

        return collective

    patch(comm, "all_gather_tensor", deferred(comm.all_gather_tensor))
    patch(comm, "reduce_scatter_tensor", deferred(comm.reduce_scatter_tensor))
