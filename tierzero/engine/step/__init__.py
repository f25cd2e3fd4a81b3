"""The optimizer step: grad shards, the sharded optimizer, kept generations, param steps and sync,
backward facts, step state."""
