"""Generation: the KV cache against recomputing every prefix, the engine's tiered passes against
the model in memory, transformers' own `generate` as the oracle for Hugging Face models, and
the sampling rules.

Cached decoding runs other matrix shapes than recomputing the whole prefix (one row per pass
instead of all of them), so fp32 logits agree to rounding (within 1e-5 of the largest), not
bitwise, and the greedy tokens are the same; through the engine the passes run the very same
shapes as in memory, so there the logits are bitwise equal.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.support.hf import sample_text, save_chat_llama, save_model
from tierzero import models
from tierzero.config import Config, DType
from tierzero.errors import ConfigError, DataError
from tierzero.models.presets import ModelArgs
from tierzero.run.generate import Decoder, Sampling, generate, next_tokens
from tierzero.run.inference import open_inference
from tierzero.run.prompts import Codec, Framing, Prompt, read_prompts

SMALL = ModelArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=256,
    ffn_dim=128,
    max_seq_len=96,
    tie_embeddings=True,
)
PROMPTS = [list(b"def main(args):\n    "), list(b"import os\n"), list(b"class A")]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


@pytest.fixture(scope="module")
def small() -> torch.nn.Module:
    """A small built-in model (GQA, as the presets) whose logits vary: a wide init."""
    model = models.build(SMALL, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(10.0)
    return model.eval()


def in_memory(model: torch.nn.Module) -> Decoder:
    return Decoder.in_memory(model, torch.device("cpu"), DType.FP32)


def uncached(
    model: torch.nn.Module, prompt: list[int], n: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens that recompute the whole prefix for each new one: the oracle of the cache."""
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            last = model(torch.tensor([ids]))[0, -1]
            logits.append(last)
            ids.append(int(last.argmax()))
    return ids[len(prompt) :], logits


def test_the_cache_gives_the_tokens_of_recomputing_every_prefix(small) -> None:
    model = small
    scores: list[torch.Tensor] = []
    new = generate(in_memory(model), PROMPTS, Sampling(24), scores=scores)
    for row, prompt in enumerate(PROMPTS):  # rows of three lengths: two are left-padded
        tokens, logits = uncached(model, prompt, 24)
        assert new[row] == tokens
        assert (
            max(((s[row] - x).abs().max() / x.abs().max()).item() for s, x in zip(scores, logits))
            < 1e-5
        )


def test_the_engine_streams_the_same_logits_as_the_model_in_memory(small, tmp_path) -> None:
    """fp32, params homed on NVMe: every pass fetches each unit through the swap plan; the
    logits are bitwise those of the same model held in memory."""
    from tierzero.engine import Engine

    expected_scores: list[torch.Tensor] = []
    in_memory_decoder = in_memory(small)
    expected = generate(in_memory_decoder, PROMPTS, Sampling(16), scores=expected_scores)
    weights = tmp_path / "small.safetensors"
    save_file(
        {k: v.contiguous() for k, v in small.state_dict().items() if k != "head.weight"}, weights
    )
    meta = models.build(SMALL, device="meta").requires_grad_(False)  # params only
    config = Config(offload="nvme", nvme_path=[str(tmp_path / "nvme")], dtype="fp32")
    with Engine(meta, config, weights=weights) as engine:
        scores: list[torch.Tensor] = []
        new = generate(Decoder.through(engine), PROMPTS, Sampling(16), scores=scores)
        fetched = engine.stats()["bytes_nvme->host"]
    assert new == expected
    assert all(torch.equal(a, b) for a, b in zip(scores, expected_scores))
    # allocated for every position at the first pass: 3 rows x 2 blocks x (k, v) x 2 kv heads x 16
    longest = max(map(len, PROMPTS))
    assert in_memory_decoder.cache_nbytes == 3 * 2 * 2 * 2 * 16 * (longest + 16) * 4
    assert fetched > 0


