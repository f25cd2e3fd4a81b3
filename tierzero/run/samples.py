"""Samples during training: every `sample_every` steps, and at the end, greedy completions of
the `--sample-prompts` from the weights as they are then, logged to `samples.jsonl`.

The prompts are read and tokenized when the session opens (a missing or empty file, or for a
built-in model a prompt too long for its positions, stops the run before it trains). Each time,
all of them go through the trainer as one batch, the same path as `tierzero generate`
(`tierzero.run.generate`): the engine's eval passes through the tiers, one per new token, or
the reference trainer's model in memory. Plain prompts are framed as the run's data frames
its text (`tierzero.run.prompts.Framing`: a user's turn in the chat template for chats). With
several ranks every rank runs the passes (they are collectives) and rank 0 writes the rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tierzero.config import RunConfig
from tierzero.errors import ConfigError
from tierzero.models.presets import get_preset
from tierzero.run.directory import RunDir
from tierzero.run.generate import Decoder, Sampling, generate
from tierzero.run.prompts import Codec, Prompt, framing_of, read_prompts


@dataclass
class TrainingSamples:
    """The run's sample prompts as ids, and when to complete them."""

    prompts: list[Prompt]
    ids: list[list[int]]
    codec: Codec
    every: int | None  # steps between samples; None: at the end only
    last_step: int
    sampling: Sampling

    @classmethod
    def for_run(cls, run: RunConfig, codec: Codec) -> TrainingSamples | None:
        """The samples `run` asks for (None: no `sample_prompts`), its prompts read and encoded."""
        from tierzero.hf import is_hf

        if run.reporting.sample_prompts is None:
            return None
        prompts = read_prompts(run.reporting.sample_prompts)
        framing = framing_of(run.corpus.data)
        ids = [codec.encode(p, framing) for p in prompts]
        positions = max(map(len, ids)) + run.reporting.sample_max_new_tokens
        if not is_hf(run.model) and positions > get_preset(run.model).max_seq_len:
            raise ConfigError(
                f"the longest sample prompt and --sample-max-new-tokens make {positions} "
                f"positions, past {run.model}'s max_seq_len {get_preset(run.model).max_seq_len}; "
                "shorten them"
            )
        return cls(
            prompts,
            ids,
            codec,
            run.reporting.sample_every,
            run.steps,
            Sampling(run.reporting.sample_max_new_tokens),
        )

    def due(self, step: int) -> bool:
        return step == self.last_step or (self.every is not None and step % self.every == 0)

    def complete(self, decoder: Decoder, step: int) -> list[dict[str, Any]]:
        """Every prompt's completion from the current weights, as samples.jsonl rows."""
        new = generate(decoder, self.ids, self.sampling, self.codec.stop_ids)
        return [
            {
                "step": step,
                "prompt": p.shown(),
                "completion": self.codec.decode(n),
                "prompt_ids": i,
                "completion_ids": n,
            }
            for p, i, n in zip(self.prompts, self.ids, new)
        ]

    def logger(self, trainer: Any, rundir: RunDir) -> Callable[[int], None]:
        """What the loop calls after each step: samples from `trainer` when due, to `rundir`."""
        decoder = trainer_decoder(trainer)

        def log(step: int) -> None:
            if self.due(step):
                rundir.log_samples(step, self.complete(decoder, step))

        return log


def trainer_decoder(trainer: Any) -> Decoder:
    """A session trainer's decoder: the engine's tiered passes, or the reference trainer's model."""
    from tierzero.engine import Engine

    if isinstance(trainer, Engine):
        return Decoder.through(trainer)
    return Decoder.in_memory(trainer.model, trainer.device, trainer.dtype)
