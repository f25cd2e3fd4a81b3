"""The benchmarks' logic that tests import: the GPU benchmark's plan (`plan`), its run
(`gpu_run`), its results log (`results`) and its trace analysis (`trace`).

Scripts under `benchmarks/` parse flags and print; everything they decide or measure lives
here. Nothing here prints: the run reports through a callback.
"""
