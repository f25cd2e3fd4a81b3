"""`tierzero plan --recompute`: how many blocks keep their activations in the room the chosen
placement leaves on the compute device, as the engine chooses them (`planning.recompute`)."""

from __future__ import annotations

import pytest
from tierzero.cli.app import app
from typer.testing import CliRunner

from tierzero.config import Tier
from tierzero.errors import ConfigError
from tierzero.planning.planreport import make_plan


def plan(gpu_mem: str | int, recompute: str = "auto", **kw):
    return make_plan(
        "tiny",
        gpu_mem=gpu_mem,
        host_mem="64GB",
        nvme_free="1TB",
        batch_size=2,
        seq_len=128,
        dtype="fp32",
        recompute=recompute,
        **kw,
    )


def test_kept_blocks_follow_the_room_on_the_compute_device() -> None:
    roomy = plan("8GB")
    per = roomy.activations.recompute_bytes
    # tiny's head is tied: recomputed
    assert roomy.kept.kept_blocks == roomy.recompute.keepable_units == 4
    assert roomy.as_dict()["recompute"] == {
        "recompute": "auto",
        "keepable_units": 4,
        "kept_blocks": 4,
        "kept_head": False,
        "graphs_per_block": 1,
        "bytes_per_block": per,
        "head_bytes": roomy.activations.head_kept_bytes,
        "kept_bytes": 4 * per,
        "sized_by": "the shape",
    }
    gpu_need = roomy.choice.estimate.memory.needs()[Tier.GPU]
    tight = plan(gpu_need + 5 * per // 2)  # the same placement, room for two and a half blocks
    assert tight.placement == roomy.placement
    assert tight.kept.kept_blocks == 2
    assert plan("8GB", "all").kept.kept_bytes == 0
    with pytest.raises(ConfigError, match="--recompute none keeps 4 units' activations"):
        plan(gpu_need + 5 * per // 2, "none")


def test_the_vertical_schedule_keeps_a_graph_per_micro_batch() -> None:
    """Vertically a kept block holds k graphs, each with its input, from the forward sweep to
    the backward sweep; the room decides how many blocks keep them."""
    roomy = plan("8GB", accumulate=3, schedule="vertical")
    act = roomy.activations
    per = 3 * (act.recompute_bytes + act.hidden_bytes)
    assert act.hidden_bytes == 2 * 128 * 256 * 4  # batch x seq x dim x fp32
    assert roomy.kept.kept_blocks == 4 and roomy.kept.kept_bytes == 4 * per
    rc = roomy.as_dict()["recompute"]
    assert (rc["graphs_per_block"], rc["bytes_per_block"]) == (3, per)
    need = roomy.choice.estimate.memory.needs()[Tier.GPU]
    assert plan(need + 3 * per // 2, accumulate=3, schedule="vertical").kept.kept_blocks == 1
    with pytest.raises(ConfigError, match="horizontal schedule only"):
        plan("8GB", "none", accumulate=2, schedule="vertical")
    with pytest.raises(ConfigError, match="--recompute 'some' is not valid"):
        plan("8GB", "some")


@pytest.mark.parametrize(
    "args,fragment",
    [
        (
            [
                "plan",
                "--model",
                "tiny",
                "--gpu-mem",
                "8GB",
                "--host-mem",
                "64GB",
                "--nvme-free",
                "1TB",
                "--recompute",
                "some",
            ],
            "--recompute 'some' is not valid",
        ),
        (
            [
                "plan",
                "--model",
                "7b",
                "--gpu-mem",
                "2GB",
                "--host-mem",
                "8GB",
                "--nvme-free",
                "1TB",
                "--seq-len",
                "4096",
                "--recompute",
                "none",
            ],
            "--recompute none keeps 33 units' activations",
        ),
        (["train", "--recompute", "some"], "recompute 'some' is not valid"),
    ],
    ids=["plan-unknown", "plan-none-does-not-fit", "train-unknown"],
)
def test_the_flag_refuses_in_one_sentence(
    tmp_path, monkeypatch, args: list[str], fragment: str
) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], (
        result.output
    )


def test_plan_prints_the_kept_units() -> None:
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "--model",
            "tiny",
            "--gpu-mem",
            "8GB",
            "--host-mem",
            "64GB",
            "--nvme-free",
            "1TB",
            "--batch-size",
            "2",
            "--seq-len",
            "128",
            "--dtype",
            "fp32",
        ],
    )
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "Recompute: auto: 4 blocks of 4 units that can keep their activations do" in text
