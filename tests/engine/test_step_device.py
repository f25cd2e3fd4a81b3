"""Where the optimizer steps (`--optimizer-device`, `planning.stepdevice`): on the CPU here the
device step runs its own path -- states leased from the device pool, brought up from their
homes and written back through host buffers -- and must give the host step's bits; `auto`
weighs the two sides from measured rates, and says why; what cannot be done is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.engine import SMALL, batches, engine_config
from tierzero import Placement, Tier, models
from tierzero.config import Config, DType, OptimizerDevice, StateKind
from tierzero.engine import Engine
from tierzero.errors import ConfigError
from tierzero.planning.statebytes import StateBytes
from tierzero.planning.stepdevice import StepRates, choose, link_bytes

NVME = Placement(*[Tier.NVME] * 5)
HOST = Placement(Tier.GPU, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST)
ON_GPU = Placement(Tier.NVME, Tier.HOST, Tier.GPU, Tier.GPU, Tier.GPU)
INT8 = StateBytes.for_compute("int8", "bf16", DType.BF16)


def _train(config: Config, steps: int = 3) -> tuple[list[float], dict, dict, str]:
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=config.seed), config) as engine:
        losses, moved = [], {}
        for _ in range(steps):
            losses.append(engine.train_step(data.next_batch()))
            for key, value in engine.stats().items():
                if key.startswith("bytes_"):
                    moved[key] = moved.get(key, 0) + value
        return losses, engine.master_state_dict(), moved, engine.parts.step_reason


@pytest.mark.parametrize(
    "placement,formats",
    [
        (NVME, {}),
        (HOST, {"accumulate": 2}),
        (NVME, {"dtype": "bf16", "optimizer_state": "int8", "master": "bf16"}),
        (HOST, {"dtype": "bf16", "optimizer_state": "bf16", "master": "fp32"}),
    ],
)
def test_a_step_on_the_device_gives_the_host_steps_bits(tmp_path, placement, formats) -> None:
    """The same losses and weights, bitwise; on the device the states came up and went back
    (bytes the host step does not move), and the grads never came down."""
    runs = {
        side: _train(engine_config(tmp_path / side, placement, optimizer_device=side, **formats))
        for side in ("cpu", "gpu")
    }
    (host_losses, host_weights, host_moved, host_why), (losses, weights, moved, why) = (
        runs["cpu"],
        runs["gpu"],
    )
    assert losses == host_losses
    assert all(torch.equal(weights[k], host_weights[k]) for k in host_weights)
    assert why == "on the compute device (--optimizer-device gpu)"
    assert host_why == "on the CPU (--optimizer-device cpu)"
    state = sum(
        StateBytes.for_compute(
            formats.get("optimizer_state", "fp32"),
            formats.get("master", "fp32"),
            DType(formats.get("dtype", "fp32")),
        ).per_param(kind, 2)
        for kind in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
    )
    assert moved["bytes_host->gpu"] - host_moved["bytes_host->gpu"] > state * 3 * 1000
    assert moved["bytes_gpu->host"] > host_moved["bytes_gpu->host"]


def test_auto_weighs_the_two_sides_and_says_why() -> None:
    """Explicit choices are kept; master and moments on the GPU step there; a CPU device steps
    on the CPU; on a GPU machine the measured rates decide, both ways."""
    choice = OptimizerDevice

    def pick(placement, c, device="cuda", rates=None):
        def measured() -> StepRates:
            assert rates is not None, "rates measured where nothing is weighed"
            return rates

        return choose(placement, c, device, INT8, (2, 2), True, measured)

    assert pick(ON_GPU, choice.CPU) == (ON_GPU, "on the GPU, where master and moments live")
    assert pick(NVME, choice.CPU) == (NVME, "on the CPU (--optimizer-device cpu)")
    on_device = dataclasses.replace(NVME, optimizer=Tier.GPU)
    assert pick(NVME, choice.GPU) == (on_device, "on the compute device (--optimizer-device gpu)")
    assert pick(NVME, choice.AUTO, "cpu") == (NVME, "on the CPU, the compute device")
    # int8 + bf16 with bf16 compute: the device step moves 2 x (1 + 1) moments' bytes (and
    # their scales) and 2 of new params down; the host step 2 of grads down
    sides = link_bytes(NVME, INT8, 2, 2, True)
    assert (sides.host, sides.device) == (2, pytest.approx(2 * 2 * (1 + 4 / 256) + 2))
    slow_cpu = StepRates(host_params_per_s=0.1e9, link_bytes_per_s=25e9)
    fast_cpu = StepRates(host_params_per_s=50e9, link_bytes_per_s=25e9)
    placement, why = pick(NVME, choice.AUTO, rates=slow_cpu)
    assert placement == on_device and why.startswith("on the GPU: the host steps 0.10 G params/s")
    assert "10.00 against 0.24 s per billion params" in why
    placement, why = pick(NVME, choice.AUTO, rates=fast_cpu)
    assert placement == NVME and why.startswith("on the CPU: ") and "0.08 against 0.24" in why


def test_what_a_device_step_cannot_do_is_refused_in_one_sentence(tmp_path) -> None:
    """Exact clipping beside backward re-steps from a kept generation that a step on the device
    by choice does not keep: refused with the fix; `auto` steps on the CPU and says why."""
    exact = {"clip_grad_norm": 1.0, "overlap_step": True}
    config = engine_config(tmp_path / "gpu", NVME, optimizer_device="gpu", **exact)
    with pytest.raises(ConfigError, match="^--optimizer-device gpu cannot keep .* --clip-previous"):
        Engine(models.build(SMALL, device="meta", seed=0), config)
    config = engine_config(tmp_path / "auto", NVME, **exact)
    with Engine(models.build(SMALL, device="meta", seed=0), config) as engine:
        assert engine.parts.step_reason == (
            "on the CPU: exact clipping beside backward keeps its states there"
        )
        assert engine.parts.layout.placement.optimizer is None
    with pytest.raises(ConfigError, match="optimizer_device 'tpu' is not valid; choose one of"):
        Config(optimizer_device="tpu")
