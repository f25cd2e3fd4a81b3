"""`tierzero generate` and `train --sample-prompts` through typer's runner.

A small saved LLaMA with a word-level tokenizer and a chat template: generating from its
directory (`--model hf:DIR`) and from a short tiered run on its chat data (`--run-dir`, the
chat template applied because the run trained on chats) gives transformers' own
`generate(do_sample=False)` ids, on the directory and on the run's exported checkpoint; a LoRA
run generates with base + adapters, as peft's model of its exported adapter does. A built-in
run's samples at its last step are what `generate` then makes from its checkpoint. Bad input
is one line and exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tierzero.cli.app import app
from typer.testing import CliRunner

from tests.support.cli import one_line_error
from tests.support.hf import sample_text, save_chat_llama
from tierzero.run.directory import read_samples

runner = CliRunner()
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
WORDS = "def return import class for in if else while with as from".split()
TRAIN = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--dtype", "fp32", "--json"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_chat_llama(
        tmp_path_factory.mktemp("gen") / "llama", sample_text(), TEMPLATE, "[UNK]"
    )


def generate(*args: str) -> dict:
    result = runner.invoke(app, ["generate", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{") :])


def transformers_ids(model_dir, prompt_ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    # the mask given: transformers takes a 0 in the prompt for padding
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, pad_token_id=0
    )
    return out[0, len(prompt_ids) :].tolist()


def test_a_model_directory_generates_transformers_greedy_ids(model_dir) -> None:
    out = generate(
        "--model",
        f"hf:{model_dir}",
        "--prompt",
        "the class of this module is",
        "--prompt",
        "import",
        "--max-new-tokens",
        "8",
        "--offload",
        "nvme",
        "--dtype",
        "fp32",
    )
    assert out["step"] is None and len(out["generations"]) == 2
    # 2 rows x 2 layers x keys and values x 2 kv heads x 16 dims x 4 bytes, per position held
    # the last new token is not fed back
    passes = max(len(g["new_ids"]) for g in out["generations"])
    positions = max(len(g["prompt_ids"]) for g in out["generations"]) + passes - 1
    assert out["kv_cache_bytes"] == 2 * 2 * 2 * 2 * 16 * 4 * positions
    for g in out["generations"]:
        assert g["new_ids"] == transformers_ids(model_dir, g["prompt_ids"], 8)[: len(g["new_ids"])]
        # eight, or stopped at the model's eos (2)
        assert len(g["new_ids"]) == 8 or g["new_ids"][-1] == 2
        assert g["text"] and isinstance(g["text"], str)


def chat_records(path: Path) -> Path:
    """40 chats of one user turn and one assistant reply in the model's words, as --data takes
    them."""
    with path.open("w") as f:
        for i in range(40):
            messages = [
                {"role": "user", "content": " ".join(WORDS[i % 7 : i % 7 + 3])},
                {"role": "assistant", "content": " ".join(WORDS[i % 5 : i % 5 + 2])},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def test_a_chat_run_samples_and_generates_from_its_checkpoint(model_dir, tmp_path) -> None:
    """Trained on chat records, tiered to NVMe; samples at steps 1 and 2 use the chat template, and
    `generate --run-dir` (chat by default) gives transformers' ids on the exported checkpoint."""
    data = chat_records(tmp_path / "chats.jsonl")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def return\nclass for in\n")
    run_dir = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "train",
            "--model",
            f"hf:{model_dir}",
            "--data",
            str(data),
            *TRAIN,
            "--offload",
            "nvme",
            "--lr",
            "1e-2",
            "--run-dir",
            str(run_dir),
            "--sample-prompts",
            str(prompts),
            "--sample-every",
            "1",
            "--sample-max-new-tokens",
            "6",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = read_samples(run_dir)
    assert [(r["step"], r["prompt"]) for r in rows] == [
        (1, "def return"),
        (1, "class for in"),
        (2, "def return"),
        (2, "class for in"),
    ]
    from transformers import AutoTokenizer

    chat = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        [{"role": "user", "content": "def return"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    assert rows[0]["prompt_ids"] == chat["input_ids"]

    out = generate(
        "--run-dir",
        str(run_dir),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "6",
        "--offload",
        "nvme",
    )
    assert out["step"] == 2 and [g["prompt_ids"] for g in out["generations"]] == [
        r["prompt_ids"] for r in rows[2:]
    ]
    assert [g["new_ids"] for g in out["generations"]] == [r["completion_ids"] for r in rows[2:]]
    exported = tmp_path / "exported"
    assert runner.invoke(app, ["export", str(run_dir), "--out", str(exported)]).exit_code == 0
    for g in out["generations"]:
        assert g["new_ids"] == transformers_ids(exported, g["prompt_ids"], 6)[: len(g["new_ids"])]
    plain = generate(
        "--run-dir", str(run_dir), "--prompt", "def return", "--no-chat", "--max-new-tokens", "2"
    )
    assert plain["generations"][0]["prompt_ids"] != rows[0]["prompt_ids"]


def test_a_lora_run_generates_with_its_adapters(model_dir, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    text = tmp_path / "text.txt"
    text.write_text(" ".join(WORDS * 40))
    run_dir = tmp_path / "lora"
    result = runner.invoke(
        app,
        [
            "train",
            "--model",
            f"hf:{model_dir}",
            "--data",
            str(text),
            *TRAIN,
            "--lr",
            "5e-2",
            "--lora-r",
            "4",
            "--lora-targets",
            "q_proj,v_proj",
            "--offload",
            "host",
            "--run-dir",
            str(run_dir),
        ],
    )
    assert result.exit_code == 0, result.output
    out = generate(
        "--run-dir", str(run_dir), "--prompt", "class for in if", "--max-new-tokens", "6"
    )
    g = out["generations"][0]
    adapter = tmp_path / "adapter"
    assert runner.invoke(app, ["export", str(run_dir), "--out", str(adapter)]).exit_code == 0
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir), adapter
    ).eval()
    prompt = torch.tensor([g["prompt_ids"]])
    ids = peft.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=6,
        pad_token_id=0,
    )
    assert g["new_ids"] == ids[0, len(g["prompt_ids"]) :].tolist()[: len(g["new_ids"])]


