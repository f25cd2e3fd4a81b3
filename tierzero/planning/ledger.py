"""The ledger: how many bytes a model's training state and activations take, before placing them.

Owns the counting that needs no machine: bytes per parameter per state kind, the per-GPU
account of DDP and ZeRO stages 1-3, a model's units and their parameter counts, and the
activation memory of per-unit checkpointing, and the compact rows: the state's bytes per
parameter under each (Adam moments, master) format (`tierzero.planning.statebytes`). Pure
arithmetic on `ModelArgs`; it never builds a model, touches torch or probes a machine. Where the
state should live is `tierzero.planning.placement`.

Nominal and exact sizes: a preset named `7b` has 6.74B parameters. The textbook account
(DESIGN.md: "a 7B model is 112 GB") uses the size in the name, so `ledger` is computed from
`nominal_numel(preset)` where the name has one; placements always use the exact unit sizes.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

from tierzero.config import OPTIMIZER_KINDS, DType, StateFormat, StateKind
from tierzero.errors import ConfigError
from tierzero.models.presets import PRESETS, ModelArgs
from tierzero.planning.statebytes import FP32_NBYTES, FP32_STATE, StateBytes

GB = 10**9  # sizes in tables are decimal GB, as in "a 7B model is 112 GB"

# the unit names partition gives the built-in model's ends (`Workload.from_sizes` reads them as
# kinds)
EMBEDDING_UNIT = "embedding"
HEAD_UNIT = "head"
ROOT_UNIT = "root"

UnitSize = tuple[
    str, int
]  # (unit name, parameter count): what the ledger counts of a partition `Unit`


class Stage(str, enum.Enum):
    DDP = "ddp"
    STAGE1 = "stage1"
    STAGE2 = "stage2"
    STAGE3 = "stage3"


# which state kinds each stage partitions across the data-parallel ranks
_PARTITIONED: dict[Stage, frozenset[StateKind]] = {
    Stage.DDP: frozenset(),
    Stage.STAGE1: frozenset(OPTIMIZER_KINDS),
    Stage.STAGE2: frozenset({StateKind.GRAD, *OPTIMIZER_KINDS}),
    Stage.STAGE3: frozenset(StateKind),
}


def state_nbytes(kind: StateKind, compute_itemsize: int, grad_itemsize: int | None = None) -> int:
    """Bytes per parameter of one state kind in fp32 state: param (and by default grad) in the
    compute dtype, master and Adam moments fp32 (compact formats: `StateBytes.nbytes`)."""
    return FP32_STATE.nbytes(kind, 1, compute_itemsize, grad_itemsize)


@dataclass(frozen=True)
class LedgerRow:
    stage: Stage
    bytes_per_param: float  # per GPU, for `world_size` ranks
    bytes_per_gpu: float


def ledger(
    numel: int, world_size: int, compute_itemsize: int = 2, formats: StateBytes = FP32_STATE
) -> list[LedgerRow]:
    """Bytes per GPU of the training state under DDP and ZeRO stages 1-3, in `formats`.

    With a 2-byte compute dtype, fp32 state and N ranks: 16, 4 + 12/N, 2 + 14/N, 16/N bytes per
    parameter. With one weight tensor (bf16 compute and master) the param is the master wherever
    the two are partitioned alike; stages 1 and 2 keep a whole param beside the master's share.
    """
    check_world_size(world_size)
    rows = []
    for stage, partitioned in _PARTITIONED.items():
        alike = world_size == 1 or (StateKind.PARAM in partitioned) == (
            StateKind.MASTER in partitioned
        )
        per_param = sum(
            formats.per_param(k, compute_itemsize) / (world_size if k in partitioned else 1)
            for k in StateKind
            if not (k is StateKind.PARAM and formats.one_weight and alike)
        )
        rows.append(LedgerRow(stage, per_param, per_param * numel))
    return rows


@dataclass(frozen=True)
class FormatRow:
    """The compact rows: one (moments, master) format's state bytes per parameter on one rank,
    grads in the compute dtype as the textbook counts them (tierzero keeps them fp32: +2)."""

    formats: StateBytes
    weights: float  # the param and the master (one tensor where `formats.one_weight`)
    grads: float
    moments: float  # exp_avg and exp_avg_sq, int8 scales included

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.moments


def format_rows(compute: DType) -> list[FormatRow]:
    """Every (optimizer_state, master) choice for a run computing in `compute`, fp32 first:
    with bf16 compute, 16 bytes per parameter down to 2 + 2 + 2 (bf16 weights, bf16 grads, int8
    moments, 6.004 with the scales)."""
    c = 4 if compute is DType.FP32 else 2
    rows = []
    for master in (DType.FP32, DType.BF16):
        for moments in StateFormat:
            f = StateBytes.for_compute(moments, master, compute)
            param = 0.0 if f.one_weight else f.per_param(StateKind.PARAM, c)
            rows.append(
                FormatRow(
                    f,
                    param + f.per_param(StateKind.MASTER, c),
                    f.per_param(StateKind.GRAD, c),
                    f.per_param(StateKind.EXP_AVG, c) + f.per_param(StateKind.EXP_AVG_SQ, c),
                )
            )
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
        raise ConfigError(
            f"{what} '{value}' is not a positive count; write it like 7e9, 70B or 125M"
        )
    return count


def block_numel(args: ModelArgs) -> int:
    """Parameters of one transformer block: attention, SwiGLU MLP and two RMSNorm weights."""
    kv_dim = args.n_kv_heads * args.head_dim
    return (
        2 * args.dim * args.dim + 2 * args.dim * kv_dim + 3 * args.dim * args.ffn_dim + 2 * args.dim
    )


def embedding_numel(args: ModelArgs) -> int:
    """Parameters of the embedding unit: the token embedding (the head's weight too, when tied)."""
    return args.vocab_size * args.dim


def head_numel(args: ModelArgs) -> int:
    """Parameters of the head unit: the final norm and, unless tied to the embedding, the head."""
    return args.dim + (0 if args.tie_embeddings else args.vocab_size * args.dim)


def units_from_args(args: ModelArgs) -> list[UnitSize]:
    """The model's units in execution order, as the engine partitions the built-in model:
    `embedding`, `blocks.0` .. `blocks.{n-1}`, `head`."""
    block = block_numel(args)
    return (
        [(EMBEDDING_UNIT, embedding_numel(args))]
        + [(f"blocks.{i}", block) for i in range(args.n_layers)]
        + [(HEAD_UNIT, head_numel(args))]
    )


def nearest_preset(numel: int) -> str:
    """The preset whose exact size is closest to `numel` on a log scale: the shape we assume
    when only a parameter count is given."""
    return min(PRESETS, key=lambda name: abs(math.log(PRESETS[name].param_count() / numel)))


def scaled_units(numel: int, args: ModelArgs) -> list[UnitSize]:
    """`args`'s units with every count scaled so they sum to `numel` (the last takes the
    rounding)."""
    units = units_from_args(args)
    ratio = numel / args.param_count()
    scaled = [(name, max(1, round(n * ratio))) for name, n in units[:-1]]
    name, _ = units[-1]
    return scaled + [(name, max(1, numel - sum(n for _, n in scaled)))]


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes of one micro-batch with per-unit checkpointing (see `activation_memory`).

    Every field is one part of the compute device's working set; `tierzero.planning.memory_model`
    adds them to the params and gradients in flight at each moment of the step.
    """

    batch_size: int
    seq_len: int
    checkpoints_bytes: int  # every unit's input, held from its forward to its backward
    block_forward_bytes: int  # one block's forward without grad: its temporaries at their peak
    recompute_bytes: int  # what one block's recompute saves for its backward
    block_backward_bytes: int  # one block's recompute + backward at their peak (no weight grads)
    head_backward_bytes: int  # the head's recompute + backward: its norm and one chunk of logits
    logits_bytes: int  # one loss chunk's logits in forward (no grad): the head's forward peak
    chunk_tokens: int
    head_kept_bytes: int = 0  # what the head's forward with grad saves for its backward
    hidden_bytes: int = 0  # one micro-batch's hidden state (a block's input)
    # units whose forward keeps its autograd graph until their backward instead of being
    # recomputed (`tierzero.planning.recompute`): each block holds `recompute_bytes`, the head
    # `head_kept_bytes`, from its forward to its backward
    kept_blocks: int = 0
    kept_head: bool = False
    # the vertical schedule's micro-batches a step (0: horizontal): there each kept block holds
    # one graph per micro-batch from the forward sweep to the backward sweep, with its input
    # inside it (not waiting in the host store); the head runs once, in backward, and keeps none
    vertical: int = 0

    @property
    def block_kept_bytes(self) -> int:
        """What one kept block holds from its forward to its backward."""
        if self.vertical:
            return self.vertical * (self.recompute_bytes + self.hidden_bytes)
        return self.recompute_bytes

    @property
    def kept_bytes(self) -> int:
        return self.kept_blocks * self.block_kept_bytes + (
            self.head_kept_bytes if self.kept_head else 0
        )

    @property
    def forward_bytes(self) -> int:
        """Peak of the forward pass: every checkpoint and kept graph plus the larger of a block's
        or the loss's temporaries (the last block's forward runs with all but one checkpoint
        held)."""
        return (
            self.checkpoints_bytes
            + self.kept_bytes
            + max(self.block_forward_bytes, self.logits_bytes)
        )

    @property
    def backward_bytes(self) -> int:
        """Peak of the backward pass, weight gradients aside (the memory model adds those): the
        head's backward runs with every kept graph still held."""
        return (
            self.checkpoints_bytes
            + self.kept_bytes
            + max(self.block_backward_bytes, self.head_backward_bytes)
        )

    @property
    def total_bytes(self) -> int:
        return max(self.forward_bytes, self.backward_bytes)


