"""Checkpoints on disk: manifests, finding, verifying and pruning them, inspection and export."""
