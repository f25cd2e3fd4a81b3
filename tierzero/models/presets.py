"""Model shapes: the `ModelArgs` dataclass and the named presets.

Owns the arithmetic of a shape (head size, exact parameter count) so that `plan` can count a
70B model without building anything. Never touches torch.

Where the shapes come from (public configs; parameter counts are exact for our architecture,
which has no biases and the same tensors as those models):

- `tiny`  - ours: byte-level (vocab 256), GQA (8 query / 4 kv heads) so tests exercise the
  grouped path; trains on a CPU in seconds.
- `125m`, `350m` - the GPT-3 size names, with the shapes of MobileLLM-125M / MobileLLM-350M
  (Liu et al. 2024), which are LLaMA-architecture models of exactly those sizes (deep and thin,
  GQA, tied embeddings, vocab 32000). A GPT-3 shape (768 wide, 12 deep) with LLaMA's SwiGLU and
  vocab lands at 110M tied / 134M untied, outside 2% of 125M, hence MobileLLM's.
- `1b`, `3b` - LLaMA-3.2 1B / 3B: vocab 128256, tied embeddings, rope_theta 500000.
  max_seq_len 8192 (their pre-training context; we implement no RoPE scaling for 128k).
- `7b`, `13b`, `70b` - LLaMA-2: vocab 32000, untied, 4096 context; 70b uses GQA (8 kv heads).
- `llama3-8b`, `llama3-70b` - LLaMA-3 / 3.1 8B and 70B: vocab 128256, untied, GQA (8 kv
  heads), rope_theta 500000, max_seq_len 8192 (their pre-training context, as for `1b`/`3b`).
  Their 128k-token embedding and head are ~1.05B (8B) and ~2.1B (70B) parameters.
"""

from dataclasses import dataclass

from tierzero.errors import ConfigError


@dataclass(frozen=True)
class ModelArgs:
    """The shape of a LLaMA-style decoder; everything `Transformer` needs to build itself."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in (
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "vocab_size",
            "ffn_dim",
            "max_seq_len",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"model {name} is {getattr(self, name)}; it must be a positive integer"
                )
        if self.dim % self.n_heads:
            raise ConfigError(
                f"model dim {self.dim} is not divisible by n_heads {self.n_heads}; "
                "pick a dim that is"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}; "
                "each kv head must serve a whole group of query heads"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"head size dim/n_heads = {self.head_dim} is odd; "
                "rotary embeddings need an even head size"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def param_count(self) -> int:
        """Exact number of unique parameters of the built model (a tied head counts once)."""
        kv_dim = self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv_dim  # wq, wo; wk, wv
        mlp = 3 * self.dim * self.ffn_dim  # w_gate, w_up, w_down
        block = attention + mlp + 2 * self.dim  # + two RMSNorm weights
        embedding = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else embedding
        return embedding + self.n_layers * block + self.dim + head  # + final norm


PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=256,
        ffn_dim=768,
        max_seq_len=512,
        tie_embeddings=True,
    ),
    "125m": ModelArgs(
        dim=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        vocab_size=32000,
        ffn_dim=1536,
        tie_embeddings=True,
    ),
    "350m": ModelArgs(
        dim=960,
        n_layers=32,
        n_heads=15,
        n_kv_heads=5,
        vocab_size=32000,
        ffn_dim=2560,
        tie_embeddings=True,
    ),
    "1b": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim=8192,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    "3b": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim=8192,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    "7b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        vocab_size=32000,
        ffn_dim=11008,
        max_seq_len=4096,
    ),
    "13b": ModelArgs(
        dim=5120,
        n_layers=40,
        n_heads=40,
        n_kv_heads=40,
        vocab_size=32000,
        ffn_dim=13824,
        max_seq_len=4096,
    ),
    "70b": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=32000,
        ffn_dim=28672,
        max_seq_len=4096,
    ),
    "llama3-8b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}


def get_preset(name: str) -> ModelArgs:
    """The preset called `name`, or a ConfigError listing the valid names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model preset '{name}'; choose one of: {', '.join(PRESETS)}"
        ) from None
