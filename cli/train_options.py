"""The options of `tierzero train`, each declared once with its help text.

`train`'s signature names each option on one line by its alias here; the order of that signature
is the order `tierzero train --help` lists them in. Every option but those `train` itself reads
(--config, --resume, --overwrite, --nproc, --comm-timeout, --json) sets the run-config key of its
own name, or the one `run_overrides` names."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tierzero.config import STATE_BLOCK
from tierzero.errors import ConfigError

Config = Annotated[
    Path | None,
    typer.Option("--config", help="TOML file of run and engine keys; flags override it."),
]
Model = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="Model preset (tiny, 125m, 350m, 1b, 3b, 7b, 13b, 70b, llama3-8b, llama3-70b), or "
        "hf:DIR, a local Hugging Face causal LM directory.",
    ),
]
Units = Annotated[
    str | None,
    typer.Option(
        "--units",
        help="Attribute path of the model's repeated blocks (e.g. model.layers); default: its "
        "largest list of one block class.",
    ),
]
Data = Annotated[
    str | None,
    typer.Option(
        "--data",
        help="A text file, a folder of text files, a .jsonl file, .parquet files or a datasets "
        "save_to_disk directory, or .bin/.npy token ids; default: the stdlib's own sources. "
        "Text is tokenized by an hf: model's tokenizer.json, else read as bytes. Records "
        "with messages (the model's chat template) or prompt/completion train on the "
        "assistant turns / completion only.",
    ),
]
TextField = Annotated[
    str | None,
    typer.Option(
        "--text-field", help="The field of each .jsonl record that holds its text (default: text)."
    ),
]
Weights = Annotated[
    str | None,
    typer.Option(
        "--weights", help="Start from local .safetensors weights (a file or a directory of them)."
    ),
]
LoraR = Annotated[
    int | None,
    typer.Option(
        "--lora-r",
        help="Train LoRA adapters of this rank (peft) on the frozen hf:DIR base; export writes a "
        "peft adapter, or merged weights with --merge.",
    ),
]
LoraAlpha = Annotated[
    float | None,
    typer.Option("--lora-alpha", help="LoRA's alpha: adapters scale by alpha/r (default 16)."),
]
LoraDropout = Annotated[
    float | None, typer.Option("--lora-dropout", help="Dropout on the adapters' input (default 0).")
]
LoraTargets = Annotated[
    str | None,
    typer.Option(
        "--lora-targets",
        help="Comma-separated module names to adapt, e.g. q_proj,v_proj (default: peft's choice "
        "for the model; where it has none, every linear layer of the decoder layers).",
    ),
]
Steps = Annotated[int | None, typer.Option("--steps", help="Optimizer steps.")]
BatchSize = Annotated[int | None, typer.Option("--batch-size", help="Sequences per micro-batch.")]
SeqLen = Annotated[int | None, typer.Option("--seq-len", help="Tokens per sequence.")]
LongExamples = Annotated[
    str | None,
    typer.Option(
        "--long-examples",
        help="A prompt/completion or chat example longer than --seq-len: truncate (default: keep "
        "the prompt's end and the reply's start), split (into windows; later ones train "
        "without the prompt) or drop.",
    ),
]
Accumulate = Annotated[
    int | None, typer.Option("--accumulate", help="Micro-batches per optimizer step.")
]
Schedule = Annotated[
    str | None,
    typer.Option(
        "--schedule",
        help="How --accumulate micro-batches run: horizontal (each through every unit), vertical "
        "(each unit for all of them: params read once per pass, grads written once per step; "
        "built-in models and Hugging Face decoders) or auto (default: vertical when "
        "accumulating, where it applies).",
    ),
]
Recompute = Annotated[
    str | None,
    typer.Option(
        "--recompute",
        help="Which blocks run their forward again in backward: auto (default: keep the "
        "activations of as many as the compute device's budget holds; the built-in models, "
        "horizontal schedule), all (activation checkpointing everywhere), or none (refused "
        "where they do not fit).",
    ),
]
OptimizerDevice = Annotated[
    str | None,
    typer.Option(
        "--optimizer-device",
        help="Where the optimizer steps: auto (default: the planner's pick from measured "
        "speeds; `tierzero plan` says which and why), cpu (beside the host buffers), or gpu "
        "(on the compute device: master and moments come up through pinned host buffers and go "
        "back, the grads never come down).",
    ),
]
OptimizerState = Annotated[
    str | None,
    typer.Option(
        "--optimizer-state",
        help="How the two Adam moments are stored on every tier and in checkpoints: fp32 (default: "
        "exact, bitwise torch.optim.AdamW(fused=True)), bf16 (half the bytes), or int8 (a "
        f"quarter: blocks of {STATE_BLOCK} values share one fp32 scale). Fixed for the run's "
        "life; `tierzero plan --optimizer-state` shows the bytes.",
    ),
]
Master = Annotated[
    str | None,
    typer.Option(
        "--master",
        help="The master weights' dtype: fp32 (default: exact) or bf16 (stochastically rounded; "
        "with --dtype bf16 the param is the master, one tensor). Fixed for the run's life.",
    ),
]
Lr = Annotated[float | None, typer.Option("--lr", help="Peak learning rate.")]
WeightDecay = Annotated[
    float | None,
    typer.Option(
        "--weight-decay",
        help="AdamW's decoupled weight decay (default 0.1); 1-D parameters (norms, biases) get "
        "none, as in torch AdamW param groups that exclude them.",
    ),
]
AdamBetas = Annotated[
    str | None, typer.Option("--adam-betas", help="AdamW's beta1,beta2 (default 0.9,0.95).")
]
AdamEps = Annotated[
    float | None, typer.Option("--adam-eps", help="AdamW's epsilon (default 1e-8).")
]
WarmupSteps = Annotated[int | None, typer.Option("--warmup-steps", help="Linear warmup steps.")]
ClipGradNorm = Annotated[
    float | None, typer.Option("--clip-grad-norm", help="Clip the global grad norm to this.")
]
ClipPreviousNorm = Annotated[
    bool | None,
    typer.Option(
        "--clip-previous-norm",
        help="With --overlap-step and --clip-grad-norm: clip step k by step k-1's norm (an "
        "approximation) instead of re-stepping exactly when the clip fires.",
    ),
]
Seed = Annotated[int | None, typer.Option("--seed", help="Seed for init and data order.")]
Dtype = Annotated[str | None, typer.Option("--dtype", help="Compute dtype: fp32, bf16 or fp16.")]
Offload = Annotated[
    str | None,
    typer.Option("--offload", help="Where state lives: none (in memory), host, nvme or auto."),
]
NvmePath = Annotated[
    list[str] | None,
    typer.Option(
        "--nvme-path",
        help="SSD directory for offloaded state; repeat once per drive. Default: RUN_DIR/nvme.",
    ),
]
HostBudget = Annotated[
    str | None, typer.Option("--host-budget", help="Host memory budget, e.g. 8GiB.")
]
GpuBudget = Annotated[
    str | None, typer.Option("--gpu-budget", help="GPU memory budget, e.g. 20GiB.")
]
PrefetchDepth = Annotated[
    int | None,
    typer.Option(
        "--prefetch-depth",
        help="Units fetched ahead of compute. Default: 2, or 1 where the budgets need it, with "
        "the largest pieces (piece_numel in a --config file; at most 16Mi elements) that "
        "fit.",
    ),
]
OverlapStep = Annotated[
    bool | None,
    typer.Option(
        "--overlap-step/--no-overlap-step",
        help="Step each unit's optimizer during backward where exact.",
    ),
]
QuantizeBase = Annotated[
    str | None,
    typer.Option(
        "--quantize-base",
        help="Store the frozen base's linear weights in 4 bits: nf4 (bitsandbytes' NormalFloat "
        "codes, blocks of 64 with an fp32 absmax: 0.5625 bytes per weight on every tier and "
        "read; each unit decoded on the compute device as it is fetched) or none (default). "
        "Needs a frozen base (--lora-r) and bitsandbytes.",
    ),
]
VerifyReads = Annotated[
    str | None,
    typer.Option(
        "--verify-reads",
        help="Check every NVMe read's crc32c, so a flipped bit stops the run naming the chunk: "
        "on, off, or auto (default: on where crc32c runs at 20x one thread's read speed of "
        "--nvme-path).",
    ),
]
Profile = Annotated[
    Path | None,
    typer.Option(
        "--profile",
        help="`tierzero bench --profile-out` file; --offload auto uses it to predict step time.",
    ),
]
RunDir = Annotated[
    Path | None,
    typer.Option(
        "--run-dir",
        help="Where config, metrics, checkpoints and offloaded state go. Default: "
        "runs/<model>-<time>.",
    ),
]
CheckpointEvery = Annotated[
    int | None,
    typer.Option(
        "--checkpoint-every", help="Checkpoint every N optimizer steps (and always at the end)."
    ),
]
KeepCheckpoints = Annotated[
    int | None,
    typer.Option("--keep-checkpoints", help="Keep the newest K checkpoints (default 2)."),
]
KeepBest = Annotated[
    bool | None,
    typer.Option(
        "--keep-best/--no-keep-best",
        help="Checkpoint at every evaluation that beats the run's best eval loss and keep that "
        "checkpoint (named in RUN_DIR/best.json) through --keep-checkpoints pruning.",
    ),
]
ValData = Annotated[
    str | None,
    typer.Option(
        "--val-data",
        help="Held-out data to evaluate on, in any format --data takes; default: a split off the "
        "end of --data.",
    ),
]
ValFraction = Annotated[
    float | None,
    typer.Option(
        "--val-fraction",
        help="The share of --data's end held out for evaluation, in [0, 1); default 0.05 where "
        "the corpus can spare a window, else no evaluation (with a note).",
    ),
]
EvalEvery = Annotated[
    int | None,
    typer.Option(
        "--eval-every",
        help="Evaluate every N optimizer steps, before the first and after the last (default 40; "
        "0: never). Each evaluation reads every unit once.",
    ),
]
EvalTokens = Annotated[
    int | None,
    typer.Option(
        "--eval-tokens",
        help="Tokens in the evaluation set: its first windows that hold this many (default 4096).",
    ),
]
Resume = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="Continue the run in --run-dir from its newest intact checkpoint, up to --steps.",
    ),
]
Overwrite = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Start a new run in a --run-dir that holds checkpoints; the old ones are moved into "
        "checkpoints/abandoned/.",
    ),
]
GradReduceDtype = Annotated[
    str | None,
    typer.Option(
        "--grad-reduce-dtype",
        help="What gradients are summed over ranks in: fp32 (default, exact) or bf16 (half the "
        "bytes).",
    ),
]
OverlapComm = Annotated[
    bool | None,
    typer.Option(
        "--overlap-comm/--no-overlap-comm",
        help="Several ranks: all-gather each unit's params while the one before computes, and "
        "reduce its grads while the next backward computes (default on).",
    ),
]
Stage = Annotated[
    int | None,
    typer.Option(
        "--stage",
        help="Several ranks, ZeRO stage: 3 partitions params, grads and optimizer states (params "
        "all-gathered at each use); 2 replicates params (one all-gather per unit per step); "
        "1 also keeps whole grads over --accumulate micro-batches (one reduction per step). "
        "Default: 1 or 2 when replicated state fits the budgets, else 3.",
    ),
]
Nproc = Annotated[
    int | None,
    typer.Option(
        "--nproc",
        help="Ranks on this machine (one per GPU; gloo processes on a CPU): runs torchrun's "
        "launcher for you. --batch-size is the global batch, split over them.",
    ),
]
DriveTbw = Annotated[
    float | None,
    typer.Option(
        "--drive-tbw",
        help="The NVMe drive's rated endurance in terabytes written (its datasheet's TBW, e.g. "
        "600; drive_tbw in a --config file): the summary says what share of it the run "
        "wrote, with a note above 1%.",
    ),
]
CommTimeout = Annotated[
    float,
    typer.Option(
        "--comm-timeout",
        help="Seconds a collective waits for the other ranks before the run stops with an error.",
    ),
]
SamplePrompts = Annotated[
    Path | None,
    typer.Option(
        "--sample-prompts",
        help="Prompts to complete from the weights as they train (a text file, one per line, or "
        ".jsonl records with prompt or messages), greedily, all in one batch; into "
        "RUN_DIR/samples.jsonl.",
    ),
]
SampleEvery = Annotated[
    int | None,
    typer.Option(
        "--sample-every",
        help="Complete --sample-prompts every N optimizer steps (always at the end).",
    ),
]
SampleMaxNewTokens = Annotated[
    int | None,
    typer.Option(
        "--sample-max-new-tokens", help="New tokens per sample prompt at most (default 64)."
    ),
]
ReportTo = Annotated[
    str | None,
    typer.Option(
        "--report-to",
        help="Experiment trackers that get the run's config and every metrics row as it is "
        "written: none (default), or any of tensorboard, wandb, mlflow, trackio, "
        "comma-separated; each needs its extra, e.g. pip install 'tierzero[wandb]'.",
    ),
]
JsonOut = Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")]

# the options `train` reads itself: they set no run-config key
_NOT_KEYS = frozenset({"config", "resume", "overwrite", "nproc", "comm_timeout", "json_out"})


def run_overrides(params: dict[str, Any]) -> dict[str, Any]:
    """The run-config values the options give, by key (None: not given), from click's parsed
    `params`: each option sets the key of its own name, but --adam-betas and --adam-eps set
    `betas` and `eps`; paths are strings and --lora-targets a list, as in a TOML file."""
    overrides = {
        key: str(value) if isinstance(value, Path) else value
        for key, value in params.items()
        if key not in _NOT_KEYS
    }
    overrides["betas"] = _betas(overrides.pop("adam_betas"))
    overrides["eps"] = overrides.pop("adam_eps")
    # repeated: click's empty tuple when not given
    overrides["nvme_path"] = list(overrides["nvme_path"]) or None
    overrides["lora_targets"] = _names(overrides["lora_targets"])
    return overrides


def _betas(text: str | None) -> tuple[float, float] | None:
    """`--adam-betas 0.9,0.95` as two floats (Config checks their range)."""
    if text is None:
        return None
    try:
        beta1, beta2 = (float(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--adam-betas '{text}' is not two numbers; write them like 0.9,0.95"
        ) from None
    return beta1, beta2


def _names(text: str | None) -> list[str] | None:
    """`--lora-targets q_proj, v_proj` as module names; None when none is named."""
    names = [name.strip() for name in (text or "").split(",") if name.strip()]
    return names or None
