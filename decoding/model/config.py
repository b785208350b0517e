"""Model hyperparameters and the architecture switches: everything the model step needs to know.

One step body serves every architecture; an architecture is the set of switches below (where the
norms sit, which biases and head norms exist, the activation, the rotary layout, per-layer windows
and rotary bases) plus the tensors its loader fills. `ARCHITECTURES` names the families treadle runs.
"""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3moe", "mixtral")
ACTIVATIONS = ("silu", "gelu_tanh")  # the gate's activation in the gated feed-forward (SwiGLU, GeGLU)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # one of ARCHITECTURES
    n_layers: int
    dim: int  # residual stream width
    hidden_dim: int  # feed-forward width (of one expert, in a mixture of experts)
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention when < n_heads)
    head_dim: int
    vocab_size: int
    max_context: int  # positions the model was trained for
    rope_theta: float  # rotary base of the global layers
    rms_eps: float
    tied_embeddings: bool  # LM head shares the token embedding matrix
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    name: str = ""
    # architecture switches (defaults: llama)
    qkv_bias: bool = False  # qwen2: biases on the Q, K and V projections
    qk_norm: bool = False  # qwen3, gemma3: RMSNorm over each head's query and key, before RoPE
    post_norms: bool = False  # gemma3: RMSNorm on each block's output before it joins the residual
    activation: str = "silu"
    embedding_scale: float = 1.0  # gemma3: sqrt(dim)
    attention_scale: float = 0.0  # scale of q·k; 0 = 1 / sqrt(head_dim) (gemma3: query_pre_attn_scalar^-0.5)
    rope_neox: bool = False  # rotate pairs (i, i + head_dim/2) (Hugging Face layout) instead of (2i, 2i+1)
    rope_freq_factors: tuple[
        float, ...
    ] = ()  # llama3 scaling: each pair's frequency is divided by its factor
    rope_linear_factor: float = 1.0  # linear scaling of the global layers' positions
    sliding_window: int = 0  # keys a sliding layer sees, its own position included; 0 = none
    sliding_layers: tuple[
        bool, ...
    ] = ()  # per layer: does it use the window (empty: every layer, if windowed)
    rope_theta_local: float = 0.0  # rotary base of the sliding layers; 0 = rope_theta
    # a mixture of experts (qwen3moe, Mixtral): every layer's feed-forward is `n_experts` gated units
    # of width hidden_dim, of which a router picks `n_experts_used` per token
    n_experts: int = 0  # 0: a dense feed-forward
    n_experts_used: int = 0
    norm_topk_prob: bool = True  # the chosen experts' router probabilities renormalised to sum to one
    # an embedding model's file says how it pools its last hidden states (GGUF's pooling_type, or
    # sentence-transformers' modules): "mean", "cls" or "last"; "rank" for a reranker (its score read
    # from two logits: decoding.model.decoder_reranker); "" for a generation model
    pooling: str = ""
    add_eos_token: bool = False  # the tokenizer ends each input with EOS (embedders pooling the last token)

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} query heads do not group evenly over {self.n_kv_heads} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.sliding_layers and len(self.sliding_layers) != self.n_layers:
            raise ValueError(f"sliding_layers names {len(self.sliding_layers)} layers of {self.n_layers}")
        if self.n_experts and not 0 < self.n_experts_used <= self.n_experts:
            raise ValueError(f"{self.n_experts_used} experts used per token of {self.n_experts}")
        if self.rope_freq_factors and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"{len(self.rope_freq_factors)} rope frequency factors for head_dim {self.head_dim}")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def query_scale(self) -> float:
        return self.attention_scale or self.head_dim**-0.5

    def layer_window(self, layer: int) -> int:
        """Keys layer `layer` attends to (its own position included); 0 = the whole context."""
        if not self.sliding_window:
            return 0
        return self.sliding_window if not self.sliding_layers or self.sliding_layers[layer] else 0

    def layer_rope(self, layer: int) -> tuple[float, float]:
        """(rotary base, linear position factor) of a layer: sliding layers may have their own base."""
        if self.layer_window(layer) and self.rope_theta_local:
            return self.rope_theta_local, 1.0
        return self.rope_theta, self.rope_linear_factor
