"""Compact optimizer state: bf16 master weights, bf16 or blockwise int8 Adam moments.

`formats` says how a piece of each state kind is stored (its dtype, bytes and layout), `codes`
quantises moments, `step` steps a compact piece in fp32 sub-blocks. The engine's optimizer
uses them only where `Config.optimizer_state` or `Config.master` is not fp32; fp32 state
stays torch's AdamW, bitwise.
"""
