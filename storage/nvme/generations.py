"""A shard's generations on disk: the pointer that names the current one, and what a killed
writer left.

Each write of a shard fills a new generation directory (`g000017/`); the shard's group
zarr.json (the *pointer*) names the current one, and replacing the pointer with one rename is
the write's commit point (`NvmeStore`). This module owns those names: the generation names,
reading a pointer back, and removing what a killed writer left. Small files are written by
`storage.durable.write_atomic`; the commit pointer skips its directory fsync (`durable=False`):
that rename becomes durable at the store's next `flush()`, one syncfs with the chunk renames it
depends on -- exactly the power-loss guarantee `NvmeStore` documents. It never moves chunk bytes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass

from tierzero.storage.base import StorageCorruptError
from tierzero.storage.durable import TMP_SUFFIX
from tierzero.storage.filekind import open_regular
from tierzero.storage.nvme.spares import SPARE_DIR
from tierzero.storage.nvme.zarrmeta import ShardMeta

_TMP_NAME = re.compile(r"\..+\.\d+-\d+" + re.escape(TMP_SUFFIX))
GEN_NAME = re.compile(r"g(\d{6,})")


@dataclass
class Current:
    """A shard's current generation and its metadata (cached per key by `NvmeStore`)."""

    gen: int
    meta: ShardMeta


def gen_name(gen: int) -> str:
    return f"g{gen:06d}"


def pointer_json(gen: int) -> bytes:
    """The group zarr.json of a shard whose current generation is `gen`."""
    return json.dumps(
        {
            "attributes": {"tierzero": {"current": gen_name(gen)}},
            "zarr_format": 3,
            "node_type": "group",
        }
    ).encode()


def read_pointer(shard_dir: str) -> tuple[int, ShardMeta] | None:
    """The current generation of the shard in `shard_dir` and its array metadata; None when
    the shard has no pointer (it was never written)."""
    pointer = os.path.join(shard_dir, "zarr.json")
    try:
        doc = json.loads(_read_small(pointer))
        match = GEN_NAME.fullmatch(doc["attributes"]["tierzero"]["current"])
        if match is None:
            raise ValueError("no generation name")
    except FileNotFoundError:
        return None
    except OSError as e:  # a FIFO or device where the pointer belongs
        raise StorageCorruptError(
            f"{pointer} {e.strerror}: delete the shard or restore it from a checkpoint"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise StorageCorruptError(
            f"{pointer} does not name a current generation ({e!r}): "
            f"delete the shard or restore it from a checkpoint"
        ) from e
    gen = int(match.group(1))
    array_json = os.path.join(shard_dir, gen_name(gen), "zarr.json")
    try:
        meta = ShardMeta.from_zarr_json(_read_small(array_json), array_json)
    except FileNotFoundError:
        raise StorageCorruptError(
            f"{array_json} is missing: the shard's current generation "
            f"is gone; restore it from a checkpoint"
        ) from None
    except OSError as e:
        raise StorageCorruptError(
            f"{array_json} {e.strerror}: restore the shard from a checkpoint"
        ) from None
    if len(meta.crcs) != meta.nchunks:
        raise StorageCorruptError(
            f"{array_json} records {len(meta.crcs)} checksums for "
            f"{meta.nchunks} chunks: restore the shard from a checkpoint"
        )
    return gen, meta


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_orphans(root: str, foreign: Callable[[str], bool]) -> None:
    """Remove what a killed writer left (the caller holds the directory lock): temp files, and
    generation directories that their shard's pointer does not name. Only under `root`, and
    never in a directory that `foreign` says is another store's."""
    for dirpath, dirnames, names in os.walk(root):
        if dirpath == root:
            dirnames[:] = [d for d in dirnames if d != SPARE_DIR]
        dirnames[:] = [d for d in dirnames if not foreign(os.path.join(dirpath, d))]
        for name in names:
            if _TMP_NAME.fullmatch(name):
                unlink(os.path.join(dirpath, name))
        gens = [d for d in dirnames if GEN_NAME.fullmatch(d)]
        if not gens:
            continue
        current = _current_name(os.path.join(dirpath, "zarr.json"))
        for d in gens:
            if current is not None and d != current:  # an unreadable pointer: keep everything
                shutil.rmtree(os.path.join(dirpath, d), ignore_errors=True)
        dirnames[:] = [d for d in dirnames if d not in gens]  # never walk the chunk directories


def _current_name(pointer: str) -> str | None:
    try:
        return json.loads(_read_small(pointer))["attributes"]["tierzero"]["current"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_small(path: str) -> bytes:
    """A pointer or array zarr.json; a FIFO or device there is an OSError, never a hang."""
    with os.fdopen(open_regular(path), "rb") as f:
        return f.read()
