"""The engine's runtime: tiers and streams, the swap runner, batch staging, shards, unit execution,
transfer stats."""
