"""The built-in model: a LLaMA-style decoder, top to bottom in one file.

Two promises the engine relies on:

- **No buffers.** Rotary cos/sin are computed in each attention forward from the sequence
  length (a few kFLOPs next to the matmuls), so a model built on `meta` has parameters only,
  and materialising it one unit at a time needs no buffer handling.
- **A block is a pure function of its input.** `Block.forward(x)` takes only the hidden state,
  so the engine can run it as a checkpointed unit and recompute it in backward. The same
  holds for the embedding (`tok_emb(idx)`) and the head (`head_out(x, targets)`), the two
  other units.

Compute runs in the parameters' dtype (bf16 params -> bf16 matmuls). RMSNorm, the rotary
rotation and the loss are computed in fp32 and cast back, as in the LLaMA reference code.
Rotary embeddings use the rotate-half layout (the Hugging Face LLaMA convention), so HF LLaMA
weights load without permuting wq/wk.
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tierzero.errors import ConfigError
from tierzero.models.loss import chunk_tokens_for, chunked_cross_entropy
from tierzero.models.presets import ModelArgs

INIT_STD = 0.02  # every Linear/Embedding weight ~ N(0, 0.02), residual projections included
LOSS_CHUNK_BYTES = 64 << 20  # fp32 logits per loss chunk where that holds LOSS_CHUNK_TOKENS: one lives at a time
LOSS_CHUNK_TOKENS = 1024  # tokens per loss chunk at least


def loss_chunk_bytes(vocab_size: int) -> int:
    """fp32 logit bytes per loss chunk: `LOSS_CHUNK_TOKENS` tokens at least, as many as 64 MiB
    holds where the vocabulary is small. Chunks sized in bytes alone were 130 tokens at a 128k
    vocabulary: 252 skinny head GEMMs per 32k tokens (each run three times), too thin to fill a GPU."""
    return 4 * vocab_size * max(LOSS_CHUNK_TOKENS, LOSS_CHUNK_BYTES // (4 * vocab_size))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics: the mean of squares over 4096+ bf16 values loses too much precision
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate query/key pairs (B, H, T, D) by their position's angle (rotate-half layout)."""
    T, D = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)  # (T, D)
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.rope_theta = args.rope_theta
        kv_dim = args.n_kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, kv_dim, bias=False)
        self.wv = nn.Linear(args.dim, kv_dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotary(q, self.rope_theta), rotary(k, self.rope_theta)
        if self.n_kv_heads != self.n_heads:  # GQA: each kv head serves a group of query heads
            group = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w_gate = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w_up = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w_down = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Token ids -> logits, or -> mean cross-entropy loss when targets are given.

    Build it with `tierzero.models.build`, which initialises it; constructing it directly
    leaves PyTorch's default initialisation (or nothing, on `meta`).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_emb = nn.Embedding(args.vocab_size, args.dim)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.loss_chunk_bytes = loss_chunk_bytes(args.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the head, if the args say so.

        Call again after `to_empty()`: it creates a new tensor per module and so unties them.
        """
        if self.args.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                num_items_in_batch: float | torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.args.max_seq_len:
            raise ConfigError(
                f"sequence length {T} exceeds the model's max_seq_len {self.args.max_seq_len}; "
                "use a shorter --seq-len"
            )
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head_out(x, targets, num_items_in_batch)

    def head_out(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                 num_items_in_batch: float | torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and head: logits, or the mean cross-entropy without full logits (the sum
        over `num_items_in_batch` when given: a step's count, see `models.loss`).

        The tiered engine runs this as the head unit, so it takes everything after the blocks.
        Loss in fp32 (a bf16 sum over batch*seq tokens would round away the signal), computed
        in chunks of about `loss_chunk_bytes` of logits (see `models.loss`).
        """
        x = self.norm(x)
        if targets is None:
            return self.head(x)
        chunk = chunk_tokens_for(self.args.vocab_size, self.loss_chunk_bytes)
        return chunked_cross_entropy(self.head, x, targets, chunk, num_items_in_batch)

    def get_input_embeddings(self) -> nn.Module:
        return self.tok_emb

    def init_weights(self, module: nn.Module, generator: torch.Generator | None = None) -> None:
        """Initialise `module`'s own parameters (not its children's: use `.apply`).

        Random draws are made on the CPU in fp32 and copied into the weight, so the values
        do not depend on the device or dtype the model lives in: a bf16 CUDA model holds the
        bf16 rounding of the fp32 CPU model. `generator=None` draws from torch's global RNG.
        """
        if isinstance(module, (nn.Linear, nn.Embedding)):
            draw = torch.empty(module.weight.shape).normal_(0.0, INIT_STD, generator=generator)
            with torch.no_grad():
                module.weight.copy_(draw)
        elif isinstance(module, RMSNorm):
            module.reset_parameters()

    def init_unit(self, seed: int, which: int | str) -> None:
        """Initialise one unit from its own RNG stream: block `which` (an index), or
        "embedding" (tok_emb), "head" (norm and an untied head), or "root" (both).

        Each stream depends only on (seed, unit), so materialising a meta model unit by unit,
        in any order, gives exactly the weights `build(seed=seed)` gives.
        """
        if which == "root":
            self.init_unit(seed, "embedding")
            self.init_unit(seed, "head")
            return
        if which == "embedding":
            unit_id, modules = 0, [self.tok_emb]
        elif which == "head":
            tied = self.head.weight is self.tok_emb.weight
            unit_id, modules = self.args.n_layers + 1, [self.norm] if tied else [self.norm, self.head]
        else:
            unit_id, modules = int(which) + 1, [self.blocks[int(which)]]
        generator = torch.Generator().manual_seed(unit_seed(seed, unit_id))
        for module in modules:
            module.apply(lambda m: self.init_weights(m, generator))


def unit_seed(seed: int, unit_id: int) -> int:
    """A well-mixed 63-bit seed for (seed, unit), so nearby seeds give unrelated streams."""
    if seed < 0:
        raise ConfigError(f"seed {seed} is negative; use a seed >= 0")
    return int(np.random.SeedSequence([seed, unit_id]).generate_state(1, np.uint64)[0] >> np.uint64(1))
