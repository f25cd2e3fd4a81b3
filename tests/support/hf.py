"""Small random-weight Hugging Face models, built from config alone and saved sharded.

`hf_models` (a session fixture, registered in conftest) saves one LLaMA (tied embeddings, with
a word-level `tokenizer.json`) and one GPT-2 (no tokenizer: byte-level data) with
`save_pretrained` in several safetensors shards and an index, as a user's directory would be.
Dropout is off so that tierzero and plain PyTorch draw no random numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tierzero.adamw import decays, implementation
from tierzero.config import Config
from tierzero.lr import lr_at
from tierzero.run.data import default_corpus

VOCAB = 256
LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    tie_word_embeddings=True,
    max_position_embeddings=128,
)
GPT2 = dict(
    n_embd=64,
    n_layer=2,
    n_head=4,
    vocab_size=VOCAB,
    n_positions=128,
    bos_token_id=0,
    eos_token_id=0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
SHARD = "40KB"  # ~100k parameters in fp32: several shards and an index


def config(arch: str, **overrides):
    from transformers import GPT2Config, LlamaConfig

    return (
        LlamaConfig(**{**LLAMA, **overrides})
        if arch == "llama"
        else GPT2Config(**{**GPT2, **overrides})
    )


def save_model(arch: str, path: Path, seed: int = 0, shard: str = SHARD, **overrides) -> Path:
    """A random-weight model of `arch`, saved with save_pretrained (sharded safetensors)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config(arch, **overrides)).save_pretrained(
        path, max_shard_size=shard
    )
    return path


def save_coded_base(path: Path) -> Path:
    """A small Llama whose blocks' linear weights, coded in NF4, span several 8192-value pieces:
    the base the QLoRA tests and plan's coded-base tests train and count."""
    return save_model(
        "llama", path, hidden_size=128, intermediate_size=320, num_hidden_layers=2, vocab_size=512
    )


def sample_text(nbytes: int = 24_000) -> str:
    """Real text (the standard library's sources), the same on every run of this Python."""
    return default_corpus(nbytes).tobytes().decode("utf-8", errors="replace")


def save_word_tokenizer(path: Path, text: str, vocab_size: int = 200) -> Path:
    """A word-level `tokenizer.json` trained on `text` (ids below `vocab_size`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        [text], trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"])
    )
    tokenizer.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def save_chat_llama(path: Path, text: str, template: str, eos_token: str) -> Path:
    """A tiny LLaMA whose logits vary (a wide init), a word-level tokenizer trained on `text`
    and a chat template: what generation and chat fine-tuning tests run on."""
    folder = save_model("llama", path, initializer_range=0.5)
    save_word_tokenizer(folder, text)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
        "eos_token": eos_token,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    llama = save_model("llama", root / "llama")
    save_word_tokenizer(llama, sample_text())
    return {"llama": llama, "gpt2": save_model("gpt2", root / "gpt2")}


def plain_adamw(model: torch.nn.Module, config: Config) -> torch.optim.AdamW:
    """torch's AdamW over a plain model, grouped by weight decay as the engine steps it: the
    oracle's optimizer."""
    params = list(model.parameters())
    return torch.optim.AdamW(
        [
            {
                "params": [p for p in params if decays(p)],
                "weight_decay": config.optimizer.weight_decay,
            },
            {"params": [p for p in params if not decays(p)], "weight_decay": 0.0},
        ],
        lr=config.optimizer.lr,
        betas=config.optimizer.betas,
        eps=config.optimizer.eps,
        **implementation(torch.device("cpu")),
    )


def plain_step(opt: torch.optim.Optimizer, step: int, config: Config) -> None:
    """One optimizer step of the oracle at the schedule's lr for `step`, grads cleared after."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, config.optimizer)
    opt.step()
    opt.zero_grad()
