"""The `TierStore` protocol every tier implements, its capability flags, and storage's errors.

A store is a handful of async primitives over named shards (`write`, `read_into`, `exists`,
`delete`, `flush`), in the manner of zarr-python's `abc.Store`. A shard is the bytes of one
contiguous 1-D tensor plus its dtype and numel; the caller owns the buffers, so a read lands
in a buffer the caller chose (pinned, aligned) instead of a fresh allocation.

Keys name a shard as `state kind / unit / rank`, e.g. ``"master/u0003/r0"``: '/'-separated
parts of ``[a-z0-9_]``. Stores never interpret the parts.
"""

from __future__ import annotations

import abc
import errno
import re
from dataclasses import dataclass
from types import TracebackType
from typing import ClassVar

import torch


class StorageError(Exception):
    """Base of every error a store or pool raises on purpose; the message names the fix."""


class StorageFullError(StorageError):
    """The device ran out of space while writing; the previous version of the shard is intact."""


class StorageCorruptError(StorageError):
    """A stored chunk does not match its checksum or its recorded size."""


class BudgetExceededError(StorageError):
    """A pool was asked for more bytes than its budget allows, even after evicting its cache."""


class StoreLockedError(StorageError):
    """Another process or store instance holds the directory's lock."""


class ShardNotFoundError(StorageError):
    """No shard is stored under the key."""


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)


def os_error(e: OSError, doing: str, path: str) -> StorageError:
    """An OSError met while `doing` ("writing", "linking") `path`, as one sentence naming the
    fix: ENOSPC is a `StorageFullError`; anything else (EACCES, EIO, ...) a `StorageError`."""
    where = "point --nvme-path/--run-dir at"
    if e.errno in _NO_SPACE:
        return StorageFullError(
            f"no space left on device {doing} {path}; free space or {where} a larger filesystem"
        )
    if e.errno in _NO_PERMISSION:
        return StorageError(
            f"permission denied {doing} {path} ({e.strerror}); make it writable "
            f"or {where} a writable filesystem"
        )
    return StorageError(
        f"{doing} {path} failed ({e.strerror or e}); check the drive (dmesg) or "
        f"{where} another filesystem"
    )


@dataclass(frozen=True)
class Capabilities:
    """What a tier can promise. `zero_copy`: `view(key)` returns the resident tensor."""

    persistent: bool
    direct_io: bool
    zero_copy: bool


_KEY = re.compile(r"[a-z0-9_]+(/[a-z0-9_]+)*")

# Every dtype a shard may hold, by its torch name; stores record this name, never a pickle.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}


# Direct I/O needs 4 KiB-aligned offsets, sizes and buffer addresses (it covers every logical
# block size in use); every shard, chunk, piece and pool block is sized and placed to it.
ALIGN_BYTES = 4096


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor whose data starts on a 4 KiB boundary, so the NVMe store can use direct I/O."""
    pad = ALIGN_BYTES // dtype.itemsize
    raw = torch.empty(numel + pad, dtype=dtype)
    skip = (-raw.data_ptr() % ALIGN_BYTES) // dtype.itemsize
    return raw[skip : skip + numel]


def check_key(key: str) -> str:
    """Return `key` if it is '/'-separated parts of [a-z0-9_]; raise a clear error otherwise."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise StorageError(
            f"invalid shard key {key!r}: use '/'-separated parts of [a-z0-9_], "
            f"e.g. 'master/u0003/r0'"
        )
    return key


def dtype_name(dtype: torch.dtype) -> str:
    """The recorded name of a shard dtype; unsupported dtypes are refused by name."""
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) is not dtype:
        raise StorageError(f"dtype {dtype} cannot be stored: use one of {', '.join(DTYPES)}")
    return name


def check_flat(t: torch.Tensor, what: str, key: str) -> None:
    """Refuse tensors a store cannot move as one run of bytes."""
    if t.dim() != 1 or not t.is_contiguous():
        raise StorageError(
            f"{what} for shard {key!r} must be a contiguous 1-D tensor, got shape "
            f"{tuple(t.shape)} (contiguous={t.is_contiguous()}): pass "
            f"t.contiguous().view(-1)"
        )


def check_out(key: str, out: torch.Tensor, dtype: torch.dtype, numel: int) -> None:
    """Refuse an output buffer whose dtype or length differs from what was written."""
    check_flat(out, "out", key)
    if out.dtype != dtype or out.numel() != numel:
        raise StorageError(
            f"shard {key!r} holds {numel} x {dtype_name(dtype)} but out is "
            f"{out.numel()} x {out.dtype}: allocate out with the written dtype "
            f"and numel"
        )


class TierStore(abc.ABC):
    """One tier's shard store. Constructors do no I/O; `open()` acquires, `close()` releases."""

    tier: ClassVar[str]

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this store promises; `direct_io` may depend on the filesystem found at open()."""

    @abc.abstractmethod
    def open(self) -> None:
        """Acquire what the store needs (locks, directories, buffers)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything `open()` acquired; idempotent."""

    def __enter__(self) -> TierStore:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @abc.abstractmethod
    async def write(self, key: str, src: torch.Tensor) -> None:
        """Store the bytes, dtype and numel of the contiguous 1-D tensor `src` under `key`."""

    @abc.abstractmethod
    async def read_into(self, key: str, out: torch.Tensor, verify: bool = False) -> None:
        """Fill `out` (same dtype and numel as written) with the shard; `verify` checks
        checksums where the store keeps them."""

    @abc.abstractmethod
    async def exists(self, key: str) -> bool:
        """Whether a shard is stored under `key`."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove the shard under `key`; deleting a missing key is a no-op."""

    @abc.abstractmethod
    async def flush(self) -> None:
        """Make every completed write durable on this tier (a no-op for memory tiers)."""
