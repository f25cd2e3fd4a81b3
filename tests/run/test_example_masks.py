"""Trained masks under a BPE tokenizer: no reply character is ever taken for context.

A byte-level BPE tokenizer, trained here with the `tokenizers` library (nothing downloaded),
merges the space that ends a generation prompt ("assistant: ", "A: ") into the reply's first
word ("ĠHello"). That token carries a reply character, so it is trained -- transformers'
`return_assistant_tokens_mask` rule; a template that marks replies with `{% generation %}`
gives exactly transformers' mask.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tierzero.run.corpus import TextTokenizer, read_data

EOS = 0
PREFIX = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
GENERATION = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}assistant: {% generation %}"
    "{{ m['content'] }}\n{% endgeneration %}"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
CHATS = [
    [
        {"role": "user", "content": "what is the sky"},
        {"role": "assistant", "content": "Hello there, the sky is blue"},
    ],
    [
        {"role": "system", "content": "Why not"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Sure thing"},
        {"role": "user", "content": "what is blue"},
        {"role": "assistant", "content": "Hello, the sky"},
    ],
]


def bpe_dir(folder, template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = [
        "user: what is the sky\nassistant: Hello there, the sky is blue\n",
        "A: Sure thing. Q: Why not\n",
    ] * 50
    tokenizer.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": template,
                "eos_token": "<eos>",
            }
        )
    )
    return TextTokenizer(folder / "tokenizer.json", eos_id=EOS)


@pytest.fixture(params=["prefix", "generation"])
def chat_model(request, tmp_path) -> TextTokenizer:
    return bpe_dir(tmp_path, PREFIX if request.param == "prefix" else GENERATION)


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_a_space_ending_prompt_trains_the_reply_token_that_holds_the_space(tmp_path) -> None:
    tokenizer = bpe_dir(tmp_path, PREFIX)
    records = [
        {"prompt": "user: what is the sky\nassistant: ", "completion": "Hello there"},
        {"prompt": "A: Sure thing. Q: Why not\nA: ", "completion": "Sure thing"},
    ]
    ids, examples = read_data(write_jsonl(tmp_path / "pairs.jsonl", records), 300, tokenizer)
    own = tokenizer.load()
    for number, record in enumerate(records):
        a, b = examples.bounds[number : number + 2]
        tokens = [own.id_to_token(int(i)) for i in ids[a:b]]
        trained = [t for t, keep in zip(tokens, examples.trained[a:b]) if keep]
        first = "ĠHello" if number == 0 else "ĠSure"
        # the merged space + reply token
        assert first in tokens and trained[0] == first, (
            tokens,
            trained,
        )
        assert (
            own.decode(ids[a:b][examples.trained[a:b] == 1][:-1].tolist())
            == " " + record["completion"]
        )
        assert trained[-1] == "<eos>"


def test_chat_masks_train_every_reply_character(chat_model, tmp_path) -> None:
    ids, examples = read_data(
        write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS]), 300, chat_model
    )
    own = chat_model.load()
    for number, chat in enumerate(CHATS):
        a, b = examples.bounds[number : number + 2]
        chat_ids, mask = ids[a:b], examples.trained[a:b]
        spans = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
        replies = [own.decode(chat_ids[s:e].tolist()) for s, e in zip(spans[::2], spans[1::2])]
        assert [r.strip() for r in replies] == [
            m["content"] for m in chat if m["role"] == "assistant"
        ]
        # the merged space came with the reply's first token
        assert all(r.startswith(" ") for r in replies)


def test_a_generation_template_gives_transformers_assistant_mask(tmp_path) -> None:
    from transformers import AutoTokenizer

    tokenizer = bpe_dir(tmp_path, GENERATION)
    ids, examples = read_data(
        write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS]), 300, tokenizer
    )
    theirs = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for number, chat in enumerate(CHATS):
        out = theirs.apply_chat_template(
            chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        a, b = examples.bounds[number : number + 2]
        assert ids[a:b].tolist() == list(out["input_ids"])
        assert examples.trained[a:b].tolist() == list(out["assistant_masks"])
        assert 0 < sum(out["assistant_masks"]) < len(out["assistant_masks"])
