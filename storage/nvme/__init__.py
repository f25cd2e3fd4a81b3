"""The NVMe store and its internals: `NvmeStore` (store), a shard's generations and commit
pointer, chunk files and their jobs, spare files, the directory lock and zarr metadata, and
frozen arrays (the checkpoint's copies)."""

from tierzero.storage.nvme.store import NvmeStore

__all__ = ["NvmeStore"]
