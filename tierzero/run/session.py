"""A training session: the model, the data and the trainer that `tierzero train` runs.

`offload none` trains through the in-memory reference trainer; every other offload through
the `Engine`, which takes the model on the `meta` device and materialises it unit by unit.
The model is a built-in preset or a Hugging Face directory (`tierzero.run.model_load`).
A session seeds torch's global RNG and Python's `random` from `--seed` before anything draws
from them, so identical runs save identical RNG states (and dropout repeats); a resumed run
then sets them from its checkpoint.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tierzero.checkpoint.catalog import checkpoint_dirs
from tierzero.config import Offload, RunConfig
from tierzero.distributed.launch import Ranks
from tierzero.errors import ConfigError, DataError
from tierzero.precision import check_dtype_supported, resolve_dtype
from tierzero.run.corpus import read_data
from tierzero.run.data import TokenBatches
from tierzero.run.directory import RunDir
from tierzero.run.loop import LoopResult, Trainer, train_loop
from tierzero.run.model_load import RunModel, run_model
from tierzero.run.packing import Fitted, fit_examples
from tierzero.run.prompts import Codec
from tierzero.run.samples import TrainingSamples


@dataclass
class Session:
    run: RunConfig
    trainer: Trainer
    batches: TokenBatches
    model: RunModel
    device: str
    dtype: str
    placement_text: str
    fitted: Fitted | None = None  # what --long-examples did to the fine-tuning examples
    samples: TrainingSamples | None = None  # --sample-prompts, completed as the run trains

    @property
    def n_params(self) -> int:
        return self.model.n_params

    def train(
        self,
        rundir: RunDir,
        on_step: Callable[[int, dict[str, Any]], None] | None = None,
        start_step: int = 0,
    ) -> LoopResult:
        save = None
        if hasattr(self.trainer, "save_checkpoint"):

            def save(step: int) -> None:
                self.trainer.save_checkpoint(
                    rundir.path,
                    data=self.batches.state_dict(),
                    keep=self.run.checkpoints.keep_checkpoints,
                    model=self.model.description,
                )

        # an Engine's collectives over the ranks; the in-memory trainer has none
        parts = getattr(self.trainer, "parts", None)
        comm = parts.layout.comm if parts is not None else None
        mean = comm.mean if comm is not None else None
        gather = comm.all_gather_json if comm is not None and comm.world_size > 1 else None
        total = comm.total if comm is not None else None
        samples = self.samples.logger(self.trainer, rundir) if self.samples is not None else None
        return train_loop(
            self.run,
            self.trainer,
            self.batches,
            rundir,
            on_step,
            start_step,
            save,
            mean,
            gather,
            total,
            samples,
        )

    def resume(self, rundir: RunDir) -> tuple[int, list[str]]:
        """Continue from the run directory's newest intact checkpoint: the loop's step to go on
        from and what to tell the user (damaged checkpoints skipped, newer ones moved aside);
        step 0 when the run has none yet. The loop counts global batches, so that is the
        checkpoint's step plus the fp16 steps it skipped for overflow (each took a batch)."""
        if not checkpoint_dirs(rundir.path):
            return 0, [f"run directory '{rundir.path}' has no checkpoint yet: starting from step 0"]
        if not hasattr(self.trainer, "load_checkpoint"):
            raise ConfigError(
                "--resume needs a tiered run (--offload host, nvme or auto); the in-memory "
                "reference trainer keeps no checkpoints"
            )
        manifest = self.trainer.load_checkpoint(rundir.path)
        if manifest.data is not None:
            self.batches.load_state_dict(manifest.data)
        moved = rundir.abandon_after(manifest.step)  # they would be taken for this run's later ones
        done = manifest.step + int(manifest.engine.get("skipped_steps") or 0)
        return done, [
            *self.trainer.notes(),
            *moved,
            f"resumed from checkpoint step {manifest.step}",
        ]

    def notes(self) -> list[str]:
        """What the trainer has to say after training (the model's `notes` are said before it)."""
        return self.trainer.notes() if hasattr(self.trainer, "notes") else []


