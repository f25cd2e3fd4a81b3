"""What runs on which GPU, checked on the CPU: torch.cuda's per-device functions are replaced
by a model of them (one RNG generator per GPU; `cuda` without an index means the calling
thread's current device, as in torch), so a call that names no device picks the wrong one.

Compared: the generator a unit's call seeds (forward and recompute alike) is its inputs' GPU's, with
the forward's thread and autograd's thread having different current devices; and the device each of
the tiers' I/O threads binds against the tiers' own.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from tierzero import Config, Placement, Tier
from tierzero.engine.runtime import streams
from tierzero.engine.runtime.tiers import Tiers
from tierzero.models import draws


class FakeCudaRng:
    """torch.cuda's RNG state functions and default generators over one seed per GPU."""

    def __init__(self, gpus: int) -> None:
        self.states = {i: torch.tensor([i], dtype=torch.uint8) for i in range(gpus)}
        self.current = 0  # the calling thread's current device
        self.generators = tuple(_FakeGenerator(self, i) for i in range(gpus))

    def _index(self, device: torch.device | str | int) -> int:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        return self.current if device.index is None else device.index

    def get_rng_state(self, device: torch.device | str | int = "cuda") -> torch.Tensor:
        return self.states[self._index(device)].clone()

    def set_rng_state(
        self, new_state: torch.Tensor, device: torch.device | str | int = "cuda"
    ) -> None:
        self.states[self._index(device)] = new_state.clone()


class _FakeGenerator:
    def __init__(self, fake: FakeCudaRng, index: int) -> None:
        self.fake, self.index = fake, index

    def manual_seed(self, seed: int) -> None:
        self.fake.states[self.index] = torch.tensor([seed % 251], dtype=torch.uint8)


class OnGpu(torch.Tensor):
    """An input on cuda:1 (all `draws_for` asks of a tensor)."""

    is_cuda = True
    device = torch.device("cuda", 1)

    def __new__(cls) -> OnGpu:
        return torch.Tensor._make_subclass(cls, torch.empty(0))


def test_a_units_draws_seed_the_inputs_gpu_whatever_thread_is_current(monkeypatch) -> None:
    fake = FakeCudaRng(gpus=2)
    monkeypatch.setattr(torch.cuda, "get_rng_state", fake.get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", fake.set_rng_state)
    monkeypatch.setattr(torch.cuda, "default_generators", fake.generators)
    d = draws.draws_for(0, 0, 0, 1, (OnGpu(),))
    assert d.devices == (torch.device("cuda", 1),)
    fake.current = 1  # backward: autograd's thread for cuda:1
    with draws.seeded(d):
        assert fake.states[1].item() == d.seed % 251, (
            "recompute's dropout would draw other masks than forward's"
        )
        assert fake.states[0].item() == 0
    assert fake.states[1].item() == 1 and fake.states[0].item() == 0  # put back as it was


def test_bind_thread_makes_a_gpu_current_and_leaves_the_cpu_alone(monkeypatch) -> None:
    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    streams.bind_thread(torch.device("cuda", 1))
    streams.bind_thread(torch.device("cpu"))
    assert made_current == [torch.device("cuda", 1)]


def test_the_tiers_io_threads_bind_the_engines_device(tmp_path, monkeypatch) -> None:
    """Every I/O thread, the loop's and the waiter included, binds the device the tiers are for."""
    bound = []
    monkeypatch.setattr(
        streams,
        "bind_thread",
        lambda device: bound.append((threading.current_thread().name, device)),
    )
    cfg = Config(
        placement=Placement(*[Tier.HOST] * 5),
        nvme_path=[str(tmp_path)],
        io_threads=2,
        host_budget="64MiB",
        gpu_budget="64MiB",
    )
    tiers = Tiers(cfg.tiering, cfg.streaming, cfg.formats, torch.device("cpu"), {Tier.HOST}).open()
    try:
        tiers.run(tiers.landed(None))  # an event that has happened: no thread needed for it
        tiers.run(tiers.io.wait_off_workers(lambda: None))
        tiers.run(_on_a_worker())
    finally:
        tiers.close()
    assert {device for _, device in bound} == {torch.device("cpu")}
    assert {"tierzero-io-loop", "tierzero-io_0", "tierzero-wait_0"} <= {name for name, _ in bound}


async def _on_a_worker() -> None:
    await asyncio.get_running_loop().run_in_executor(None, lambda: None)
