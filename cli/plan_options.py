"""The options of `tierzero plan`, each declared once with its help text.

`plan`'s signature names each option on one line by its alias here, in the order
`tierzero plan --help` lists them. Each sets the `tierzero.plan` argument of its own name."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tierzero.config import STATE_BLOCK, Evaluation, RunConfig
from tierzero.models.presets import PRESETS
from tierzero.planning.planreport import DEFAULT_PRESET

Model = Annotated[
    str | None,
    typer.Option(
        "--model",
        help=f"Model preset: {', '.join(PRESETS)} (default {DEFAULT_PRESET}); or hf:DIR, a "
        "local Hugging Face causal LM directory (read from its config.json).",
    ),
]
Params = Annotated[
    str | None,
    typer.Option(
        "--params",
        help="A parameter count instead of a preset, e.g. 7e9 or 70B; shaped like the nearest "
        "preset.",
    ),
]
Gpus = Annotated[
    int | None,
    typer.Option(
        "--gpus",
        help="Data-parallel GPUs (ranks), all on this machine (default 1). Given, the plan is "
        "for GPUs computing in bf16 unless --dtype says otherwise.",
    ),
]
GpuMem = Annotated[
    str | None,
    typer.Option(
        "--gpu-mem",
        help="Memory per GPU, e.g. 80GB or 24GiB. Default: 90% of GPU 0's free memory, as "
        "`tierzero train` takes; without CUDA the gpu tier is host memory, inside --host-mem.",
    ),
]
HostMem = Annotated[
    str | None,
    typer.Option(
        "--host-mem",
        help="Host memory, e.g. 512GB. Default: half the free RAM, as `tierzero train` takes "
        "(split across its ranks).",
    ),
]
NvmeFree = Annotated[
    str | None,
    typer.Option(
        "--nvme-free", help="Free NVMe space, e.g. 2TB. Default: free space at --nvme-path."
    ),
]
NvmePath = Annotated[
    Path,
    typer.Option(
        "--nvme-path", help="Where offloaded state would go (for the free-space default)."
    ),
]
BatchSize = Annotated[
    int | None,
    typer.Option(
        "--batch-size",
        help="Sequences per micro-batch per GPU (activation memory). Default: `tierzero "
        f"train`'s batch ({RunConfig.batch_size}) split over --gpus.",
    ),
]
SeqLen = Annotated[
    int | None,
    typer.Option(
        "--seq-len",
        help=f"Tokens per sequence. Default: {RunConfig.seq_len}, as `tierzero train` takes.",
    ),
]
PrefetchDepth = Annotated[
    int | None,
    typer.Option(
        "--prefetch-depth",
        help="Units fetched ahead of compute. Default: 2, or 1 where that does not fit, as "
        "`tierzero train` chooses it.",
    ),
]
Dtype = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="Compute dtype: bf16, fp16 or fp32. Default: bf16 with --gpus; else as `tierzero "
        "train` here: bf16 on a GPU that computes in it (or one given by --gpu-mem), else fp32.",
    ),
]
VocabSize = Annotated[
    int | None,
    typer.Option("--vocab-size", help="Override the shape's vocabulary, e.g. 128256."),
]
PieceNumel = Annotated[
    int | None,
    typer.Option(
        "--piece-numel",
        help="Elements per piece in which grads and optimizer states stream. Default: 16Mi, or "
        "the largest that fits, as `tierzero train` chooses it.",
    ),
]
Overlap = Annotated[
    bool,
    typer.Option(
        "--overlap/--no-overlap",
        help="Step each unit during backward (the engine's default without clipping or fp16).",
    ),
]
Profile = Annotated[
    Path | None,
    typer.Option("--profile", help="A `tierzero bench --profile-out` file: predicts step times."),
]
Stage = Annotated[
    int | None,
    typer.Option(
        "--stage",
        help="With --gpus > 1, the ZeRO stage (1, 2 or 3); default: chosen as `tierzero train` "
        "chooses it (1 or 2 when replicated state fits, else 3).",
    ),
]
Accumulate = Annotated[
    int,
    typer.Option(
        "--accumulate",
        help="Micro-batches per step (stage 1 keeps whole grads between them).",
    ),
]
Schedule = Annotated[
    str,
    typer.Option(
        "--schedule",
        help="How the --accumulate micro-batches run: horizontal, vertical (each unit for all "
        "of them; built-in shapes and Hugging Face decoders) or auto (default: vertical when "
        "accumulating, where it applies), as `tierzero train --schedule`; the NVMe bytes per "
        "step are printed for both.",
    ),
]
Recompute = Annotated[
    str,
    typer.Option(
        "--recompute",
        help="Which blocks run their forward again in backward: auto (default: keep the "
        "activations of as many as the compute device's budget holds), all, or none (refused "
        "where they do not fit), as `tierzero train --recompute`.",
    ),
]
OptimizerDevice = Annotated[
    str,
    typer.Option(
        "--optimizer-device",
        help="Where the optimizer steps: auto (default: the faster side by measured speeds -- "
        "this CPU's step and --profile's host<->device rate, or this machine's GPU), cpu, or "
        "gpu, as `tierzero train --optimizer-device`; the plan says which and why.",
    ),
]
OptimizerState = Annotated[
    str,
    typer.Option(
        "--optimizer-state",
        help="How the two Adam moments are stored on every tier: fp32 (default: exact), bf16, "
        f"or int8 (blocks of {STATE_BLOCK} values, an fp32 scale each), as `tierzero train "
        "--optimizer-state`; the ledger, every tier's peak, the NVMe bytes per step and the "
        "choice count them so.",
    ),
]
Master = Annotated[
    str,
    typer.Option(
        "--master",
        help="The master weights' dtype: fp32 (default) or bf16 (with bf16 compute the param "
        "is the master: one tensor), as `tierzero train --master`.",
    ),
]
LoraR = Annotated[
    int | None,
    typer.Option(
        "--lora-r",
        help="Plan LoRA adapters of this rank on an hf:DIR model, its base frozen, as "
        "`tierzero train --lora-r` adds them: only the adapters have grads and optimizer state.",
    ),
]
LoraTargets = Annotated[
    str | None,
    typer.Option(
        "--lora-targets",
        help="Comma-separated module names the adapters wrap, as `tierzero train "
        "--lora-targets` (default: peft's for the architecture, else every linear layer of "
        "the decoder layers).",
    ),
]
QuantizeBase = Annotated[
    str,
    typer.Option(
        "--quantize-base",
        help="How the frozen base's linear weights are stored, as `tierzero train "
        "--quantize-base`: none (default: the compute dtype) or nf4 (4-bit codes and an fp32 "
        "absmax per 64 values, 0.5625 bytes a weight in every tier and read; needs --lora-r).",
    ),
]
Steps = Annotated[
    int,
    typer.Option(
        "--steps",
        help=f"Optimizer steps of the run whose NVMe writes are projected (default "
        f"{RunConfig.steps}, as `tierzero train`).",
    ),
]
CheckpointEvery = Annotated[
    int | None,
    typer.Option(
        "--checkpoint-every",
        help="Checkpoint every N steps, as `tierzero train --checkpoint-every`: their writes "
        "are projected too (train always checkpoints at the end).",
    ),
]
EvalTokens = Annotated[
    int,
    typer.Option(
        "--eval-tokens",
        help=f"Tokens of the validation set (default {Evaluation.eval_tokens}, as `tierzero "
        "train --eval-tokens`): what one evaluation reads is printed.",
    ),
]
DriveTbw = Annotated[
    float | None,
    typer.Option(
        "--drive-tbw",
        help="The NVMe drive's rated endurance in terabytes written (its datasheet's TBW, e.g. "
        "600): prints the share of it the run writes, with a note above 1%.",
    ),
]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
