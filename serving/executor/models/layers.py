"""Building blocks of Llama-family decoders, on top of `kernels` ops, tensor-parallel aware.

Every layer takes the `TPShard` of this process (default: single process, `TPShard(0, 1)`) and
holds only its slice (`serving/executor/parallel.py` says how shapes split):
- `ColumnParallelLinear` / `PackedColumnParallelLinear`: output rows split, no communication
  (qkv_proj holds this rank's query heads and its KV heads; gate_up_proj its MLP columns);
- `RowParallelLinear`: input columns split, partial outputs summed with one all-reduce
  (o_proj, down_proj; a bias is added by rank 0 only, so once);
- `VocabParallelEmbedding` / `ParallelLMHead`: vocab rows split; the embedding zeroes ids
  outside this rank's rows and all-reduces, the head all-gathers full-vocab float32 logits.
With one rank every layer runs exactly the single-process ops (no collective, no masking).

Parameters carry a `weight_loader(param, loaded, shard_id)` that `serving/executor/weights.py`
calls with a checkpoint tensor or a lazy safetensors slice (`get_slice`): a loader indexes only
the rows/columns its rank holds, so a rank never reads a whole sharded tensor. Packed
parameters are filled from separate HF tensors (q|k|v -> qkv_proj, gate|up -> gate_up_proj,
`shard_id` = the part) or from a checkpoint that is already fused (Phi-3, `shard_id` None).
Parameters that hold a per-rank slice are marked `tp_sharded = True` (for dummy weights).
Quantized layers: a linear layer built with a `LinearMethod` (`serving/executor/quant/`) lets it
create, load and apply its checkpoint tensors (qweight/scales/..., each loaded by this rank's
slice as its `LinearSpec` says); without one the layer is the plain float path, unchanged.
`PagedAttention` writes this step's K/V into the paged cache, then runs decode attention for the
leading one-token sequences and prefill attention for the rest, as described by the ambient
`AttentionMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from serving.executor import parallel
from serving.executor.attention_metadata import get_attention_metadata
from serving.executor.parallel import TPShard, attention_shard, vocab_per_rank
from serving.executor.quant import LinearMethod, LinearSpec, linear_method
from serving.checkpoint.model_config import ModelArgs
from serving.checkpoint.quantization import QuantConfig

SINGLE = TPShard()  # one process holds everything


class TensorSlice(Protocol):
    """A lazily read checkpoint tensor (safetensors `safe_open(...).get_slice(name)`)."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: object) -> torch.Tensor: ...


Loaded = torch.Tensor | TensorSlice


def checkpoint_shape(loaded: Loaded) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def read_checkpoint(loaded: Loaded, dim: int = 0, start: int = 0, size: int | None = None) -> torch.Tensor:
    """Elements [start, start + size) of `loaded` along `dim` (all when size is None); only those are read."""
    if size is None:
        return loaded if isinstance(loaded, torch.Tensor) else loaded[:]
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    return loaded[(slice(None),) * dim + (slice(start, start + size),)]


def _check_shape(loaded: Loaded, expected: tuple[int, ...], what: str = "parameter") -> None:
    if checkpoint_shape(loaded) != expected:
        raise ValueError(f"checkpoint tensor shape {checkpoint_shape(loaded)} != {what} shape {expected}")


def _param(*shape: int) -> nn.Parameter:
    # Device and dtype come from the construction context (see models.build_model).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _mark_sharded(sharded: bool, *params: nn.Parameter | None) -> None:
    for p in params:
        if p is not None:
            p.tp_sharded = sharded


def default_weight_loader(param: torch.Tensor, loaded: Loaded, shard_id: object = None) -> None:
    """Copy a whole checkpoint tensor into `param` (replicated parameters; shapes must match)."""
    assert shard_id is None, f"unexpected shard {shard_id!r} for an unpacked parameter"
    _check_shape(loaded, tuple(param.shape))
    param.data.copy_(read_checkpoint(loaded))


class Linear(nn.Module):
    """y = x W^T (+ b), W stored [out_features, in_features] as in HF; replicated on every rank.

    With a `quant_method` (and the layer's `spec`), the method creates the weight tensors instead.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_method: LinearMethod | None = None, spec: LinearSpec | None = None) -> None:
        super().__init__()
        self.quant_method = quant_method
        if quant_method is not None and quant_method.creates_weights:
            quant_method.create_weights(self, spec or LinearSpec(in_features, 0, in_features,
                                                                 {"": even_part(out_features, SINGLE)},
                                                                 {"": (0, out_features)}))
        else:
            self.weight = _param(out_features, in_features)
            self.weight.weight_loader = self.weight_loader
        self.bias = _param(out_features) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: Loaded, shard_id: object = None) -> None:
        default_weight_loader(param, loaded, shard_id)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is None:
            return F.linear(x, self.weight, bias)
        return self.quant_method.apply(self, x, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


@dataclass(frozen=True)
class OutputPart:
    """The output rows [start, start + size) that this rank holds of a projection with `full` rows."""

    full: int
    start: int
    size: int


def even_part(full: int, shard: TPShard) -> OutputPart:
    """This rank's even share of `full` output rows."""
    start, size = shard.split(full)
    return OutputPart(full, start, size)


