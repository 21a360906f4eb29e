"""Model shapes: what the analytic latency model needs of a model (layers, widths, heads,
experts), and the two shapes built in (`smollm2-135m`, `llama-7b`). Any other shape comes
from a Hugging Face config.json (sim/model_config.py); hardware profiles are in hardware.py.
This module imports nothing of tokenweir, so both of those can import it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the roofline prices: a decoder-only transformer's sizes.

    Dense when `num_experts` is 0. A mixture-of-experts shape has `num_moe_layers` layers
    whose MLP is `num_experts` SwiGLU experts of `moe_intermediate_size` (each token runs
    `num_experts_per_tok` of them), a router (hidden x experts) and optionally a shared expert
    of `shared_expert_intermediate_size` that every token runs; the other layers keep a dense
    MLP of `intermediate_size`. Built from a Hugging Face config.json by sim/model_config.py.

    Memory: the weights held are `num_weight_params` (every expert, the LM head, the input
    embedding unless tied). The two shapes written here before configs existed
    (`smollm2-135m`, `llama-7b`) keep the default `tie_word_embeddings=True`: they always
    counted one vocab x hidden matrix, and recorded results depend on that (llama-7b's real
    checkpoint is untied: 0.26 GB more weights than priced, < 0.4% of an H100's KV pool).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    num_experts: int = 0  # 0: dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_moe_layers: int = 0  # layers whose MLP is the experts (the rest are dense)
    sliding_window: Optional[int] = None  # tokens each query attends, None: all
    qkv_bias: bool = False
    qk_norm: bool = False
    source: str = ""  # where the sizes come from (model card, config.json)

    # ---- parameters per part (matmul weights; norms and biases only in the totals) ----
    @property
    def attention_params_per_layer(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        return h * self.num_heads * hd * 2 + h * self.num_kv_heads * hd * 2  # q, o, k, v

    @property
    def expert_params(self) -> int:
        """One SwiGLU expert: gate, up, down."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def params_per_layer(self) -> int:
        """A dense layer's matmul weights: attention and the SwiGLU MLP."""
        return self.attention_params_per_layer + 3 * self.hidden_size * self.intermediate_size

    @property
    def moe_shared_params_per_layer(self) -> int:
        """What every token of an MoE layer runs besides its chosen experts: the router and the
        shared expert (with its one-row gate when there is one)."""
        h, shared = self.hidden_size, self.shared_expert_intermediate_size
        return h * self.num_experts + (3 * h * shared + h if shared else 0)

    @property
    def dense_matmul_params(self) -> int:
        """Weights every step reads whatever it routes: attention of every layer, dense MLPs,
        routers and shared experts, and the LM head."""
        return (self.num_layers * self.attention_params_per_layer
                + self.num_dense_layers * 3 * self.hidden_size * self.intermediate_size
                + self.num_moe_layers * self.moe_shared_params_per_layer
                + self.vocab_size * self.hidden_size)

    @property
    def num_matmul_params(self) -> int:
        """Every matmul weight: all layers (every expert) plus the LM head."""
        return (self.dense_matmul_params
                + self.num_moe_layers * self.num_experts * self.expert_params)

    @property
    def active_layer_params_per_token(self) -> int:
        """Matmul weights one token multiplies through in the layers (LM head apart)."""
        return (self.dense_matmul_params - self.vocab_size * self.hidden_size
                + self.num_moe_layers * self.num_experts_per_tok * self.expert_params)

    @property
    def num_weight_params(self) -> int:
        """Weights held in memory: every matmul weight, plus the input embedding if untied."""
        return self.num_matmul_params + (0 if self.tie_word_embeddings
                                         else self.vocab_size * self.hidden_size)

    def _small_params(self) -> int:
        """Norms (two per layer, a final one, q/k norms) and q/k/v biases."""
        per_layer = 2 * self.hidden_size
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.qkv_bias:
            per_layer += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return self.num_layers * per_layer + self.hidden_size

    @property
    def num_params(self) -> int:
        """Total parameters as model cards count them (embeddings once when tied)."""
        return self.num_weight_params + self._small_params()

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses (model cards' "active"/"activated" figure): the layers'
        active weights, embedding and LM head (once when tied), norms and biases."""
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.active_layer_params_per_token + embed + self._small_params()

    def expected_experts_touched(self, num_tokens: int) -> float:
        """Distinct experts of one MoE layer that a step of `num_tokens` tokens runs, in
        expectation, when each token picks `num_experts_per_tok` distinct experts uniformly:
        E * (1 - (1 - k/E) ** B). Never above min(E, B * k): 1 token touches k, many tokens
        all E. (Real routers are skewed: this is the balanced case the load-balancing loss
        aims at.)"""
        e, k = self.num_experts, self.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** num_tokens) if e else 0.0

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


MODEL_SHAPES: dict[str, ModelShape] = {
    "smollm2-135m": ModelShape("smollm2-135m", num_layers=30, hidden_size=576, num_heads=9,
                               num_kv_heads=3, head_dim=64, intermediate_size=1536,
                               vocab_size=49152, max_position_embeddings=8192),
    "llama-7b": ModelShape("llama-7b", num_layers=32, hidden_size=4096, num_heads=32,
                           num_kv_heads=32, head_dim=128, intermediate_size=11008,
                           vocab_size=32000, max_position_embeddings=4096),
}
