"""Building Hugging Face models for the engine: meta parameters, real buffers, layouts, the
loss contract, the model's own init, and one-line errors for what cannot be built."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from tierzero.cli.app import app
from typer.testing import CliRunner, Result

from tests.support.hf import config
from tierzero import Config, Engine
from tierzero.errors import ConfigError
from tierzero.hf import SplitCausalLM, load_model, materialise
from tierzero.layout.partition import partition
from tierzero.models.loss import compute_loss

runner = CliRunner()


def batch(seed: int = 0, size: int = 2, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.randint(0, 256, (size, seq + 1), generator=torch.Generator().manual_seed(seed))
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def test_parameters_on_meta_buffers_real_and_no_kv_cache(hf_models):
    from transformers import AutoModelForCausalLM

    hf = load_model(f"hf:{hf_models['llama']}")
    assert all(p.is_meta for p in hf.model.parameters())
    own = AutoModelForCausalLM.from_config(config("llama"))
    buffers = dict(hf.model.named_buffers())
    assert buffers.keys() == dict(own.named_buffers()).keys() and buffers
    # rotary inv_freq, real
    assert all(torch.equal(b, own.get_buffer(n)) for n, b in buffers.items())
    assert hf.model.config.use_cache is False
    assert {n for n, _ in hf.model.named_parameters()} == {n for n, _ in own.named_parameters()}


def test_layouts(hf_models):
    llama, gpt2 = load_model(hf_models["llama"]), load_model(hf_models["gpt2"])
    assert isinstance(llama.model, SplitCausalLM)
    units = partition(llama.model)
    assert [u.kind for u in units] == ["embedding", "block", "block", "head"]
    assert units[-1].uses_with == (0,)  # tied: the head uses the embedding unit
    assert {n for s in units[-1].slots for n in s.names} == {"model.norm.weight"}
    # GPT-2's position embedding runs before the blocks: the embedding unit's (tierzero.hf.prelude)
    assert isinstance(gpt2.model, SplitCausalLM)
    assert [u.kind for u in partition(gpt2.model)] == ["embedding", "block", "block", "head"]
    assert [u.name for u in partition(load_model(hf_models["llama"], units="model.layers").model)][
        1
    ] == "model.layers.0"
    with pytest.raises(ConfigError, match="units 'model.nope'"):
        load_model(hf_models["llama"], units="model.nope")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_loss_is_the_models_own(arch, hf_models):
    """Shifted targets (tierzero's batches), HF labels (shifted by HF) and a dict batch."""
    from transformers import AutoModelForCausalLM

    own = AutoModelForCausalLM.from_pretrained(hf_models[arch])
    model = materialise(load_model(hf_models[arch]), seed=0, weights=hf_models[arch])
    x, y = batch()
    with torch.no_grad():
        logits = own(input_ids=x).logits
        assert torch.allclose(
            model(x, y), F.cross_entropy(logits.flatten(0, 1), y.flatten()), atol=1e-6
        )
        assert torch.allclose(model(x, labels=x), own(input_ids=x, labels=x).loss, atol=1e-6)
        assert torch.allclose(compute_loss(model, {"input_ids": x, "targets": y}), model(x, y))
        assert torch.allclose(model(x), logits, atol=1e-5)


def test_loss_in_chunks_of_tokens_is_the_whole_loss(hf_models):
    """The split layout's head runs on chunks of tokens (a small `loss_chunk_bytes`: 5 tokens of
    logits), each under checkpointing: the loss and every gradient match the unchunked model up
    to summation order, and the head never sees more than one chunk's tokens, forward or
    backward."""
    model = materialise(load_model(hf_models["llama"]), seed=0, weights=hf_models["llama"])
    assert isinstance(model, SplitCausalLM)
    x, y = batch()
    y[0, :3] = -100  # ignored targets count in no chunk's share
    whole = model(x, y)
    whole.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    seen: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[-2]))
    model.loss_chunk_bytes = 5 * 4 * model.config.vocab_size
    chunked = model(x, y)
    chunked.backward()
    hook.remove()
    # forward, then recomputed in backward
    assert seen and max(seen) == 5 and sum(seen) == 2 * x.numel()
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_init_is_the_models_own_and_the_engines_matches_in_memory(hf_models, tmp_path):
    """No weights: every unit initialised by the model's `_init_weights` under (seed, unit)."""
    model_dir = tmp_path / "config-only"
    model_dir.mkdir()
    shutil.copy(hf_models["llama"] / "config.json", model_dir)
    hf = load_model(model_dir)
    assert hf.weights is None
    in_memory = {
        n: p.detach().clone()
        for n, p in materialise(load_model(model_dir), seed=3).named_parameters()
    }
    engine = Engine(
        hf.model,
        Config(
            offload="nvme", device="cpu", dtype="fp32", nvme_path=[str(tmp_path / "nvme")], seed=3
        ),
    )
    try:
        master = engine.master_state_dict()
    finally:
        engine.close()
    assert all(torch.equal(master[n], p) for n, p in in_memory.items())
    # LlamaRMSNorm: no reset_parameters
    assert torch.equal(master["model.norm.weight"], torch.ones(64))
    std = hf.model.config.initializer_range
    assert abs(master["model.layers.0.mlp.up_proj.weight"].std().item() - std) < 0.1 * std
    other = materialise(load_model(model_dir), seed=4)
    assert not torch.equal(
        other.get_parameter("model.layers.1.self_attn.q_proj.weight"),
        in_memory["model.layers.1.self_attn.q_proj.weight"],
    )


