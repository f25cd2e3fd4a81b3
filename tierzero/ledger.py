"""The ledger: how many bytes a model's training state and activations take, before placing them.

Owns the counting that needs no machine: bytes per parameter per state kind, the per-GPU
account of DDP and ZeRO stages 1-3, a model's units and their parameter counts, and the
activation memory of per-unit checkpointing. Pure arithmetic on `ModelArgs`; it never builds
a model, touches torch or probes a machine. Where the state should live is `tierzero.plan`.

Nominal and exact sizes: a preset named `7b` has 6.74B parameters. The textbook account
(DESIGN.md: "a 7B model is 112 GB") uses the size in the name, so `ledger` is computed from
`nominal_numel(preset)` where the name has one; placements always use the exact unit sizes.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

from tierzero.config import StateKind
from tierzero.errors import ConfigError
from tierzero.models.presets import PRESETS, ModelArgs

GB = 10**9  # sizes in tables are decimal GB, as in "a 7B model is 112 GB"

FP32_NBYTES = 4
ROOT_UNIT = "root"

Unit = tuple[str, int]  # (unit name, parameter count)


class Stage(str, enum.Enum):
    DDP = "ddp"
    STAGE1 = "stage1"
    STAGE2 = "stage2"
    STAGE3 = "stage3"


# which state kinds each stage partitions across the data-parallel ranks
_PARTITIONED: dict[Stage, frozenset[StateKind]] = {
    Stage.DDP: frozenset(),
    Stage.STAGE1: frozenset({StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ}),
    Stage.STAGE2: frozenset({StateKind.GRAD, StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ}),
    Stage.STAGE3: frozenset(StateKind),
}


def state_nbytes(kind: StateKind, compute_itemsize: int, grad_itemsize: int | None = None) -> int:
    """Bytes per parameter of one state kind: param (and by default grad) in the compute dtype,
    master and Adam moments always fp32."""
    if kind is StateKind.PARAM:
        return compute_itemsize
    if kind is StateKind.GRAD:
        return compute_itemsize if grad_itemsize is None else grad_itemsize
    return FP32_NBYTES


@dataclass(frozen=True)
class LedgerRow:
    stage: Stage
    bytes_per_param: float  # per GPU, for `world_size` ranks
    bytes_per_gpu: float


def ledger(numel: int, world_size: int, compute_itemsize: int = 2) -> list[LedgerRow]:
    """Bytes per GPU of the training state under DDP and ZeRO stages 1-3.

    With a 2-byte compute dtype and N ranks: 16, 4 + 12/N, 2 + 14/N, 16/N bytes per parameter.
    """
    check_world_size(world_size)
    rows = []
    for stage, partitioned in _PARTITIONED.items():
        per_param = sum(state_nbytes(k, compute_itemsize) / (world_size if k in partitioned else 1)
                        for k in StateKind)
        rows.append(LedgerRow(stage, per_param, per_param * numel))
    return rows


_NOMINAL_RE = re.compile(r"^([0-9]*\.?[0-9]+)([mb])$", re.IGNORECASE)
_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def nominal_numel(preset: str) -> int | None:
    """The size a preset is named for (`7b` -> 7e9, `125m` -> 125e6); None for names like `tiny`."""
    m = _NOMINAL_RE.match(preset)
    return None if m is None else round(float(m.group(1)) * _COUNT_SUFFIX[m.group(2).lower()])


def parse_count(value: str, what: str = "parameter count") -> int:
    """`7e9`, `70B`, `125M` or `1000000` -> a positive integer count (B = billion, not bytes)."""
    m = _COUNT_RE.match(value)
    count = round(float(m.group(1)) * _COUNT_SUFFIX[m.group(2).lower()]) if m else 0
    if count < 1:
        raise ConfigError(f"{what} '{value}' is not a positive count; write it like 7e9, 70B or 125M")
    return count


def block_numel(args: ModelArgs) -> int:
    """Parameters of one transformer block: attention, SwiGLU MLP and two RMSNorm weights."""
    kv_dim = args.n_kv_heads * args.head_dim
    return 2 * args.dim * args.dim + 2 * args.dim * kv_dim + 3 * args.dim * args.ffn_dim + 2 * args.dim


def root_numel(args: ModelArgs) -> int:
    """Parameters outside the blocks: embedding, final norm and (unless tied) the head."""
    embedding = args.vocab_size * args.dim
    return embedding + args.dim + (0 if args.tie_embeddings else embedding)


def units_from_args(args: ModelArgs) -> list[Unit]:
    """The model's units in execution order: `blocks.0` .. `blocks.{n-1}`, then `root`."""
    block = block_numel(args)
    return [(f"blocks.{i}", block) for i in range(args.n_layers)] + [(ROOT_UNIT, root_numel(args))]


