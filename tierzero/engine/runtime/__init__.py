"""The engine's runtime: tiers and streams, the swap scheduler, batch staging, shards, unit execution, transfer stats."""
