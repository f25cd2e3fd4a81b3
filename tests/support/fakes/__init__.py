"""Stand-ins for what a CPU-only run lacks: the GPU's streams (`streams`, `comm`) and the CUDA
runtime's pinning (`pinning`). Production code knows nothing of them: tests patch them in."""
