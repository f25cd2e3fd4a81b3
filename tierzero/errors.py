"""Domain errors of the engine.

Every error says what is wrong and how to fix it, in one sentence, so the CLI can print it
as-is and exit 2 without a traceback. Storage has its own family (`tierzero.storage.base`).
"""


class TierzeroError(Exception):
    """Base of every error tierzero raises on purpose (bad input, bad state)."""


class ConfigError(TierzeroError):
    """A configuration value, flag, file or preset is invalid.

    `key`: the config key whose value is refused, when the message starts with it; the CLI then
    names the flag the user typed instead (`--steps`, not `total_steps`)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class DataError(TierzeroError):
    """A data file is missing, empty, or does not fit the model."""


class RunDirError(TierzeroError):
    """A run directory is locked by another trainer or is not usable."""


class CheckpointError(TierzeroError):
    """A checkpoint is missing, incomplete, damaged, or was written for another model or run."""
