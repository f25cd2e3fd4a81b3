"""A training session: the model, the data and the trainer that `tierzero train` runs.

`offload none` trains through the in-memory reference trainer; every other offload through
the `Engine`, which builds the model on the `meta` device and materialises it unit by unit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tierzero import models
from tierzero.config import Offload, RunConfig
from tierzero.data import TokenBatches, default_corpus, load_tokens
from tierzero.checkpoint import checkpoint_dirs
from tierzero.errors import ConfigError, DataError
from tierzero.init import WeightFiles
from tierzero.loop import LoopResult, Trainer, train_loop
from tierzero.precision import check_dtype_supported, resolve_dtype
from tierzero.rundir import RunDir


@dataclass
class Session:
    run: RunConfig
    trainer: Trainer
    batches: TokenBatches
    n_params: int
    device: str
    dtype: str
    placement_text: str

    def train(self, rundir: RunDir, on_step: Callable[[int, dict[str, Any]], None] | None = None,
              start_step: int = 0) -> LoopResult:
        save = None
        if hasattr(self.trainer, "save_checkpoint"):
            def save(step: int) -> None:
                self.trainer.save_checkpoint(rundir.path, data=self.batches.state_dict(),
                                             keep=self.run.keep_checkpoints, model={"preset": self.run.model})
        return train_loop(self.run, self.trainer, self.batches, rundir, on_step, start_step, save)

    def resume(self, rundir: RunDir) -> tuple[int, list[str]]:
        """Continue from the run directory's newest intact checkpoint: its step and what to tell
        the user (damaged checkpoints skipped); step 0 when the run has none yet."""
        if not checkpoint_dirs(rundir.path):
            return 0, [f"run directory '{rundir.path}' has no checkpoint yet: starting from step 0"]
        if not hasattr(self.trainer, "load_checkpoint"):
            raise ConfigError("--resume needs a tiered run (--offload host, nvme or auto); the in-memory "
                              "reference trainer keeps no checkpoints")
        manifest = self.trainer.load_checkpoint(rundir.path)
        if manifest.data is not None:
            self.batches.load_state_dict(manifest.data)
        return manifest.step, [*self.trainer.notes(), f"resumed from checkpoint step {manifest.step}"]

    def notes(self) -> list[str]:
        return self.trainer.notes() if hasattr(self.trainer, "notes") else []


def load_batches(run: RunConfig) -> TokenBatches:
    tokens: np.ndarray = load_tokens(run.data) if run.data else default_corpus()
    return TokenBatches(tokens, run.batch_size, run.seq_len, seed=run.engine.seed)


def load_weights(model: torch.nn.Module, path: str) -> None:
    """Load local safetensors weights into a built model, checking every name and shape."""
    files = WeightFiles(path)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(files.load((name,), tuple(param.shape)))


@contextmanager
def open_session(run: RunConfig) -> Iterator[Session]:
    """Check every input, then build data, model and trainer; close the trainer on exit."""
    args = models.get_preset(run.model)
    cfg = run.engine
    device = cfg.resolved_device()
    dtype = resolve_dtype(cfg.dtype, device)
    check_dtype_supported(dtype, device)
    batches = load_batches(run)
    if batches.vocab_size_needed > args.vocab_size:
        raise DataError(f"the data has token ids up to {batches.vocab_size_needed - 1} but model "
                        f"'{run.model}' has a vocabulary of {args.vocab_size}; pick a model preset "
                        "with a larger vocabulary or re-tokenize the data")
    if cfg.offload is Offload.NONE:
        from tierzero.reference import ReferenceTrainer

        if run.checkpoint_every is not None:
            raise ConfigError("checkpoints need a tiered run (--offload host, nvme or auto); the in-memory "
                              "reference trainer keeps none: drop --checkpoint-every or offload")
        model = models.build(args, device=device, seed=cfg.seed)
        if run.weights:
            load_weights(model, run.weights)
        trainer: Trainer = ReferenceTrainer(model, cfg, device)
        text = "everything in memory (reference trainer)"
    else:
        from tierzero.engine import Engine

        trainer = Engine(models.build(args, device="meta", seed=cfg.seed), cfg, weights=run.weights)
        text = trainer.placement.describe()
    try:
        yield Session(run, trainer, batches, args.param_count(), str(device), dtype.value, text)
    finally:
        trainer.close()
