"""A training run as the CLI drives it: session, loop, data, corpus, run directory, charts (the
report's PNG), overlap (its link busy-time table); generation from the tiered weights
(generate, prompts, inference, samples)."""