class ColumnParallelLinear(Linear):
    """Output dim split over ranks: y_local = x W_local^T (+ b_local), no communication.

    `parts` (used by `PackedColumnParallelLinear`) stacks several checkpoint projections along the
    output dim, each contributing the rows of its `OutputPart`; `shard_offsets[name]` is where a
    part's rows sit in this rank's weight.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, shard: TPShard = SINGLE,
        *, parts: dict[str, OutputPart] | None = None, quant_method: LinearMethod | None = None, name: str = "",
    ) -> None:
        parts = parts if parts is not None else {"": even_part(out_features, shard)}
        assert sum(p.full for p in parts.values()) == out_features
        offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for part_name, part in parts.items():
            offsets[part_name] = (offset, part.size)
            offset += part.size
        spec = LinearSpec(in_features, 0, in_features, parts, offsets, name)
        super().__init__(in_features, offset, bias, quant_method, spec)
        self.parts = parts
        self.shard_offsets = offsets
        _mark_sharded(any(p.size != p.full for p in parts.values()), getattr(self, "weight", None), self.bias)

    def weight_loader(self, param: torch.Tensor, loaded: Loaded, shard_id: object = None) -> None:
        """`shard_id` None: the whole (possibly fused, parts in order) tensor; else that part alone."""
        if shard_id is None:
            names = list(self.parts)
        elif str(shard_id) in self.parts:
            names = [str(shard_id)]
        else:
            raise ValueError(f"unknown shard {shard_id!r} (parts: {list(self.parts)})")
        _check_shape(loaded, (sum(self.parts[n].full for n in names), *param.shape[1:]),
                     "parameter" if shard_id is None else f"shard {shard_id!r}")
        row = 0  # where this part starts in the checkpoint tensor
        for name in names:
            part, (offset, size) = self.parts[name], self.shard_offsets[name]
            param.data.narrow(0, offset, size).copy_(read_checkpoint(loaded, 0, row + part.start, size))
            row += part.full


class PackedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one GEMM (q|k|v, gate|up), one `OutputPart` each.

    A checkpoint may hold the parts separately (q_proj/k_proj/v_proj, loaded with shard_id = the
    part's name) or already fused in `parts` order (Phi-3's qkv_proj, shard_id None).
    """

    def __init__(self, in_features: int, parts: dict[str, OutputPart], bias: bool = False,
                 quant_method: LinearMethod | None = None, name: str = "") -> None:
        super().__init__(in_features, sum(p.full for p in parts.values()), bias, parts=parts,
                         quant_method=quant_method, name=name)


class RowParallelLinear(Linear):
    """Input dim split over ranks: y = all_reduce(x_local W_local^T) (+ b, added by rank 0 only)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, shard: TPShard = SINGLE,
                 in_part: tuple[int, int] | None = None, quant_method: LinearMethod | None = None,
                 name: str = "", reduce: bool = True) -> None:
        """`in_part` = (start, size) of this rank's input columns when not an even split (o_proj
        under an uneven head split). `reduce=False`: return this rank's partial sum; the caller
        all-reduces it with others (the experts of an MoE block: one all-reduce for all of them)."""
        in_start, size = in_part if in_part is not None else shard.split(in_features)
        spec = LinearSpec(in_features, in_start, size, {"": OutputPart(out_features, 0, out_features)},
                          {"": (0, out_features)}, name)
        super().__init__(size, out_features, bias, quant_method, spec)
        self.in_start, self.full_in_features = in_start, in_features
        assert reduce or not bias or shard.world_size == 1, "a partial sum with a bias would add it on every rank"
        self.reduce = reduce and shard.world_size > 1
        self.bias_rank = shard.rank == 0
        _mark_sharded(shard.world_size > 1, getattr(self, "weight", None))

    def weight_loader(self, param: torch.Tensor, loaded: Loaded, shard_id: object = None) -> None:
        if param.dim() == 1:  # the bias: replicated
            default_weight_loader(param, loaded, shard_id)
            return
        assert shard_id is None, f"unexpected shard {shard_id!r} for a row-parallel parameter"
        _check_shape(loaded, (param.shape[0], self.full_in_features))
        param.data.copy_(read_checkpoint(loaded, 1, self.in_start, param.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce:
            return self._linear(x, self.bias)
        return parallel.all_reduce(self._linear(x, self.bias if self.bias_rank else None))


class VocabParallelEmbedding(nn.Module):
    """Token embedding [vocab, hidden] (HF `embed_tokens`), rows split over ranks.

    Rank r holds rows [r * n, (r + 1) * n) with n = ceil(vocab / tp); rows past the vocab are
    zero padding. `compute_logits` uses the same rows as an LM head (tied embeddings).
    """

    def __init__(self, vocab_size: int, hidden_size: int, shard: TPShard = SINGLE) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, shard.world_size
        self.num_rows = vocab_per_rank(vocab_size, self.tp)
        self.vocab_start = shard.rank * self.num_rows
        self.num_valid = max(0, min(self.num_rows, vocab_size - self.vocab_start))
        self.weight = _param(self.num_rows, hidden_size)
        self.weight.weight_loader = self.weight_loader
        _mark_sharded(self.tp > 1, self.weight)

    def weight_loader(self, param: torch.Tensor, loaded: Loaded, shard_id: object = None) -> None:
        assert shard_id is None, f"unexpected shard {shard_id!r} for a vocab-parallel parameter"
        _check_shape(loaded, (self.vocab_size, param.shape[1]))
        param.data[: self.num_valid].copy_(read_checkpoint(loaded, 0, self.vocab_start, self.num_valid))
        param.data[self.num_valid :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return parallel.all_reduce(out)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, the full vocab on every rank; written into `out`
        ([N, vocab]) when given. An `out` of the weights' dtype on one rank is the matmul's own
        output (no copy: the decode graphs' static logits; a float32 copy of 256 rows of 128,256
        cost 54 µs a step on an H100, and the samplers upcast exactly what they read)."""
        if out is not None and self.tp == 1 and out.dtype == self.weight.dtype and hidden.dim() == 2:
            return torch.mm(hidden, self.weight.t(), out=out)
        logits = F.linear(hidden, self.weight)
        if self.tp > 1:
            logits = parallel.all_gather_last_dim(logits)[..., : self.vocab_size]
        if out is not None:
            return out.copy_(logits)
        return logits.float() if self.tp == 1 else logits.float().contiguous()