def test_sampling_repeats_its_seed_and_top_p_keeps_the_nucleus(small) -> None:
    model = small
    hot = Sampling(12, temperature=5.0, seed=7)
    first = generate(in_memory(model), PROMPTS, hot)
    again = generate(in_memory(model), PROMPTS, hot)
    other = generate(in_memory(model), PROMPTS, Sampling(12, temperature=5.0, seed=8))
    assert first == again and first != other
    greedy = generate(in_memory(model), PROMPTS, Sampling(12))
    narrow = generate(in_memory(model), PROMPTS, Sampling(12, temperature=5.0, top_p=1e-6, seed=7))
    assert narrow == greedy  # the nucleus of a tiny p is the top token alone
    # probabilities 0.03, 0.09, 0.24, 0.64
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).log_softmax(-1)
    drawn = {
        int(next_tokens(logits, Sampling(1, 1.0, 0.8), torch.Generator().manual_seed(s)))
        for s in range(200)
    }
    assert drawn == {2, 3}  # 0.64 < 0.8 needs the second; the rest is cut


def test_rows_stop_at_their_end_of_sequence_id(small) -> None:
    model = small
    greedy = generate(in_memory(model), PROMPTS, Sampling(12))
    eos = greedy[0][0]
    new = generate(in_memory(model), PROMPTS, Sampling(12), stop_ids={eos})
    assert new[0] == [eos]
    for row in range(len(PROMPTS)):
        cut = greedy[row].index(eos) + 1 if eos in greedy[row] else len(greedy[row])
        assert new[row] == greedy[row][:cut]


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_new_tokens=0),
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(temperature=float("nan")),
    ],
)
def test_bad_sampling_is_refused(bad) -> None:
    with pytest.raises(ConfigError):
        Sampling(**{"max_new_tokens": 4, **bad})


