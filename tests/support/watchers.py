"""Watchers a test installs next to the recording fake: the device pool's leases and give-backs
logged into the fake's log, the host pool's hand-outs checked against copies in flight, and the
implicit host-device synchronisations the training thread makes (`SyncWatch`)."""

from __future__ import annotations

import traceback
import weakref

import torch
from tierzero.storage.device import DevicePool
from tierzero.storage.host import HostPool
from torch.overrides import TorchFunctionMode

from tests.support.fakes.streams import RecordingStreams, _span


def watch_device_pool(monkeypatch, fake: RecordingStreams) -> None:
    """Log every lease from a `DevicePool`, every give-back with its `ready` token (the release
    event), and every block it drops (its next block at that address is fresh memory)."""
    lease, give_back = DevicePool.lease, DevicePool.give_back

    def logged_lease(pool: DevicePool, nbytes: int) -> torch.Tensor:
        buf = lease(pool, nbytes)
        with fake._lock:
            fake.log.append(("lease", buf.data_ptr()))
            fake.device_spans.add(_span(buf))
        return buf

    def logged_give_back(pool: DevicePool, buf: torch.Tensor, ready: object | None = None) -> None:
        with fake._lock:
            fake.log.append(("give_back", buf.data_ptr(), ready))
        give_back(pool, buf, ready)

    def logged_drop(pool: DevicePool, data: torch.Tensor) -> None:
        with fake._lock:
            fake.log.append(("drop", data.data_ptr()))

    monkeypatch.setattr(DevicePool, "lease", logged_lease)
    monkeypatch.setattr(DevicePool, "give_back", logged_give_back)
    monkeypatch.setattr(DevicePool, "dropped", logged_drop)


def watch_host_pool(monkeypatch, fake: RecordingStreams) -> None:
    """Log a hazard when the host pool hands out a block that a copy in flight still reads or
    writes: its holder gave it back before the copy's event (the pool has no `ready` token)."""
    lease = HostPool.lease

    def checked_lease(pool: HostPool, nbytes: int, grow: bool = True) -> torch.Tensor:
        buf = lease(pool, nbytes, grow)
        with fake._lock:
            if fake._overlaps_queued(_span(buf)):
                fake.log.append(
                    (
                        "hazard",
                        f"the host pool hands out 0x{buf.data_ptr():x} while a copy still uses it",
                    )
                )
        return buf

    monkeypatch.setattr(HostPool, "lease", checked_lease)


_SYNCING = {
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "nonzero",
}


class SyncWatch(TorchFunctionMode):
    """Count the calls that make the host wait for the device (on a GPU), while active on the
    training thread: reading a value (`.item()`, `.tolist()`, `bool(t)`, `.nonzero()`),
    `.cpu()`, a `.to(device)` that is not `non_blocking` (from pageable memory even that
    blocks), and a blocking `.copy_()` into or out of device memory (`fake.device_spans`: the
    device pool's blocks). On the CPU every tensor is host memory, so the watch tells host
    values apart by where they came from: what `.cpu()` returns (a copy, as from a GPU) and what
    is computed from such values alone are host values, and reading them is not counted. `where`
    names the tierzero file and line of each counted call."""

    def __init__(self, fake: RecordingStreams) -> None:
        super().__init__()
        self.fake = fake
        self.where: list[str] = []
        self.host: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = [
            t
            for a in (*args, *kwargs.values())
            for t in (a if isinstance(a, (list, tuple)) else [a])
            if isinstance(t, torch.Tensor)
        ]
        on_host = bool(inputs) and all(t in self.host for t in inputs)
        if (
            name in _SYNCING
            and not on_host
            or name == "to"
            and _moves(args, kwargs)
            or name == "copy_"
            and self._device_copy(args, kwargs)
        ):
            caller = _caller()
            if caller is not None:
                self.where.append(f"{name} at {caller}")
        out = func(*args, **kwargs)
        if name == "cpu":
            out = out.clone()  # a new host tensor, as from a GPU
        if on_host or name == "cpu":
            for t in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.host.add(t)
        return out

    def _device_copy(self, args: tuple, kwargs: dict) -> bool:
        if kwargs.get("non_blocking") or len(args) > 2 and args[2]:
            return False
        return any(isinstance(t, torch.Tensor) and self.fake.on_device(t) for t in args[:2])


def _moves(args: tuple, kwargs: dict) -> bool:
    """Whether a `.to(...)` names a device (or a tensor to follow) and may block."""
    if kwargs.get("non_blocking") or any(a is True for a in args[2:]):
        return False
    return any(
        isinstance(a, (torch.device, torch.Tensor, str)) for a in [*args[1:], kwargs.get("device")]
    )


def _caller() -> str | None:
    """The tierzero line that made the call; None when the fake itself made it."""
    for frame in reversed(traceback.extract_stack(limit=16)[:-2]):
        name = frame.filename
        if "/tests/support/fakes/" in name:
            return None
        if "/torch/" not in name:
            return f"{name.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "torch"
