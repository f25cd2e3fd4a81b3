"""Fine-tuning data: text files, folders, .jsonl records and token files, tokenized by a model's
own tokenizer.json or read as bytes, every id checked against the vocabulary by file name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.hf import save_word_tokenizer
from tierzero.errors import DataError
from tierzero.run.corpus import TextTokenizer, read_corpus

DOCS = ["the cat sat on the mat", "a dog ran in the park", "the cat ran"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TextTokenizer:
    path = save_word_tokenizer(tmp_path_factory.mktemp("tok"), " ".join(DOCS), vocab_size=50)
    return TextTokenizer(path, eos_id=0)


def expected_ids(tokenizer: TextTokenizer, docs: list[str]) -> list[int]:
    from tokenizers import Tokenizer

    own = Tokenizer.from_file(str(tokenizer.path))
    return [i for doc in docs for i in [*own.encode(doc).ids, 0]]


def test_jsonl_records_are_documents(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(DOCS)) + "\n\n"
    )
    tokens = read_corpus(str(path), 256, tokenizer, text_field="body")
    assert tokens.tolist() == expected_ids(tokenizer, DOCS) and tokens.dtype == np.uint16
    with pytest.raises(
        DataError, match=r"train.jsonl line 1 has no string field 'text'; .*--text-field"
    ):
        read_corpus(str(path), 256, tokenizer)
    path.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match="line 2 is not JSON"):
        read_corpus(str(path), 256, tokenizer)


def test_a_folder_of_text_files_in_name_order(tmp_path, tokenizer):
    for name, doc in zip(["b.txt", "a.md", "sub/c.txt"], DOCS):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(doc)
    (tmp_path / ".hidden").write_text("skipped")
    assert read_corpus(str(tmp_path), 256, tokenizer).tolist() == expected_ids(
        tokenizer, [DOCS[1], DOCS[0], DOCS[2]]
    )
    assert (
        read_corpus(str(tmp_path), 256).tobytes() == "\n".join([DOCS[1], DOCS[0], DOCS[2]]).encode()
    )


def test_text_without_a_tokenizer_is_bytes(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("héllo")
    assert read_corpus(str(path), 256).tobytes() == "héllo".encode()
    with pytest.raises(
        DataError,
        match=r"a.txt' read as bytes has token id 255, beyond the model's vocabulary of 100",
    ):
        read_corpus(str(path), 100)


def test_token_ids_beyond_the_vocabulary_name_the_file(tmp_path, tokenizer):
    path = tmp_path / "ids.npy"
    np.save(path, np.array([1, 2, 70000], dtype=np.uint32))
    assert read_corpus(str(path), 70001).tolist() == [1, 2, 70000]
    with pytest.raises(
        DataError,
        match=r"ids.npy' stored has token id 70000, beyond the model's vocabulary of 32000",
    ):
        read_corpus(str(path), 32000)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(DOCS))
    with pytest.raises(
        DataError, match=r"t.txt' tokenized by .*tokenizer.json has token id \d+, beyond .* of 5;"
    ):
        read_corpus(str(text), 5, tokenizer)


def test_missing_and_mixed_data_are_one_sentence(tmp_path, tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        read_corpus(str(tmp_path / "nope.jsonl"), 256, tokenizer)
    (tmp_path / "ids.bin").write_bytes(b"\0\0")
    with pytest.raises(DataError, match="holds token file ids.bin"):
        read_corpus(str(tmp_path), 256)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(
        DataError, match="tokenizer.json is not a tokenizer the tokenizers library reads"
    ):
        read_corpus(str(tmp_path / "a.txt"), 256, TextTokenizer(tmp_path / "tokenizer.json"))
