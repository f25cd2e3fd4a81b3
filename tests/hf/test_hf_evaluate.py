"""One evaluation in one pass over the weights on Hugging Face decoders: a dense LLaMA and a
Mixture-of-Experts Mixtral (its router aux loss off and on), every state on NVMe, fp32, one rank.

Each window's summed loss from `Engine.evaluate` (each layer called with its recorded
arguments, `tierzero.hf.layercalls`, on several windows' rows at once) equals the per-window
`eval_loss(window, summed=True)`: bitwise for the dense model; within 1e-6 relative for the
Mixture-of-Experts one, whose experts each take the tokens routed to them from every row of a
micro-batch, so an expert's matmul runs on another number of rows than it does for one window
(measured about 1e-7). Every unit's params are fetched once for the set.
A Mixtral whose router aux loss is on gets it too: each layer's router logits are carried
to the head, and each window's aux loss is computed from its own tokens' logits, as the
model's forward of that window alone computes it.
"""

from __future__ import annotations

import pytest
from transformers import MixtralConfig

from tests.support.engine import engine_config
from tests.support.hf import save_model
from tierzero import Engine
from tierzero.hf import load_model
from tierzero.run.data import TokenBatches, default_corpus

MIXTRAL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
}


def _windows_and_batch():
    data = TokenBatches(default_corpus(1 << 16), 2, 32, seed=0)
    return data.val_batches(16 * 64), data.next_batch()


def _evaluate(model_dir, tmp_path) -> tuple[list[float], list[float], int, int, list[str]]:
    hf = load_model(f"hf:{model_dir}")
    windows, batch = _windows_and_batch()
    with Engine(hf.model, engine_config(tmp_path, dtype="fp32"), weights=hf.weights) as engine:
        engine.train_step(batch)
        engine.stats()
        one_pass = engine.evaluate(windows)
        fetched = engine.stats()["bytes_host->gpu"]
        per_window = [engine.eval_loss(w, summed=True) for w in windows]
        param_bytes = sum(u.param_numel * 4 for u in engine.units)
        return one_pass, per_window, fetched, param_bytes, engine.notes()


def test_dense_llama_evaluates_in_one_pass(tmp_path) -> None:
    model_dir = save_model("llama", tmp_path / "llama", tie_word_embeddings=False)
    one_pass, per_window, fetched, param_bytes, notes = _evaluate(model_dir, tmp_path / "run")
    assert one_pass == per_window
    assert fetched == param_bytes and notes == []


@pytest.mark.parametrize("aux", [False, True])
def test_mixture_of_experts(tmp_path, aux: bool) -> None:
    model_dir = tmp_path / "mixtral"
    MixtralConfig(**MIXTRAL, output_router_logits=aux, router_aux_loss_coef=0.5).save_pretrained(
        model_dir
    )
    one_pass, per_window, fetched, param_bytes, notes = _evaluate(model_dir, tmp_path / "run")
    assert max(abs(a - b) / abs(b) for a, b in zip(one_pass, per_window)) < 1e-6
    assert fetched == param_bytes and notes == []
