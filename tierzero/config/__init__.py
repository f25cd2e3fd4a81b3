"""Configuration: the engine's `Config` and the run's `RunConfig`, each composed of frozen
sections that the rooms receive one at a time, and the vocabulary they are written in.

`kinds` (tiers, state kinds, dtypes, placements, sizes), `sectioned` (flat keys in, sections
out), `engine` (the engine's sections) and `run` (the run's). Every field is validated where
its section is built, with a message that names the key and the fix.
"""

from tierzero.config.engine import (
    Config,
    Execution,
    FormatSettings,
    OptimizerSettings,
    Partitioning,
    Precision,
    StreamSettings,
    Tiering,
)
from tierzero.config.kinds import (
    OPTIMIZER_KINDS,
    PIECE_NUMEL,
    PREFETCH_DEPTH,
    STATE_BLOCK,
    TORCH_DTYPES,
    DType,
    LongExamples,
    LRSchedule,
    Offload,
    OptimizerDevice,
    Placement,
    Recompute,
    Schedule,
    StateFormat,
    StateKind,
    Tier,
    bound_device,
    choice,
    parse_bytes,
    placement_from_dict,
)
from tierzero.config.run import (
    Checkpointing,
    Corpus,
    Evaluation,
    LoraSettings,
    Reporting,
    RunConfig,
)

__all__ = [
    "OPTIMIZER_KINDS",
    "PIECE_NUMEL",
    "PREFETCH_DEPTH",
    "STATE_BLOCK",
    "TORCH_DTYPES",
    "Checkpointing",
    "Config",
    "Corpus",
    "DType",
    "Evaluation",
    "Execution",
    "LRSchedule",
    "LongExamples",
    "LoraSettings",
    "Offload",
    "OptimizerSettings",
    "Partitioning",
    "Placement",
    "Precision",
    "OptimizerDevice",
    "Recompute",
    "Reporting",
    "RunConfig",
    "Schedule",
    "StateFormat",
    "FormatSettings",
    "StateKind",
    "StreamSettings",
    "Tier",
    "Tiering",
    "bound_device",
    "choice",
    "parse_bytes",
    "placement_from_dict",
]