def nearest_preset(numel: int) -> str:
    """The preset whose exact size is closest to `numel` on a log scale: the shape we assume
    when only a parameter count is given."""
    return min(PRESETS, key=lambda name: abs(math.log(PRESETS[name].param_count() / numel)))


def scaled_units(numel: int, args: ModelArgs) -> list[Unit]:
    """`args`'s units with every count scaled so they sum to `numel` (the last takes the rounding)."""
    units = units_from_args(args)
    ratio = numel / args.param_count()
    scaled = [(name, max(1, round(n * ratio))) for name, n in units[:-1]]
    name, _ = units[-1]
    return scaled + [(name, max(1, numel - sum(n for _, n in scaled)))]


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes of one micro-batch with per-unit checkpointing (see `activation_memory`)."""

    batch_size: int
    seq_len: int
    checkpoints_bytes: int
    recompute_bytes: int
    logits_bytes: int

    @property
    def total_bytes(self) -> int:
        # the block recompute (backward) and the loss (end of forward) never overlap in time
        return self.checkpoints_bytes + max(self.recompute_bytes, self.logits_bytes)


def activation_memory(args: ModelArgs, batch_size: int, seq_len: int, compute_itemsize: int) -> ActivationEstimate:
    """Peak activation bytes with per-unit checkpointing, for n = batch_size * seq_len tokens.

    With c = compute itemsize, D = dim, K = kv dim, F = ffn_dim, H = heads, V = vocab:

    - checkpoints: the input of every block and of the head, kept through the step:
      (n_layers + 1) * n * D * c.
    - recompute: one block's forward with grad, re-run in backward. Saved for its backward:
      two norm outputs, q/k/v as SDPA sees them (GQA k/v expanded to D), the attention output
      and its reshaped copy: 7 * n * D * c; the fp32 RMSNorm intermediates: 2 * 2 * n * D * 4;
      gate, up, silu(gate) and their product: 4 * n * F * c; SDPA's fp32 logsumexp: n * H * 4.
      SDPA keeps no S^2 score matrix. (Within 10% of the saved tensors measured on `tiny`.)
    - logits: the fp32 log-softmax the loss saves for backward, plus its gradient of the same
      size when backward starts: 2 * n * V * 4.

    Peak = checkpoints + max(recompute, logits), since the loss ends the forward pass before
    any block is recomputed.
    """
    if batch_size < 1 or seq_len < 1:
        raise ConfigError(f"batch size {batch_size} and sequence length {seq_len} must both be >= 1")
    if seq_len > args.max_seq_len:
        raise ConfigError(f"sequence length {seq_len} exceeds the model's max_seq_len {args.max_seq_len}; "
                          "plan for a shorter sequence")
    n, c, d = batch_size * seq_len, compute_itemsize, args.dim
    checkpoints = (args.n_layers + 1) * n * d * c
    recompute = n * (7 * d * c + 4 * d * FP32_NBYTES + 4 * args.ffn_dim * c) + n * args.n_heads * FP32_NBYTES
    logits = 2 * n * args.vocab_size * FP32_NBYTES
    return ActivationEstimate(batch_size, seq_len, checkpoints, recompute, logits)


def check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"number of GPUs must be an integer >= 1, got {world_size!r}")
