"""The files an export of a Hugging Face model writes beside its weights: the model's
`config.json` as the checkpoint recorded it (its dtype set to the export's), and the tokenizer
files of the directory the run started from, so the directory loads with `from_pretrained` and
`AutoTokenizer`. Each is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tierzero.checkpoint.manifest import Manifest
from tierzero.errors import TierzeroError

# what AutoTokenizer.from_pretrained reads from a model directory (whichever the model has)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def hf_config(manifest: Manifest, dtype: str) -> tuple[str, dict] | None:
    """The Hugging Face model's config.json, as the checkpoint recorded it, with this export's
    dtype (from_pretrained would otherwise cast to the dtype it was saved in); None for others."""
    config = (manifest.origin.model or {}).get("config")
    if not isinstance(config, dict):
        return None
    name = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    return "config.json", {
        **config,
        "dtype": name,
        **({"torch_dtype": name} if "torch_dtype" in config else {}),
    }


def write_json(out_dir: Path, name: str, doc: dict) -> Path:
    path = out_dir / name
    temp = out_dir / f".{name}.{os.getpid()}.tmp"
    try:
        with open(temp, "w") as handle:
            handle.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except OSError as e:
        temp.unlink(missing_ok=True)
        raise TierzeroError(
            f"cannot write {path} ({e.strerror or e}); choose a writable --out"
        ) from None
    return path


def copy_tokenizer(out_dir: Path, manifest: Manifest) -> list[Path]:
    """The tokenizer files of the Hugging Face directory the run started from, copied beside the
    weights (each through a temp name), so the export loads with AutoTokenizer too; none when
    that directory is gone or the model is not from one."""
    source = (manifest.origin.model or {}).get("hf")
    if (
        not isinstance(source, str)
        or not Path(source).is_dir()
        or Path(source).resolve() == out_dir.resolve()
    ):
        return []
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(source) / name
        if not src.is_file():
            continue
        temp = out_dir / f".{name}.{os.getpid()}.tmp"
        try:
            shutil.copyfile(src, temp)
            os.replace(temp, out_dir / name)
        except OSError as e:
            temp.unlink(missing_ok=True)
            raise TierzeroError(
                f"cannot copy {src} to {out_dir} ({e.strerror or e}); choose a writable --out"
            ) from None
        copied.append(out_dir / name)
    return copied