LOGITS_FORWARD_BYTES = 8  # per logit, loss without grad: the fp32 logits and their log-softmax
LOGITS_BACKWARD_BYTES = (
    12  # per logit in backward: the saved log-softmax, its grad and the logits' grad
)


def activation_memory(
    args: ModelArgs,
    batch_size: int,
    seq_len: int,
    compute_itemsize: int,
    loss_chunk_bytes: int | None = None,
) -> ActivationEstimate:
    """Peak activation bytes with per-unit checkpointing, for n = batch_size * seq_len tokens.

    With c = compute itemsize, D = dim, K = kv dim, F = ffn_dim, H = heads, V = vocab, and
    t = tokens per loss chunk (`loss_chunk_bytes` of fp32 logits, as `models.loss` splits the
    loss; None: one chunk of all n tokens):

    - checkpoints: the input of every block and of the head, kept through the step:
      (n_layers + 1) * n * D * c.
    - block forward (no grad): the SwiGLU's three F-wide temporaries, the normed input and the
      output: n * (3F + 2D) * c.
    - recompute: one block's forward with grad, re-run in backward. Saved for its backward:
      two norm outputs, q/k/v as SDPA sees them (GQA k/v expanded to D), the attention output
      and its reshaped copy: 7 * n * D * c; the fp32 RMSNorm intermediates: 2 * 2 * n * D * 4;
      gate, up, silu(gate) and their product: 4 * n * F * c; SDPA's fp32 logsumexp: n * H * 4.
      SDPA keeps no S^2 score matrix. (Within 10% of the saved tensors measured on `tiny`.)
    - block backward: the recompute's saved tensors, the output's and the input's grads and
      one more D-wide and one F-wide temporary: recompute + n * (3D + F) * c.
    - head backward: the final norm's saved tensors (2 * n * D * 4 + n * D * c) and one chunk's
      logits in backward (12 * t * V: the saved fp32 log-softmax, its grad, the logits' grad).
    - logits: one chunk's fp32 logits and log-softmax in forward: 8 * t * V.
    - head kept: the head's forward with grad, its graph kept to its backward: the final norm's
      saved tensors (2 * n * D * 4 + n * D * c) and, where the loss is one chunk (t >= n), its
      saved fp32 log-softmax (4 * n * V); several chunks each keep only their hidden slice.

    (The per-logit and per-block factors were measured with RSS on the CPU, fp32.)
    """
    if batch_size < 1 or seq_len < 1:
        raise ConfigError(
            f"batch size {batch_size} and sequence length {seq_len} must both be >= 1"
        )
    if seq_len > args.max_seq_len:
        raise ConfigError(
            f"sequence length {seq_len} exceeds the model's max_seq_len {args.max_seq_len}; "
            "plan for a shorter sequence"
        )
    n, c, d, f = batch_size * seq_len, compute_itemsize, args.dim, args.ffn_dim
    chunk = (
        n
        if loss_chunk_bytes is None
        else min(n, max(1, loss_chunk_bytes // (FP32_NBYTES * args.vocab_size)))
    )
    checkpoints = (args.n_layers + 1) * n * d * c
    recompute = n * (7 * d * c + 4 * d * FP32_NBYTES + 4 * f * c) + n * args.n_heads * FP32_NBYTES
    return ActivationEstimate(
        batch_size,
        seq_len,
        checkpoints,
        block_forward_bytes=n * (3 * f + 2 * d) * c,
        recompute_bytes=recompute,
        block_backward_bytes=recompute + n * (3 * d + f) * c,
        head_backward_bytes=n * d * (2 * FP32_NBYTES + c)
        + LOGITS_BACKWARD_BYTES * chunk * args.vocab_size,
        logits_bytes=LOGITS_FORWARD_BYTES * chunk * args.vocab_size,
        chunk_tokens=chunk,
        head_kept_bytes=n * d * (2 * FP32_NBYTES + c)
        + (FP32_NBYTES * n * args.vocab_size if chunk >= n else 0),
        hidden_bytes=n * d * c,
    )


def check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(
            f"number of GPUs must be an integer >= 1, got {world_size!r}; pass --gpus 1 or more"
        )


def waiting_activations_bytes(
    n_blocks: int,
    dim: int,
    vocab_size: int,
    tied: bool,
    tokens: int,
    accumulate: int,
    itemsize: int,
) -> int:
    """Host bytes the vertical schedule's waiting activations take at most
    (`engine.vertical.boundary`, beyond its budget spilled to nvme): every micro-batch's input to
    every block, and a tied embedding's grads from the head (fp32), for `accumulate`
    micro-batches of `tokens` each."""
    return accumulate * (
        n_blocks * tokens * dim * itemsize + (vocab_size * dim * FP32_NBYTES if tied else 0)
    )
