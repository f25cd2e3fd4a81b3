"""Build a Hugging Face causal LM from a local directory, its parameters on `meta`.

`--model hf:<dir>` names a directory holding `config.json` (and, optionally, `*.safetensors`
weights and a `tokenizer.json`); nothing is downloaded, and a name that is not a local
directory is refused in one sentence. The model is constructed from the config with every
*parameter* on `meta` and every *buffer* real (`_parameters_on_meta`): buffers such as rotary
`inv_freq` are computed by the constructors from the config and are not in checkpoints, so a
model built under `torch.device("meta")` would have none the engine could use. Parameters are
then materialised unit by unit by the engine (`tierzero.models.init`), from the directory's
safetensors or by the model's own `_init_weights`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tierzero.errors import ConfigError
from tierzero.hf.adapter import CausalLM, SplitCausalLM
from tierzero.hf.positions import check_seq_len, position_limit
from tierzero.layout.partition import find_blocks

PREFIX = "hf:"


@dataclass
class HFModel:
    """A built model and what the run needs from its directory."""

    model: CausalLM
    path: Path
    config: dict[str, Any]  # config.json as written, for export to write back
    weights: Path | None  # the directory when it holds *.safetensors, else None (init)
    tokenizer: Path | None  # tokenizer.json, when the directory has one

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def param_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def check_seq_len(self, seq_len: int) -> str | None:
        """Refuse `seq_len` where the model cannot run it; past the positions of rotary
        embeddings, which run on, the note to print once (`tierzero.hf.positions`)."""
        limit = position_limit(
            self.model,
            self.model.config,
            self.model.hf_model.get_input_embeddings(),
            self.model.blocks,
        )
        return check_seq_len(limit, seq_len, self.path.name)

    def description(self) -> dict[str, Any]:
        """What a checkpoint records (`save_checkpoint(model=...)`); export writes the config
        back."""
        return {"hf": str(self.path.resolve()), "config": self.config}


def describe(hf: HFModel, model: nn.Module | None = None) -> dict[str, Any]:
    """What a checkpoint records of `hf` (`save_checkpoint(model=...)`), with the peft configs of
    `model` when it is a peft model built on it: export then writes a peft adapter, or merges it."""
    doc = hf.description()
    configs = getattr(model, "peft_config", None)
    if isinstance(configs, dict) and configs:
        doc["peft"] = {
            name: json.loads(json.dumps(config.to_dict(), default=_json_value))
            for name, config in configs.items()
        }
    return doc


def _json_value(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


def is_hf(name: str) -> bool:
    return name.startswith(PREFIX)


def model_dir(name: str) -> Path:
    """The local directory behind `hf:<dir>`, or a one-line error (no hub, no network)."""
    path = Path(name[len(PREFIX) :] if is_hf(name) else name).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"model 'hf:{path}' is not a local directory; tierzero downloads nothing: "
            "pass hf:<dir> of a saved model (save_pretrained, or a snapshot you downloaded)"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model directory '{path}' has no config.json; pass the directory save_pretrained wrote"
        )
    return path


def load_model(name: str | Path, units: str | None = None) -> HFModel:
    """Build the causal LM of `hf:<dir>` (or `<dir>`) with its parameters on `meta`."""
    path = model_dir(str(name))
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ConfigError(
            "Hugging Face models need transformers; pip install 'tierzero[hf]'"
        ) from None
    try:
        raw = json.loads((path / "config.json").read_text())
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise ConfigError(
            f"cannot read {path / 'config.json'} as a transformers config ({_first_line(e)}); "
            "check the file, or upgrade transformers for a newer architecture"
        ) from None
    config.use_cache = False  # see adapter: a cache would be reused by the recompute
    try:
        with _parameters_on_meta():
            hf_model = AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise ConfigError(
            f"{path} is not a causal language model transformers can build "
            f"({_first_line(e)}); pass a *ForCausalLM model directory"
        ) from None
    _check_causal(hf_model, path)
    model = adapt(hf_model, units)
    weights = path if any(path.glob("*.safetensors")) else None
    pickled = sorted(path.glob("*.bin")) + sorted(path.glob("*.pt")) + sorted(path.glob("*.pth"))
    if weights is None and pickled:
        raise ConfigError(
            f"model directory '{path}' has weights only as {pickled[0].name}, a pickle tierzero "
            "never loads; convert them to safetensors (save_pretrained writes them by default)"
        )
    tokenizer = path / "tokenizer.json"
    return HFModel(model, path, raw, weights, tokenizer if tokenizer.is_file() else None)


def _check_causal(hf_model: nn.Module, path: Path) -> None:
    """Refuse an encoder (BERT-style: attention that sees the whole sequence), which transformers
    builds as a `*LMHeadModel` too: trained on next tokens it would see the token it predicts."""
    if any(getattr(m, "is_causal", True) is False for m in hf_model.modules()):
        raise ConfigError(
            f"{path} holds {type(hf_model).__name__}, whose attention is bidirectional "
            "(an encoder): trained as a causal LM each token would see the one it predicts; "
            'pass a decoder model directory (or set "is_decoder": true in its config.json '
            "to make this one causal)"
        )


def adapt(hf_model: nn.Module, units: str | None = None) -> CausalLM:
    """Wrap a built `*ForCausalLM`: split layout when its only parameters outside the blocks,
    input and output embeddings are learned position tables (GPT-2, OPT) and at most one final
    norm (none: OLMo's has no parameters); else root. `units` names the blocks (`model.layers`)
    if the largest list is wrong."""
    blocks_path, blocks = find_blocks(hf_model, units or _decoder_layers(hf_model))
    parent = blocks_path.rpartition(".")[0]
    if not parent:
        return CausalLM(hf_model, blocks_path)
    base = hf_model.get_submodule(parent)  # runs the blocks (OPT's head calls model.decoder itself)
    leftover = _leftover_modules(hf_model, blocks)
    tables = [m for m in leftover if _position_table(m, hf_model.config)]
    norms = [m for m in leftover if m not in tables]
    if len(norms) > 1 or (norms and not _final_norm(norms[0], base, blocks)):
        return CausalLM(hf_model, blocks_path)
    return SplitCausalLM(hf_model, blocks_path, base, norms[0] if norms else None, tables)


def _decoder_layers(hf_model: nn.Module) -> str | None:
    """The list of decoder layers when they are of several classes (a hybrid such as Jamba, whose
    attention and Mamba layers alternate): the largest `ModuleList` of the classes transformers
    names as layers (`_no_split_modules`); None when one class repeats (`find_blocks` finds it)."""
    layers = set(getattr(hf_model, "_no_split_modules", None) or ())
    lists = [
        (name, m)
        for name, m in hf_model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) > 1
    ]
    if any(len({type(b) for b in m}) == 1 for _, m in lists):
        return None
    hybrid = [(len(m), name) for name, m in lists if {type(b).__name__ for b in m} <= layers]
    return max(hybrid)[1] if hybrid else None


def _position_table(module: nn.Module, config: Any) -> bool:
    """A learned position table: an embedding of `max_position_embeddings` rows (OPT's has
    an offset of 2), which the base model adds to the token embeddings before the blocks."""
    limit = getattr(config, "max_position_embeddings", None)
    return (
        isinstance(module, nn.Embedding)
        and isinstance(limit, int)
        and limit <= module.num_embeddings <= limit + 2
    )


def _final_norm(module: nn.Module, base: nn.Module, blocks: nn.ModuleList) -> bool:
    """A norm after the blocks: registered after them (LLaMA's `norm`, GPT-2's `ln_f`) or a norm
    class beside them (OPT registers `final_layer_norm` first); the forward checks it runs last."""
    order = [id(m) for m in base.modules()]
    after = id(module) in order and order.index(id(module)) > order.index(id(blocks))
    return after or isinstance(module, nn.LayerNorm) or "norm" in type(module).__name__.lower()


def _leftover_modules(hf_model: nn.Module, blocks: nn.ModuleList) -> list[nn.Module]:
    """Modules with parameters of their own outside the blocks and the embeddings."""
    inside = {id(m) for m in blocks.modules()}
    inside |= {id(m) for m in hf_model.get_input_embeddings().modules()}
    output = hf_model.get_output_embeddings()
    if output is not None:
        inside |= {id(m) for m in output.modules()}
    return [
        m
        for m in hf_model.modules()
        if id(m) not in inside and any(True for _ in m.parameters(recurse=False))
    ]


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is moved to `meta`; buffers stay real. Allocation is
    only virtual: a parameter's CPU `empty` is never written before it moves."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def materialise(
    hf: HFModel, seed: int, device: torch.device | str = "cpu", weights: str | Path | None = None
) -> CausalLM:
    """The whole model in memory (the reference trainer's, `--offload none`): every parameter
    on `device`, from `weights` or initialised unit by unit as the engine does."""
    from tierzero.models.init import WeightFiles

    model = hf.model
    real_parameters(model)
    with torch.no_grad():
        if weights is None:
            for which in model.unit_kinds():
                model.init_unit(seed, which)
        else:
            files = WeightFiles(weights)
            names: dict[int, list[str]] = {}
            for name, p in model.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), []).append(name)
            for p in model.parameters():
                p.copy_(model.read_weight(files, tuple(names[id(p)]), tuple(p.shape)))
    return model.to(device)


def real_parameters(model: nn.Module) -> None:
    """Every parameter of `model` an fp32 CPU tensor, not yet written (tied ones stay one)."""
    real: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in real:
                    real[id(p)] = nn.Parameter(
                        torch.empty(p.shape, dtype=torch.float32), p.requires_grad
                    )
                module._parameters[attr] = real[id(p)]


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
