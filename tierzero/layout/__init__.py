"""How a model is cut up for storage: units, flat buffers, shards, pieces and their store keys."""