def test_a_prompt_longer_than_the_model_runs_is_refused(small) -> None:
    with pytest.raises(ConfigError, match="max_seq_len 96"):
        generate(in_memory(small), [[1] * 90], Sampling(8))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny LLaMA whose logits vary (a wide init), a word-level tokenizer and a chat template."""
    return save_chat_llama(
        tmp_path_factory.mktemp("chat") / "llama", sample_text(), TEMPLATE, "[UNK]"
    )


def test_greedy_ids_equal_transformers_generate_through_the_tiers(chat_model, tmp_path) -> None:
    """Three prompts in one batch (two left-padded), params homed on NVMe, against transformers'
    `generate(do_sample=False)` on the same left-padded batch."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(chat_model).eval()
    engine = {"offload": "nvme", "dtype": "fp32"}
    with open_inference(model=f"hf:{chat_model}", engine=engine, store=tmp_path) as inference:
        codec = inference.codec
        prompts = [
            codec.encode(Prompt(t)) for t in ("the class of this module is", "import", "def return")
        ]
        new = generate(inference.decoder, prompts, Sampling(10), codec.stop_ids)
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    out = reference.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=0
    )
    eos = reference.generation_config.eos_token_id
    for row, tokens in enumerate(out[:, longest:].tolist()):
        assert new[row] == (tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
    assert len({tuple(n) for n in new}) == 3 and len(set(new[0])) > 3  # not one token over and over


def test_chat_prompts_are_rendered_by_the_template(chat_model, tmp_path) -> None:
    from transformers import AutoTokenizer

    from tierzero.run.corpus import TextTokenizer

    codec = Codec(TextTokenizer(chat_model / "tokenizer.json"), 256)
    chat = [{"role": "user", "content": "what is the class"}]
    theirs = AutoTokenizer.from_pretrained(chat_model).apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert codec.encode(Prompt(messages=chat)) == theirs["input_ids"]
    assert codec.encode(Prompt("what is the class"), Framing.CHAT) == theirs["input_ids"]
    assert codec.decode(codec.encode(Prompt("import os"))) == "import os"
    with pytest.raises(DataError, match="chat prompts need an hf: model"):
        Codec(None, 256).encode(Prompt("hello"), Framing.CHAT)


def test_prompt_files(tmp_path) -> None:
    text = tmp_path / "prompts.txt"
    text.write_text("first one\n\nsecond\n")
    assert [p.text for p in read_prompts(text)] == ["first one", "second"]
    records = tmp_path / "prompts.jsonl"
    records.write_text(
        json.dumps({"prompt": "a"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "b"}]})
        + "\n"
    )
    first, second = read_prompts(records)
    assert first.text == "a" and first.record and second.messages[0]["content"] == "b"
    with pytest.raises(DataError, match="does not exist"):
        read_prompts(tmp_path / "missing.txt")
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(DataError, match="holds no prompt"):
        read_prompts(tmp_path / "blank.txt")
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match="line 1 has neither"):
        read_prompts(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("layout", ["root", "prelude"])
def test_other_layouts_generate_transformers_ids_through_the_tiers(layout, tmp_path) -> None:
    """A root unit held for the pass (LLaMA wrapped whole) and GPT-2's position table run in the
    embedding unit (`tierzero.hf.prelude`, fed the decode positions): the same left-padded batch
    as transformers' `generate`, params on NVMe."""
    from transformers import AutoModelForCausalLM

    from tierzero.engine import Engine
    from tierzero.hf import load_model
    from tierzero.hf.adapter import CausalLM

    folder = save_model(
        "llama" if layout == "root" else "gpt2", tmp_path / layout, initializer_range=0.5
    )
    hf = load_model(f"hf:{folder}")
    model = CausalLM(hf.model.hf_model, "model.layers") if layout == "root" else hf.model
    prompts = [[5, 17, 33, 2, 9, 100], [7, 8, 9]]
    config = Config(offload="nvme", nvme_path=[str(tmp_path / "nvme")], dtype="fp32")
    with Engine(model.requires_grad_(False), config, weights=folder) as engine:
        assert (engine.units[0].kind == "root") == (layout == "root")
        new = generate(Decoder.through(engine), prompts, Sampling(8))
        if layout == "prelude":  # GPT-2's table has 128 rows: a longer generation cannot run
            with pytest.raises(ConfigError, match="130 positions, past the 128 .* position table"):
                generate(Decoder.through(engine), [[1] * 120], Sampling(10))
    ids = torch.tensor([[0, 0, 0] * (len(p) == 3) + p for p in prompts])
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    out = reference.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=8,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert out[:, 6:].tolist() == new


def test_samples_rows_follow_the_metrics_rule_on_resume(tmp_path) -> None:
    from tierzero.run.directory import RunDir, read_samples

    streamed = []
    with RunDir(tmp_path / "run") as rundir:
        rundir.stream_samples(lambda step, rows: streamed.append((step, len(rows))))
        for step in (1, 2, 3):
            rundir.log_samples(step, [{"step": step, "prompt": "a", "completion": "b"}] * 2)
    assert [r["step"] for r in read_samples(tmp_path / "run")] == [1, 1, 2, 2, 3, 3]
    assert streamed == [(1, 2), (2, 2), (3, 2)]
    with RunDir(tmp_path / "run") as rundir:
        rundir.open_metrics(2)  # a resume from step 2 redoes step 3
    assert [r["step"] for r in read_samples(tmp_path / "run")] == [1, 1, 2, 2]
    with open(tmp_path / "run" / "samples.jsonl", "a") as f:
        f.write('{"step": 3, "prom')  # torn by a kill
    assert [r["step"] for r in read_samples(tmp_path / "run")] == [1, 1, 2, 2]


def test_plain_prompts_are_framed_as_the_run_trained(tmp_path) -> None:
    """Documents keep the tokenizer's special tokens (here a BOS); a run on prompt/completion
    pairs trained on prompts without them, so its plain prompts get none either."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from tierzero.run.corpus import TextTokenizer
    from tierzero.run.prompts import framing_of

    tokenizer = Tokenizer(models.WordLevel({"[BOS]": 0, "hello": 1, "there": 2}, unk_token="[BOS]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", 0)]
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    codec = Codec(TextTokenizer(tmp_path / "tokenizer.json"), 3)
    assert codec.encode(Prompt("hello there")) == [0, 1, 2]
    assert codec.encode(Prompt("hello there"), Framing.PAIRS) == [1, 2]
    assert codec.encode(Prompt("hello there", record=True)) == [1, 2]
    data = {
        "pairs": {"prompt": "a", "completion": "b"},
        "chat": {"messages": [{"role": "user", "content": "a"}]},
        "text": {"text": "a"},
    }
    for name, record in data.items():
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(record) + "\n")
        assert framing_of(str(tmp_path / f"{name}.jsonl")) is Framing(name)
    assert (
        framing_of(str(tmp_path / "gone.jsonl")) is Framing.TEXT
        and framing_of(None) is Framing.TEXT
    )
