"""Fine-tuning examples: chats and prompt/completion pairs train on the answer's tokens only.

A word-level tokenizer (every word its own id, so tokens are easy to count) and a small chat
template in `tokenizer_config.json`; records in `.jsonl`, Parquet (pyarrow) and a `datasets`
`save_to_disk` directory give the same ids and trained mask; `TokenBatches` masks the other
targets with -100, and a Hugging Face model's loss is then the mean over trained targets.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.support.hf import save_word_tokenizer
from tierzero.errors import DataError
from tierzero.run.corpus import TextTokenizer, read_data
from tierzero.run.data import TokenBatches

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
WORDS = (
    "user assistant system : . what is two and three five the sky blue why because light "
    "scatters ok"
)
CHATS = [
    [
        {"role": "user", "content": "what is two and three"},
        {"role": "assistant", "content": "five"},
    ],
    [
        {"role": "system", "content": "ok"},
        {"role": "user", "content": "why the sky blue"},
        {"role": "assistant", "content": "because light scatters"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "ok"},
    ],
]
PAIRS = [
    {"prompt": "what is two and three ", "completion": "five"},
    {"prompt": "why the sky ", "completion": "blue"},
]
EOS = 1


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TextTokenizer:
    folder = tmp_path_factory.mktemp("chat-model")
    save_word_tokenizer(folder, WORDS + " " + WORDS, vocab_size=64)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE})
    )
    return TextTokenizer(folder / "tokenizer.json", eos_id=EOS)


def words(tokenizer: TextTokenizer, ids: np.ndarray) -> list[str]:
    own = tokenizer.load()
    return [own.id_to_token(int(i)) for i in ids]


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_chats_train_on_the_assistant_turns_only(tokenizer, tmp_path) -> None:
    ids, examples = read_data(
        write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS]), 64, tokenizer
    )
    trained = examples.trained
    assert len(trained) == len(ids) and list(examples.bounds) == [0, 12, len(ids)]
    assert [w for w, t in zip(words(tokenizer, ids), trained) if t] == [
        "five",
        ".",
        "because",
        "light",
        "scatters",
        ".",
        "ok",
        ".",
    ]
    assert words(tokenizer, ids)[:8] == ["user", ":", "what", "is", "two", "and", "three", "."]


def test_prompt_completion_trains_on_the_completion_and_its_end(tokenizer, tmp_path) -> None:
    ids, examples = read_data(write_jsonl(tmp_path / "pairs.jsonl", PAIRS), 64, tokenizer)
    trained = examples.trained
    assert list(examples.bounds) == [0, 7, 12]
    assert list(ids[trained == 1]) == [
        *tokenizer.load().encode("five").ids,
        EOS,
        *tokenizer.load().encode("blue").ids,
        EOS,
    ]
    assert trained.sum() == 4 and len(ids) == 12  # 6 + 4 words, an end after each


def test_masked_targets_and_the_loss_is_the_mean_over_trained_ones(tokenizer, tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tierzero.hf.build import adapt

    ids, examples = read_data(
        write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS * 20]), 64, tokenizer
    )
    trained = examples.trained
    batches = TokenBatches(ids, batch_size=4, seq_len=8, seed=0, trained=trained)
    x, y = batches.next_batch()
    kept = y != -100
    # every window trains on something
    assert kept.any() and not kept.all() and kept.any(dim=1).all()
    assert set(y[kept].tolist()) <= set(ids[trained == 1].tolist())
    torch.manual_seed(0)
    model = adapt(
        LlamaForCausalLM(
            LlamaConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                vocab_size=64,
            )
        )
    )
    with torch.no_grad():
        logits = model(x)
        expected = F.cross_entropy(logits[kept], y[kept])
        assert torch.allclose(model(x, y), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("form", ["parquet", "save_to_disk"])
def test_parquet_and_save_to_disk_read_as_the_jsonl(form, tokenizer, tmp_path) -> None:
    pa = pytest.importorskip(
        "pyarrow", reason="Parquet and save_to_disk data need pyarrow (tierzero[data])"
    )
    records = [{"messages": c} for c in CHATS] + [{"messages": CHATS[0]}]
    if form == "parquet":
        import pyarrow.parquet as pq

        path = tmp_path / "chat.parquet"
        # read back batch by batch
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=2)
    else:
        datasets = pytest.importorskip(
            "datasets", reason="writing a save_to_disk directory needs datasets"
        )
        path = tmp_path / "saved"
        datasets.Dataset.from_list(records).save_to_disk(str(path))
    expected = read_data(write_jsonl(tmp_path / "chat.jsonl", records), 64, tokenizer)
    got = read_data(str(path), 64, tokenizer)
    assert np.array_equal(got[0], expected[0]) and np.array_equal(
        got[1].trained, expected[1].trained
    )
    assert np.array_equal(got[1].bounds, expected[1].bounds)


def test_refusals(tokenizer, tmp_path) -> None:
    chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHATS[0]}])
    with pytest.raises(DataError, match="need the model's tokenizer.json"):
        read_data(chats, 256, None)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tokenizer.path, bare / "tokenizer.json")
    with pytest.raises(DataError, match="has no chat template"):
        read_data(chats, 64, TextTokenizer(bare / "tokenizer.json", EOS))
    with pytest.raises(DataError, match="'prompt' and 'completion' must both be strings"):
        read_data(
            write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "what", "completion": 3}]),
            64,
            tokenizer,
        )
    ids, examples = read_data(write_jsonl(tmp_path / "pairs.jsonl", PAIRS), 64, tokenizer)
    with pytest.raises(DataError, match="no window of 3 tokens .* has a completion"):
        TokenBatches(ids, 1, 2, seed=0, trained=np.zeros_like(examples.trained), val_fraction=0.0)


@pytest.mark.parametrize("form", ["pairs", "chats"])
def test_micro_batch_1_trains_and_long_examples_are_counted(form, hf_models, tmp_path) -> None:
    """One row per micro-batch (its targets masked, its inputs intact), and the run says how many
    examples were longer than a window and what --long-examples did with them."""
    from tierzero.cli.app import app
    from typer.testing import CliRunner

    from tierzero.run.directory import read_metrics

    model = tmp_path / "model"
    shutil.copytree(hf_models["llama"], model)
    (model / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE})
    )
    text = "def return import class for in if else while with as from".split()
    long = {"prompt": " ".join(text * 3) + " ", "completion": " ".join(text[:5])}
    if form == "pairs":
        records = [
            {
                "prompt": " ".join(text[i % 7 : i % 7 + 4]) + " ",
                "completion": " ".join(text[i % 5 : i % 5 + 3]),
            }
            for i in range(60)
        ] + [long]
    else:
        records = [
            {
                "messages": [
                    {"role": "user", "content": " ".join(text[i % 7 : i % 7 + 4])},
                    {"role": "assistant", "content": " ".join(text[i % 5 : i % 5 + 3])},
                ]
            }
            for i in range(60)
        ] + [
            {
                "messages": [
                    {"role": "user", "content": long["prompt"]},
                    {"role": "assistant", "content": long["completion"]},
                ]
            }
        ]
    data = write_jsonl(tmp_path / "data.jsonl", records)
    for policy in ("truncate", "drop"):
        run_dir = tmp_path / policy
        result = CliRunner().invoke(
            app,
            [
                "train",
                "--model",
                f"hf:{model}",
                "--data",
                data,
                "--steps",
                "3",
                "--batch-size",
                "1",
                "--accumulate",
                "2",
                "--seq-len",
                "16",
                "--long-examples",
                policy,
                "--offload",
                "host",
                "--dtype",
                "fp32",
                "--run-dir",
                str(run_dir),
                "--json",
            ],
        )
        assert result.exit_code == 0, result.output
        assert "1 of 61 examples are longer than --seq-len 16 allows" in result.output
        assert json.loads(result.stdout[result.stdout.index("{") :])["long_examples"] == {
            "policy": policy,
            "examples": 61,
            "touched": 1,
        }
        assert all(np.isfinite(r["loss"]) for r in read_metrics(run_dir) if "loss" in r)


def test_train_on_prompt_completion_records_from_the_cli(hf_models, tmp_path) -> None:
    """The run's batches mask the prompts: its losses are those of the completions only."""
    from tierzero.cli.app import app
    from typer.testing import CliRunner

    from tierzero.run.directory import read_metrics

    text = "def return import class for in if else while with as from".split()
    records = [
        {
            "prompt": " ".join(text[i % 7 : i % 7 + 4]) + " ",
            "completion": " ".join(text[i % 5 : i % 5 + 3]),
        }
        for i in range(200)
    ]
    data = write_jsonl(tmp_path / "pairs.jsonl", records)
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--model",
            f"hf:{hf_models['llama']}",
            "--data",
            data,
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--offload",
            "host",
            "--dtype",
            "fp32",
            "--run-dir",
            str(tmp_path / "run"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert all(np.isfinite(r["loss"]) for r in read_metrics(tmp_path / "run") if "loss" in r)
