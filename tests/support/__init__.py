"""What the tests share and never test: the engine's test config and model (`engine`), hand-built
checkpoints, the CLI runner, small Hugging Face models, fakes of the GPU's streams and CUDA
runtime (`fakes`), the watchers and checks read over a fake's log, and scripts the tests run as
child processes (`scripts`). Imported as `tests.support.<module>` (pytest puts the repo on the
path)."""
