"""Tiers and bytes: stores, pools and the I/O loop. Knows nothing of models, autograd or ranks."""