def test_offload_none_trains_the_model_in_memory(hf_models, tmp_path):
    result = runner.invoke(
        app,
        [
            "train",
            "--model",
            f"hf:{hf_models['gpt2']}",
            "--offload",
            "none",
            "--steps",
            "2",
            "--batch-size",
            "1",
            "--seq-len",
            "16",
            "--run-dir",
            str(tmp_path / "run"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{") :])
    assert summary["steps"] == 2 and summary["first_loss"] > 0


def test_checkpoint_names_that_transformers_renames_on_saving(tmp_path):
    """GPT-NeoX's output layer is `lm_head` in the model and `embed_out` in its files."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    own = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(
            "gpt_neox",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=256,
        )
    )
    own.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "embed_out.weight" in f.keys() and "lm_head.weight" not in f.keys()
    hf = load_model(tmp_path)
    assert isinstance(hf.model, SplitCausalLM)  # final_layer_norm is registered after the layers
    engine = Engine(
        hf.model,
        Config(offload="nvme", device="cpu", dtype="fp32", nvme_path=[str(tmp_path / "nvme")]),
        weights=hf.weights,
    )
    try:
        master = engine.master_state_dict()
        x, y = batch()
        with torch.no_grad():
            expected = F.cross_entropy(own(input_ids=x).logits.flatten(0, 1), y.flatten())
            assert abs(engine.eval_loss((x, y)) - expected.item()) < 1e-5
    finally:
        engine.close()
    assert all(torch.equal(master[n], p) for n, p in own.state_dict().items())


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_bad_models_are_one_line_errors(hf_models, tmp_path):
    def train(*a: str) -> Result:
        return runner.invoke(app, ["train", "--steps", "1", "--run-dir", str(tmp_path / "run"), *a])

    assert "is not a local directory" in one_line_error(
        train("--model", "hf:meta-llama/Llama-3.2-1B")
    )
    assert "has no config.json" in one_line_error(train("--model", f"hf:{tmp_path}"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "no-such-architecture"}')
    assert "transformers config" in one_line_error(train("--model", f"hf:{tmp_path / 'bad'}"))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(hf_models["gpt2"] / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    assert "pytorch_model.bin, a pickle tierzero never loads" in one_line_error(
        train("--model", f"hf:{pickled}")
    )
    ids = tmp_path / "ids.npy"
    import numpy as np

    np.save(ids, np.arange(300, dtype=np.uint16))
    error = one_line_error(train("--model", f"hf:{hf_models['gpt2']}", "--data", str(ids)))
    assert str(ids) in error and "token id 299" in error and "vocabulary of 256" in error
