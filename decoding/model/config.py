"""Model hyperparameters: everything the kernels need to know about a llama-family model's shape."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # "llama"
    n_layers: int
    dim: int  # residual stream width
    hidden_dim: int  # feed-forward width
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention when < n_heads)
    head_dim: int
    vocab_size: int
    max_context: int  # positions the model was trained for
    rope_theta: float
    rms_eps: float
    tied_embeddings: bool  # LM head shares the token embedding matrix
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    name: str = ""

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} query heads do not group evenly over {self.n_kv_heads} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim
