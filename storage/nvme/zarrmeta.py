"""The zarr v3 metadata of the NVMe store: group nodes, and one `ShardMeta` per shard array.

A shard is a 1-D array with the plain little-endian `bytes` codec, so its chunk files are the
raw bytes. zarr has no bfloat16, so bf16 shards are `uint16` arrays; the true dtype and one
crc32c per chunk (of the chunk's data bytes, padding excluded) sit in the array's attributes
under "tierzero", with the `layout` of an array that packs several (a quantised Adam moment:
its scales, then its codes) where its writer describes one. This module builds and parses the
JSON; it never touches files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from tierzero.storage.base import DTYPES, StorageCorruptError, dtype_name

GROUP_JSON = json.dumps({"attributes": {}, "zarr_format": 3, "node_type": "group"}).encode()
# zarr's name for each shard dtype; bf16 has none, so its 16-bit pattern is stored as uint16.
_ZARR_DTYPE = {
    "bfloat16": "uint16",
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "bool": "bool",
}


@dataclass
class ShardMeta:
    """What the array's zarr.json says about one shard, cached after the first look."""

    dtype: torch.dtype
    numel: int
    chunk_bytes: int
    crcs: list[int]
    layout: dict | None = None  # what the bytes pack, as the writer describes it (JSON)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def nchunks(self) -> int:
        return nchunks(self.nbytes, self.chunk_bytes)

    def to_zarr_json(self) -> bytes:
        name = dtype_name(self.dtype)
        itemsize = self.dtype.itemsize
        return json.dumps(
            {
                "shape": [self.numel],
                "data_type": _ZARR_DTYPE[name],
                "chunk_grid": {
                    "name": "regular",
                    "configuration": {"chunk_shape": [self.chunk_bytes // itemsize]},
                },
                "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
                "fill_value": False if name == "bool" else 0,
                "codecs": [
                    {"name": "bytes"}
                    if itemsize == 1
                    else {"name": "bytes", "configuration": {"endian": "little"}}
                ],
                "attributes": {
                    "tierzero": {
                        "dtype": name,
                        "crc32c": self.crcs,
                        **({"layout": self.layout} if self.layout is not None else {}),
                    }
                },
                "zarr_format": 3,
                "node_type": "array",
                "storage_transformers": [],
            }
        ).encode()

    def to_dict(self) -> dict:
        """The JSON form a checkpoint manifest records per array."""
        return {
            "dtype": dtype_name(self.dtype),
            "numel": self.numel,
            "chunk_bytes": self.chunk_bytes,
            "crc32c": list(self.crcs),
        }

    @classmethod
    def from_dict(cls, doc: dict, where: str) -> ShardMeta:
        try:
            meta = cls(
                DTYPES[doc["dtype"]],
                int(doc["numel"]),
                int(doc["chunk_bytes"]),
                [int(c) for c in doc["crc32c"]],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise StorageCorruptError(
                f"{where} has a malformed array entry ({e!r}): the "
                f"checkpoint is damaged; use another one"
            ) from e
        if len(meta.crcs) != meta.nchunks:
            raise StorageCorruptError(
                f"{where} records {len(meta.crcs)} checksums for "
                f"{meta.nchunks} chunks: the checkpoint is damaged"
            )
        return meta

    @classmethod
    def from_zarr_json(cls, raw: bytes, where: str) -> ShardMeta:
        try:
            doc = json.loads(raw)
            attrs = doc["attributes"]["tierzero"]
            dtype = DTYPES[attrs["dtype"]]
            chunk_elems = doc["chunk_grid"]["configuration"]["chunk_shape"][0]
            return cls(
                dtype,
                doc["shape"][0],
                chunk_elems * dtype.itemsize,
                [int(c) for c in attrs["crc32c"]],
                attrs.get("layout"),
            )
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise StorageCorruptError(
                f"{where} is not a tierzero shard's zarr.json ({e!r}): "
                f"delete the array or restore it from a checkpoint"
            ) from e


def nchunks(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes)