def load_batches(
    run: RunConfig, model: RunModel, ranks: Ranks = Ranks()
) -> tuple[TokenBatches, Fitted | None]:
    """The run's data, tokenized for `model` and checked against its vocabulary; with several
    ranks, this rank's rows of every global batch. Fine-tuning examples longer than a window
    are fitted by `run.corpus.long_examples`; what that touched (None: plain text)."""
    tokens, examples = read_data(
        run.corpus.data, model.vocab_size, model.tokenizer, run.corpus.text_field
    )
    # --val-data: no split
    fraction = 0.0 if run.evaluation.val_data is not None else run.evaluation.val_fraction
    if examples is None:
        batches, fitted = (
            TokenBatches(
                tokens,
                run.batch_size,
                run.seq_len,
                seed=run.engine.seed,
                val_fraction=fraction,
                rank=ranks.rank,
                world_size=ranks.world_size,
            ),
            None,
        )
    else:
        examples, fitted = fit_examples(examples, run.seq_len + 1, run.corpus.long_examples)
        if not len(examples.ids):
            raise DataError(
                f"every one of the {fitted.examples} examples is longer than "
                f"--seq-len {run.seq_len} allows and --long-examples drop left none; "
                "raise --seq-len or truncate them"
            )
        batches = TokenBatches(
            examples.ids,
            run.batch_size,
            run.seq_len,
            seed=run.engine.seed,
            val_fraction=fraction,
            rank=ranks.rank,
            world_size=ranks.world_size,
            trained=examples.trained,
            examples=examples.bounds,
        )
    if run.evaluation.val_data is not None:
        val, val_examples = read_data(
            run.evaluation.val_data, model.vocab_size, model.tokenizer, run.corpus.text_field
        )
        if val_examples is None:
            batches.held_out(val)
        else:
            val_examples, _ = fit_examples(val_examples, run.seq_len + 1, run.corpus.long_examples)
            batches.held_out(val_examples.ids, val_examples.trained, val_examples.bounds)
    return batches, fitted


@contextmanager
def open_session(run: RunConfig, ranks: Ranks = Ranks()) -> Iterator[Session]:
    """Check every input, then build data, model and trainer; close the trainer on exit.
    With several ranks the process group is already up (`tierzero.distributed.launch`)."""
    cfg = run.engine
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    device = cfg.tiering.resolved_device()
    dtype = resolve_dtype(cfg.precision.dtype, device)
    check_dtype_supported(dtype, device)
    model = run_model(run)
    batches, fitted = load_batches(run, model, ranks)
    samples = TrainingSamples.for_run(run, Codec.for_model(model))  # read now
    if run.evaluation.keep_best and not (batches.has_validation and run.evaluation.eval_every):
        raise ConfigError(
            "--keep-best keeps the checkpoint of the lowest eval loss, but this run evaluates "
            "nothing; pass --val-data or --val-fraction and an --eval-every above 0"
        )
    run.check_ranks(ranks.world_size)
    if cfg.tiering.offload is Offload.NONE:
        from tierzero.reference import ReferenceTrainer

        if run.checkpoints.checkpoint_every is not None or run.evaluation.keep_best:
            raise ConfigError(
                "checkpoints need a tiered run (--offload host, nvme or auto); the in-memory "
                "reference trainer keeps none: drop --checkpoint-every and --keep-best, or offload"
            )
        if cfg.formats.quantize_base != "none":
            raise ConfigError(
                f"--quantize-base {cfg.formats.quantize_base} stores the base in the tiers, "
                "and --offload none trains in memory without them; pass --offload "
                "host or nvme"
            )
        trainer: Trainer = ReferenceTrainer(model.in_memory(device, cfg.seed), cfg, device)
        text = "everything in memory (reference trainer)"
    else:
        from tierzero.engine import Engine

        trainer = Engine(model.on_meta(), cfg, weights=model.engine_weights)
        text = trainer.parts.layout.placement.describe()
    try:
        yield Session(run, trainer, batches, model, str(device), dtype.value, text, fitted, samples)
    finally:
        trainer.close()