def test_a_built_in_runs_last_samples_are_what_generate_makes(tmp_path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "def main("}) + "\n" + json.dumps({"prompt": "import"}) + "\n"
    )
    run_dir = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "train",
            "--steps",
            "3",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--offload",
            "nvme",
            "--dtype",
            "fp32",
            "--run-dir",
            str(run_dir),
            "--sample-prompts",
            str(prompts),
            "--sample-max-new-tokens",
            "5",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = read_samples(run_dir)
    assert [r["step"] for r in rows] == [3, 3]  # no --sample-every: at the end only
    out = generate("--run-dir", str(run_dir), "--prompts", str(prompts), "--max-new-tokens", "5")
    assert [g["new_ids"] for g in out["generations"]] == [r["completion_ids"] for r in rows]
    assert out["generations"][0]["prompt_ids"] == list(b"def main(")


def test_bad_generate_input_is_one_line(tmp_path) -> None:
    run_dir = tmp_path / "in-memory"
    quick = tmp_path / "quick.toml"
    quick.write_text("eval_tokens = 64\n")  # a run in memory keeps no checkpoint
    result = runner.invoke(
        app,
        [
            "train",
            "--config",
            str(quick),
            "--steps",
            "1",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--offload",
            "none",
            "--run-dir",
            str(run_dir),
        ],
    )
    assert result.exit_code == 0, result.output

    def refused(*args: str) -> str:
        return one_line_error(runner.invoke(app, ["generate", *args]))

    assert "no complete checkpoint yet; train with --checkpoint-every" in refused(
        "--run-dir", str(run_dir), "--prompt", "x"
    )
    some = ["--run-dir", str(run_dir)]
    assert "--max-new-tokens must be an integer >= 1" in refused(
        *some, "--prompt", "x", "--max-new-tokens", "0"
    )
    assert "--top-p must be in (0, 1]" in refused(*some, "--prompt", "x", "--top-p", "1.5")
    assert "--top-p must be in (0, 1]" in refused(*some, "--prompt", "x", "--top-p", "0")
    assert "--temperature must be a finite number >= 0" in refused(
        *some, "--prompt", "x", "--temperature", "-1"
    )
    assert "prompts file" in refused(*some, "--prompts", str(tmp_path / "missing.txt"))
    assert "no prompt was given" in refused(*some)
    assert "pass --model hf:DIR or --run-dir DIR" in refused("--prompt", "x")
    assert "does not exist" in refused("--run-dir", str(tmp_path / "nowhere"), "--prompt", "x")
    assert "is not a device" in refused(*some, "--prompt", "x", "--device", "tpu7")
    if not torch.cuda.is_available():
        assert "needs a GPU this torch can see" in refused(
            *some, "--prompt", "x", "--device", "cuda"
        )
    assert "is not hf:DIR" in refused("--model", "tiny", "--prompt", "x")


def test_bad_sample_flags_of_train_are_one_line(tmp_path) -> None:
    assert "must be an integer >= 1" in one_line_error(
        runner.invoke(
            app,
            [
                "train",
                "--run-dir",
                str(tmp_path / "other"),
                "--sample-prompts",
                str(tmp_path / "p.txt"),
                "--sample-every",
                "0",
            ],
        )
    )
    assert "prompts file" in one_line_error(
        runner.invoke(
            app,
            [
                "train",
                "--steps",
                "1",
                "--offload",
                "none",
                "--run-dir",
                str(tmp_path / "third"),
                "--sample-prompts",
                str(tmp_path / "missing.txt"),
            ],
        )
    )
    (tmp_path / "long.txt").write_text("x" * 500 + "\n")
    assert "past tiny's max_seq_len 512" in one_line_error(
        runner.invoke(
            app,
            [
                "train",
                "--steps",
                "1",
                "--offload",
                "none",
                "--run-dir",
                str(tmp_path / "fourth"),
                "--sample-prompts",
                str(tmp_path / "long.txt"),
                "--sample-max-new-tokens",
                "20",
            ],
        )
    )


def test_an_empty_prompt_is_refused(model_dir) -> None:
    """Before the weights are read."""
    line = one_line_error(
        runner.invoke(
            app, ["generate", "--model", f"hf:{model_dir}", "--prompt", "hi", "--prompt", ""]
        )
    )
    assert "a --prompt is empty" in line
