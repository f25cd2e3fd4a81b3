"""`tierzero.plan` for every model `train` takes, `hf:DIR` included.

`tierzero.planning.planreport.make_plan` plans a preset shape, a parameter count, or a model built
elsewhere given as its units and the LLaMA-like shape its activations are estimated from. This
builds that for a Hugging Face directory from its `config.json` alone (parameters on `meta`,
no weight read), so the CLI and Python callers plan an `hf:` model the same way.
"""

from __future__ import annotations

from typing import Any

from tierzero.engine.vertical.chain import chain_of
from tierzero.errors import ConfigError
from tierzero.hf.build import is_hf, load_model
from tierzero.hf.lora import LoraSpec, add_lora, default_targets
from tierzero.layout.partition import partition
from tierzero.models.presets import ModelArgs
from tierzero.planning.ledger import check_world_size
from tierzero.planning.planreport import PlanReport, make_plan


def plan(
    model: str | None = None,
    gpus: int | None = None,
    lora: LoraSpec | None = None,
    **options: Any,
) -> PlanReport:
    """`make_plan(model, gpus=gpus, **options)`; `model` may be `hf:DIR` (see `hf_workload`),
    with `lora`'s adapters added as `tierzero train --lora-r` adds them (its base frozen).
    `gpus` given plans that many bf16 GPUs unless `dtype` says otherwise (None: one, as here)."""
    if lora is not None and (model is None or not is_hf(model)):
        raise ConfigError(
            "--lora-r adapts a Hugging Face model; plan it with --model hf:DIR (its config.json "
            "is enough)"
        )
    built = (
        hf_workload(model, 1 if gpus is None else gpus, lora)
        if model is not None and is_hf(model)
        else {}
    )
    return make_plan(model, gpus=gpus, **options, **built)


def hf_workload(model: str, gpus: int, lora: LoraSpec | None = None) -> dict[str, Any]:
    """hf:DIR built from its config.json with its parameters on `meta`: its units as the engine
    would partition them over `gpus` ranks (with `lora`'s adapters, the base frozen), the
    LLaMA-like shape the activation estimate uses (dim, layers, heads, kv heads, MLP width,
    vocabulary, positions), and why the vertical schedule cannot drive it, if it cannot
    (`make_plan`'s `units`, `args`, `not_a_chain`)."""
    check_world_size(gpus)
    hf = load_model(model)
    cfg = hf.model.config
    heads = cfg.num_attention_heads
    dim = cfg.hidden_size
    ffn = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * dim
    positions = getattr(cfg, "max_position_embeddings", None) or ModelArgs.max_seq_len
    args = ModelArgs(
        dim=dim,
        n_layers=cfg.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        vocab_size=cfg.vocab_size,
        ffn_dim=ffn,
        max_seq_len=positions,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
    )
    adapted = hf.model if lora is None else add_lora(hf, default_targets(hf, lora)[0], None)
    units = partition(adapted, gpus)
    chain = chain_of(adapted, units)
    return {"units": units, "args": args, "not_a_chain": chain if isinstance(chain, str) else None}
