"""`PagedAttention`: a decoder layer's self-attention over the paged KV cache.

It writes this step's K/V into the paged cache, then runs decode attention for the leading
one-token sequences and prefill attention for the rest, as the ambient `AttentionMetadata` describes.
Its q/k/v projection is one packed column-parallel GEMM of this rank's heads, its o_proj row-parallel.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from serving.executor.attention_metadata import get_attention_metadata
from serving.executor.models.linear import OutputPart, PackedColumnParallelLinear, RowParallelLinear
from serving.executor.models.norm import RMSNorm
from serving.executor.models.params import SINGLE
from serving.executor.parallel import TPShard, attention_shard
from serving.executor.quant import linear_method
from serving.checkpoint.model_args import ModelArgs
from serving.checkpoint.quantization import QuantConfig

class PagedAttention(nn.Module):
    """Self-attention over the paged KV cache: qkv -> RoPE -> write cache -> attend -> o_proj.

    `num_heads` / `num_kv_heads` are the model's; the layer keeps this rank's share in the
    attributes of the same names (`parallel.attention_shard`). `k_cache` / `v_cache` are views
    into the runner's single KV allocation, set with `bind_kv_cache`; shape
    [num_blocks, block_size, self.num_kv_heads, head_dim]. With `qk_norm_eps` (Qwen3, Gemma 3) each head
    of q and k is RMS-normalised over head_dim before RoPE (`q_norm` / `k_norm`, of `qk_norm_class`,
    replicated on every rank);
    `use_rope=False` (SmolLM3's NoPE layers) stores K/V unrotated; `scale` replaces head_dim ** -0.5
    as the softmax scale (Granite's attention_multiplier); `sliding_window` W: each query attends to
    the W positions ending at its own (Mistral, Qwen2 with use_sliding_window, Gemma); `softcap` c:
    scores capped as c * tanh(s / c) before the softmax (Gemma 2).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        shard: TPShard = SINGLE,
        quant: QuantConfig | None = None,
        prefix: str = "self_attn",
        qk_norm_eps: float | None = None,
        qk_norm_class: type[nn.Module] | None = None,
        use_rope: bool = True,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        heads = attention_shard(num_heads, num_kv_heads, shard)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.use_rope = use_rope
        self.window = sliding_window or 0  # > 0: each query sees its last `window` positions
        self.softcap = softcap or 0.0  # > 0: scores capped as c * tanh(s / c) (Gemma 2)
        kv_part = OutputPart(num_kv_heads * head_dim, heads.kv_head_start * head_dim, self.kv_size)
        parts = {"q": OutputPart(num_heads * head_dim, heads.q_head_start * head_dim, self.q_size),
                 "k": kv_part, "v": kv_part}
        qkv = [f"{prefix}.{p}_proj" for p in "qkv"]
        self.qkv_proj = PackedColumnParallelLinear(hidden_size, parts, qkv_bias, linear_method(quant, *qkv),
                                                   f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, o_bias, shard,
                                        in_part=(heads.q_head_start * head_dim, self.q_size),
                                        quant_method=linear_method(quant, f"{prefix}.o_proj"), name=f"{prefix}.o_proj")
        self.q_norm = self.k_norm = None
        self.qk_norm_per_head = True  # False: q_norm / k_norm see this rank's whole q / k rows (OLMo's)
        if qk_norm_eps is not None:
            norm = qk_norm_class or RMSNorm
            self.q_norm, self.k_norm = norm(head_dim, qk_norm_eps), norm(head_dim, qk_norm_eps)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.cos_sin_cache = torch.empty(0)  # shared, set by the model

    @classmethod
    def of_model(cls, args: ModelArgs, shard: TPShard, quant: QuantConfig | None, prefix: str,
                 **options: object) -> PagedAttention:
        """The self-attention of decoder layer `prefix` of a model of `args` (its heads and biases),
        with that architecture's `options` (window, scale, q/k norms, ...)."""
        return cls(args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                   qkv_bias=args.qkv_bias, o_bias=args.o_bias, shard=shard, quant=quant, prefix=f"{prefix}.self_attn",
                   **options)

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(*self.project(positions, hidden)))

    def project(self, positions: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, kernels.DecodeRope | None]:
        """qkv -> RoPE -> this step's K/V into the cache; returns (q `[T, num_heads, head_dim]`, None).

        In a step of decode rows only, RoPE and the K/V write are left to the decode attention
        (`kernels/decode_rope.py`: one launch less a layer): returns q not yet rotated and the
        `DecodeRope` that `attend` hands on. Its launches depend only on the token count and the step's kind."""
        meta = get_attention_metadata()
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.qk_norm_per_head:  # over head_dim: rows of head_dim (new tensors)
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.q_size)
            k = self.k_norm(k.reshape(-1, self.head_dim))
        elif self.q_norm is not None:  # over all of the projection's heads
            q, k = self.q_norm(q), self.k_norm(k)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q3 = q.view(num_tokens, self.num_heads, self.head_dim)
        if self.use_rope and meta.num_prefills == 0 and not meta.mixed:  # decode rows: the attention does both
            return q3, kernels.DecodeRope(positions, k, v, self.cos_sin_cache, meta.slot_mapping)
        if self.use_rope:  # RoPE on q and k (in place: views of qkv), then k and v into the cache: one launch
            kernels.rotary_and_write_kv(positions, q, k, v, self.cos_sin_cache, self.head_dim, self.k_cache,
                                        self.v_cache, meta.slot_mapping)
        else:
            kernels.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return q3, None

    def attend(self, q: torch.Tensor, rope: kernels.DecodeRope | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of `q` `[T, H, D]` over the paged cache, as the ambient metadata describes;
        returns `[T, H * D]` (the input of o_proj). Its launches depend on the batch's make-up.
        `rope`: `project`'s, for a step of decode rows (the decode attention rotates q and stores K/V).

        `out` (`[T, H * D]`, contiguous rows): the kernels write it directly, the decode rows and
        the prompt rows each their own part, with no temporary and no copy.

        In a mixed-step graph (`meta.mixed`) one fixed-grid launch serves every row, so the whole
        step can be captured (`serving/executor/mixed_graphs.py`)."""
        meta = get_attention_metadata()
        num_tokens = q.shape[0]
        nd = meta.num_decode_tokens
        assert rope is None or (meta.num_prefills == 0 and not meta.mixed), "RoPE left to a step with prompt rows"
        if out is None:
            out = torch.empty_like(q)  # [T, H, D]
        else:
            assert out.shape == (num_tokens, self.q_size), (out.shape, num_tokens, self.q_size)
            out = out.view(num_tokens, self.num_heads, self.head_dim)
        if meta.mixed:
            kernels.mixed_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.query_start_loc,
                                    meta.seq_lens, self.scale, out=out, window=self.window, softcap=self.softcap)
        elif meta.num_prefills == 0:
            kernels.paged_decode_attention(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, self.scale, out=out,
                window=self.window, softcap=self.softcap, rope=rope,
            )
        elif nd == 0:
            kernels.prefill_attention(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.query_start_loc,
                meta.seq_lens, meta.max_query_len, self.scale, out=out, window=self.window, softcap=self.softcap,
            )
        else:
            kernels.paged_decode_attention(
                q[:nd], self.k_cache, self.v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], self.scale,
                out=out[:nd], window=self.window, softcap=self.softcap,
            )
            block_tables, query_start_loc, seq_lens = meta.prefill_part()  # rows right after the decodes
            kernels.prefill_attention(
                q[nd:], self.k_cache, self.v_cache, block_tables, query_start_loc, seq_lens,
                meta.max_query_len, self.scale, out=out[nd:], window=self.window, softcap=self.softcap,
            )
        return out.view(num_tokens, self.q_size)
