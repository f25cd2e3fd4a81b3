"""The benchmarks' logic: the GPU benchmark's plan (`plan`), its run (`gpu_run`), the peaks it
measures (`rates`), its results log (`results`) and its trace analysis (`trace`); the shape the
NVMe-traffic benchmarks share (`shapes`); the out-of-core benchmark's sizing and estimate
(`sizing`); and this process as /proc counts it (`procfs`: RAM, resident peaks per phase, I/O).

Scripts under `benchmarks/` parse flags and print; everything they decide or measure lives
here. Nothing here prints: the run reports through a callback.
"""
