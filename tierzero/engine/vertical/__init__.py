"""The vertical (layer-major) accumulation schedule: its steps, the chain models it drives, waiting
activations."""
