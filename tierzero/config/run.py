"""The run's `RunConfig`: what `tierzero train` needs on top of the engine's `Config`, in
sections -- the corpus (`Corpus`), evaluation (`Evaluation`), checkpoints (`Checkpointing`),
LoRA (`LoraSettings`) and what the run reports (`Reporting`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from tierzero.config.engine import Config
from tierzero.config.kinds import LongExamples, Offload
from tierzero.config.sectioned import Sectioned
from tierzero.errors import ConfigError
from tierzero.refusals import count, number, positive, refused


@dataclass(frozen=True)
class Corpus:
    """The training data: a preset, a file or a directory (`None`: the built-in corpus), the
    .jsonl field that holds a record's text, and what happens to a fine-tuning example longer
    than a window (`tierzero.run.packing`)."""

    data: str | None = None
    text_field: str = "text"
    long_examples: LongExamples = LongExamples.TRUNCATE

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "long_examples", LongExamples(self.long_examples))
        except ValueError:
            raise refused(
                "long_examples",
                f"must be one of {', '.join(e.value for e in LongExamples)}, "
                f"got {self.long_examples!r}",
            ) from None
        if not isinstance(self.text_field, str) or not self.text_field:
            raise refused("text_field", f"must name a .jsonl field, got {self.text_field!r}")


@dataclass(frozen=True)
class Evaluation:
    """The validation set and how often it is measured: `eval_tokens` tokens' windows (whatever
    the batch size) of `val_data`, or of the end of the corpus (`val_fraction`; `None`: 5% where
    the corpus spares it); every `eval_every` optimizer steps (0 or `None`: never); with
    `keep_best`, a checkpoint at each evaluation that improves, kept through pruning."""

    eval_every: int | None = 40
    eval_tokens: int = 4096
    val_data: str | None = None
    val_fraction: float | None = None
    keep_best: bool = False

    def __post_init__(self) -> None:
        count(self.eval_tokens, "eval_tokens")
        if self.eval_every not in (0, None):
            count(self.eval_every, "eval_every")
        fraction = self.val_fraction
        if fraction is not None and (not number(fraction) or not 0 <= fraction < 1):
            raise refused(
                "val_fraction",
                f"must be a number in [0, 1) (the corpus's share held out), got {fraction!r}",
            )
        if fraction is not None and self.val_data is not None:
            raise ConfigError(
                "--val-data and --val-fraction both name a validation set; pass one of them"
            )


@dataclass(frozen=True)
class Checkpointing:
    """Checkpoint every `checkpoint_every` optimizer steps (`None`: only when the run
    finishes), keeping the newest `keep_checkpoints`."""

    checkpoint_every: int | None = None
    keep_checkpoints: int = 2

    def __post_init__(self) -> None:
        count(self.keep_checkpoints, "keep_checkpoints")
        every = self.checkpoint_every
        if every is not None and (
            isinstance(every, bool) or not isinstance(every, int) or every < 1
        ):
            raise refused(
                "checkpoint_every", f"must be an integer >= 1 (optimizer steps), got {every!r}"
            )


@dataclass(frozen=True)
class LoraSettings:
    """peft adapters trained on a frozen `hf:` base (`lora_r` of `None`: full training);
    `lora_targets` of `None`: every linear layer of the decoder units (`tierzero.hf.lora`)."""

    lora_r: int | None = None
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: list[str] | None = None

    def __post_init__(self) -> None:
        r, targets = self.lora_r, self.lora_targets
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise refused("lora_r", f"must be an integer >= 1 (the adapters' rank), got {r!r}")
        positive(self.lora_alpha, "lora_alpha", strict=True)
        if not number(self.lora_dropout) or not 0 <= self.lora_dropout < 1:
            raise refused("lora_dropout", f"must be a number in [0, 1), got {self.lora_dropout!r}")
        if targets is not None and (
            not isinstance(targets, list)
            or not targets
            or not all(isinstance(t, str) and t for t in targets)
        ):
            raise refused(
                "lora_targets", f"must be module names such as q_proj,v_proj, got {targets!r}"
            )


@dataclass(frozen=True)
class Reporting:
    """What the run reports besides metrics.jsonl: trackers (checked by
    `tierzero.run.trackers`), samples of a prompts file every `sample_every` steps (`None`: at
    the end only), and its NVMe writes against the drive's rated terabytes written."""

    report_to: list[str] = field(default_factory=list)
    sample_prompts: str | None = None
    sample_every: int | None = None
    sample_max_new_tokens: int = 64
    drive_tbw: float | None = None

    def __post_init__(self) -> None:
        count(self.sample_max_new_tokens, "sample_max_new_tokens")
        if self.sample_every is not None:
            count(self.sample_every, "sample_every")
        if self.drive_tbw is not None:
            positive(self.drive_tbw, "drive_tbw", strict=True)


@dataclass(frozen=True, init=False)
class RunConfig(Sectioned):
    """What `tierzero train` needs on top of the engine: the model (a preset, or `hf:<local
    dir>` of a Hugging Face causal LM) and its starting weights (a local .safetensors file or
    directory), the loop's length and batch, the run directory, and the sections."""

    SECTIONS: ClassVar[dict[str, type]] = {
        "corpus": Corpus,
        "evaluation": Evaluation,
        "checkpoints": Checkpointing,
        "lora": LoraSettings,
        "reporting": Reporting,
    }

    corpus: Corpus
    evaluation: Evaluation
    checkpoints: Checkpointing
    lora: LoraSettings
    reporting: Reporting
    model: str = "tiny"
    weights: str | None = None
    steps: int = 80
    batch_size: int = 8
    seq_len: int = 128
    run_dir: str | None = None
    engine: Config = field(default_factory=Config)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len"):
            count(getattr(self, name), name)

    def replace(self, **keys: Any) -> RunConfig:
        """A copy with `keys` changed, the engine's flat keys among them."""
        engine = {k: keys.pop(k) for k in Config.keys() & set(keys)}
        if engine:
            keys["engine"] = keys.get("engine", self.engine).replace(**engine)
        return super().replace(**keys)

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat key, the engine's beside the run's (one TOML table)."""
        out = super().flat()
        out.update(out.pop("engine").flat())
        return out

    def check_ranks(self, world_size: int) -> None:
        """Refuse what several ranks cannot train: a global batch that does not split evenly,
        or the in-memory reference trainer (one process, no collectives)."""
        if world_size == 1:
            return
        if self.batch_size % world_size:
            raise ConfigError(
                f"--batch-size {self.batch_size} (the global batch) does not split evenly over "
                f"{world_size} ranks; use a multiple of {world_size}"
            )
        if self.engine.tiering.offload is Offload.NONE:
            raise ConfigError(
                f"--offload none trains in memory on one rank, not {world_size}; use --offload "
                "host, nvme or auto with several ranks"
            )
