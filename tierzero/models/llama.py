"""The built-in model: a LLaMA-style decoder, top to bottom in one file.

Two promises the engine relies on:

- **No buffers.** Rotary cos/sin are computed in each attention forward from the sequence
  length (a few kFLOPs next to the matmuls), so a model built on `meta` has parameters only,
  and materialising it one unit at a time needs no buffer handling.
- **A block is a pure function of its input.** `Block.forward(x)` takes only the hidden state,
  so the engine can run it as a checkpointed unit and recompute it in backward. The same
  holds for the embedding (`tok_emb(idx)`) and the head (`head_out(x, targets)`), the two
  other units. Generation alone hands a block its layer of a `KVCache` too (`forward(idx,
  cache=...)`): the keys and values of the positions before, kept on the compute device, so
  each new token is one pass over the units. Without a cache the code path is the training one.

Compute runs in the parameters' dtype (bf16 params -> bf16 matmuls). RMSNorm, the rotary
rotation and the loss are computed in fp32 and cast back, as in the LLaMA reference code.
Rotary embeddings use the rotate-half layout (the Hugging Face LLaMA convention), so HF LLaMA
weights load without permuting wq/wk.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tierzero.errors import ConfigError
from tierzero.models.loss import chunk_tokens_for, chunked_cross_entropy
from tierzero.models.presets import ModelArgs

INIT_STD = 0.02  # every Linear/Embedding weight ~ N(0, 0.02), residual projections included
# fp32 logits per loss chunk where that holds LOSS_CHUNK_TOKENS: one lives at a time
LOSS_CHUNK_BYTES = 64 << 20
LOSS_CHUNK_TOKENS = 1024  # tokens per loss chunk at least


def loss_chunk_bytes(vocab_size: int) -> int:
    """fp32 logit bytes per loss chunk: `LOSS_CHUNK_TOKENS` tokens at least, as many as 64 MiB
    holds where the vocabulary is small. Chunks sized in bytes alone were 130 tokens at a 128k
    vocabulary: 252 skinny head GEMMs per 32k tokens (each run three times), too thin to fill a
    GPU."""
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


def rotary(x: torch.Tensor, theta: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate query/key pairs (B, H, T, D) by their position's angle (rotate-half layout):
    positions 0..T-1, or each row's own `positions` (B, T) when decoding."""
    T, D = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    if positions is None:
        angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)  # (T, D)
    else:  # the same products as `outer`, per row: (B, 1, T, D)
        angles = positions.float()[..., None] * inv_freq
        cos, sin = angles.cos().repeat(1, 1, 2)[:, None], angles.sin().repeat(1, 1, 2)[:, None]
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

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        positions = None if kv is None else kv.cache.positions
        q, k = rotary(q, self.rope_theta, positions), rotary(k, self.rope_theta, positions)
        if kv is not None:  # every position so far: the cached ones, then these
            k, v = kv.append(k, v)
        if self.n_kv_heads != self.n_heads:  # GQA: each kv head serves a group of query heads
            group = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if kv is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=kv.cache.mask)
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

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), kv)
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

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        num_items_in_batch: float | torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """The loss of `targets`, or logits; with a `cache` (generation), the logits of each
        row's last position after `idx`, the positions that follow the cached ones."""
        if cache is not None:
            return self._decode(idx, cache)
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

    def _decode(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cache.advance(idx.shape[1], idx.device)
        x = self.tok_emb(idx)
        for block, kv in zip(self.blocks, cache.layers):
            x = block(x, kv)
        return self.head_out(x[:, -1:])

    def decode_cache(self, pad: list[int], capacity: int) -> KVCache:
        """An empty cache for rows left-padded by `pad` positions, to hold `capacity` positions."""
        if capacity > self.args.max_seq_len:
            raise ConfigError(
                f"the longest prompt and its new tokens make {capacity} positions, "
                f"past the model's max_seq_len {self.args.max_seq_len}; use a shorter "
                "prompt or fewer new tokens"
            )
        return KVCache(self.args.n_layers, pad, capacity)

    def head_out(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        num_items_in_batch: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
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
            unit_id, modules = (
                self.args.n_layers + 1,
                [self.norm] if tied else [self.norm, self.head],
            )
        else:
            unit_id, modules = int(which) + 1, [self.blocks[int(which)]]
        generator = torch.Generator().manual_seed(unit_seed(seed, unit_id))
        for module in modules:
            module.apply(lambda m: self.init_weights(m, generator))


class KVCache:
    """What generation keeps between passes: every block's keys and values (`LayerKV`, on the
    compute device, allocated at the first pass for `capacity` positions), and for the pass under
    way each row's positions and which earlier positions each query may attend to.

    Rows are left-padded to one length: row b's first `pad[b]` positions hold no token, its
    positions count from its first token, and no query attends to a pad (a pad query attends to
    itself alone, so no softmax is over nothing: its output is never read)."""

    def __init__(self, n_layers: int, pad: list[int], capacity: int) -> None:
        self.pad = pad
        self.capacity = capacity
        self.length = 0  # positions held once the pass under way has appended its own
        self.start = 0  # the first position of the pass under way
        self.positions: torch.Tensor | None = None  # (B, T) the pass's rotary positions
        self.mask: torch.Tensor | None = None  # (B, 1, T, length) bool; None: every key
        self.layers = [LayerKV(self) for _ in range(n_layers)]

    def inputs(self, ids: torch.Tensor) -> dict[str, Any]:
        """The model's keyword arguments for one pass over `ids` (B, T), the tokens that follow."""
        return {"idx": ids, "cache": self}

    @property
    def nbytes(self) -> int:
        """The keys' and values' bytes (allocated for `capacity` positions at the first pass)."""
        return sum(t.nbytes for kv in self.layers for t in (kv.k, kv.v) if t is not None)

    def advance(self, T: int, device: torch.device) -> None:
        """Begin a pass of `T` positions: their rotary positions and attention mask."""
        if self.length + T > self.capacity:
            raise ValueError(f"a cache of {self.capacity} positions got {self.length + T}")
        self.start, self.length = self.length, self.length + T
        pad = torch.tensor(self.pad, dtype=torch.long, device=device)[:, None]  # (B, 1)
        query = torch.arange(self.start, self.length, device=device)  # (T,) absolute positions
        self.positions = (query[None, :] - pad).clamp(min=0)
        if T == 1 and not any(self.pad):
            self.mask = None  # one query, no pads: it attends to every key
            return
        key = torch.arange(self.length, device=device)
        causal = key[None, :] <= query[:, None]  # (T, L)
        real = key[None, None, :] >= pad[:, :, None]  # (B, 1, L)
        own = (key[None, :] == query[:, None])[None]  # (1, T, L)
        self_only = own & (query[None, :, None] < pad[:, :, None])  # a pad query's own key
        self.mask = ((causal[None] & real) | self_only)[:, None]


class LayerKV:
    """One block's keys and values (B, kv heads, positions, head dim) in its `KVCache`."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the pass's keys and values after the earlier ones; every position's so far."""
        c = self.cache
        if self.k is None:
            shape = (k.shape[0], k.shape[1], c.capacity, k.shape[3])
            self.k = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.v = torch.empty(shape, dtype=v.dtype, device=v.device)
        self.k[:, :, c.start : c.length] = k
        self.v[:, :, c.start : c.length] = v
        return self.k[:, :, : c.length], self.v[:, :, : c.length]


def unit_seed(seed: int, unit_id: int) -> int:
    """A well-mixed 63-bit seed for (seed, unit), so nearby seeds give unrelated streams."""
    if seed < 0:
        raise ConfigError(f"seed {seed} is negative; use a seed >= 0")
    return int(
        np.random.SeedSequence([seed, unit_id]).generate_state(1, np.uint64)[0] >> np.uint64(1)
    )