class ParallelLMHead(VocabParallelEmbedding):
    """The untied LM head (HF `lm_head`): `forward(hidden)` is `compute_logits(hidden)`. `bias`: a
    full-vocab bias (Phi's), replicated, added to the gathered logits."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: TPShard = SINGLE, bias: bool = False) -> None:
        super().__init__(vocab_size, hidden_size, shard)
        self.bias = _param(vocab_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().compute_logits(hidden, out)
        return logits if self.bias is None else logits.add_(self.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)


class RMSNorm(nn.Module):
    """RMSNorm with optional fused residual add (kernels.rms_norm); replicated. `unit_offset`:
    Gemma's norm (the weight stored as w - 1, applied in float32 before the cast)."""

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = _param(hidden_size)
        self.weight.weight_loader = default_weight_loader
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return kernels.rms_norm(x, self.weight, self.eps, residual, self.unit_offset)

    def add_and_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's input norm with the residual stream carried fused: (normed, residual). The first
        block has no residual yet: its input becomes it."""
        if residual is None:
            return self(hidden), hidden
        return self(hidden, residual)


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
        return self.o_proj(self.attend(self.project(positions, hidden)))

    def project(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """qkv -> RoPE -> this step's K/V into the cache; returns q `[T, num_heads, head_dim]`.

        Its launches depend only on the token count."""
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
        if self.use_rope:  # RoPE on q and k (in place: views of qkv), then k and v into the cache: one launch
            kernels.rotary_and_write_kv(positions, q, k, v, self.cos_sin_cache, self.head_dim, self.k_cache,
                                        self.v_cache, meta.slot_mapping)
        else:
            kernels.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return q.view(num_tokens, self.num_heads, self.head_dim)

    def attend(self, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of `q` `[T, H, D]` over the paged cache, as the ambient metadata describes;
        returns `[T, H * D]` (the input of o_proj). Its launches depend on the batch's make-up.

        `out` (`[T, H * D]`, contiguous rows): the kernels write it directly, the decode rows and
        the prompt rows each their own part, with no temporary and no copy.

        In a mixed-step graph (`meta.mixed`) one fixed-grid launch serves every row, so the whole
        step can be captured (`serving/executor/mixed_graphs.py`)."""
        meta = get_attention_metadata()
        num_tokens = q.shape[0]
        nd = meta.num_decode_tokens
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
                window=self.window, softcap=self.softcap,
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


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), gate|up packed as gate_up_proj (this rank's columns);
    `activation="gelu_pytorch_tanh"`: GeGLU, gelu (tanh approximation) in place of silu (Gemma).
    `reduce=False`: under tensor parallelism, this rank's partial output (an MoE expert's)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, shard: TPShard = SINGLE,
                 quant: QuantConfig | None = None, prefix: str = "mlp", activation: str = "silu",
                 reduce: bool = True) -> None:
        super().__init__()
        assert activation in ("silu", "gelu_pytorch_tanh"), activation
        self.activation = activation
        part = even_part(intermediate_size, shard)
        gate_up = linear_method(quant, f"{prefix}.gate_proj", f"{prefix}.up_proj")
        self.gate_up_proj = PackedColumnParallelLinear(hidden_size, {"0": part, "1": part}, bias, gate_up,
                                                       f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, shard,
                                           quant_method=linear_method(quant, f"{prefix}.down_proj"),
                                           name=f"{prefix}.down_proj", reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation == "silu":
            return self.down_proj(kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
