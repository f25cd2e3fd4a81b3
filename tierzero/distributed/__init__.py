"""Several ranks: collectives over torch.distributed and the process launcher."""
