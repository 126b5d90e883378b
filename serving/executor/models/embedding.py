"""The token embedding and the LM head, vocab rows split over the ranks: the embedding zeroes ids
outside this rank's rows and all-reduces, the head all-gathers full-vocab float32 logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from serving.executor import parallel
from serving.executor.models import params
from serving.executor.models.params import SINGLE, Loaded
from serving.executor.parallel import TPShard, vocab_per_rank

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
        self.weight = params.new_param(self.num_rows, hidden_size)
        self.weight.weight_loader = self.weight_loader
        params.mark_sharded(self.tp > 1, self.weight)

    def weight_loader(self, param: torch.Tensor, loaded: Loaded, shard_id: object = None) -> None:
        assert shard_id is None, f"unexpected shard {shard_id!r} for a vocab-parallel parameter"
        params.check_shape(loaded, (self.vocab_size, param.shape[1]))
        param.data[: self.num_valid].copy_(params.read_checkpoint(loaded, 0, self.vocab_start, self.num_valid))
        param.data[self.num_valid :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.partial(input_ids)
        return parallel.all_reduce(out) if self.tp > 1 else out

    def partial(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the lookup (zeros for ids outside them): `forward` before its
        all-reduce, for a caller that sums it itself (fused with the first layer's norm)."""
        if self.tp == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return out

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, the full vocab on every rank; written into `out`
        ([N, vocab]) when given. An `out` of the weights' dtype on one rank is the matmul's own
        output (no copy: the decode graphs' static logits; a float32 copy of 256 rows of 128,256
        cost 54 µs a step on an H100, and the samplers upcast exactly what they read)."""
        assert out is None or out.shape[0] == hidden.shape[0], f"logits out= has {out.shape[0]} rows for {hidden.shape[0]}"
        w = self.weight
        if (hidden.is_cuda and hidden.dim() == 2 and hidden.dtype == w.dtype
                and kernels.use_skinny(hidden.shape[0], w.shape[0], w.shape[1], w.dtype, hidden.device)):
            logits = kernels.skinny_linear(hidden, w)  # decode rows: the bandwidth-bound GEMV (bf16 at 1-2 rows)
            if out is not None and self.tp == 1 and out.dtype == w.dtype:
                return out.copy_(logits)
        elif out is not None and self.tp == 1 and out.dtype == w.dtype and hidden.dim() == 2:
            return torch.mm(hidden, w.t(), out=out)
        else:
            logits = F.linear(hidden, w)
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
        self.bias = params.new_param(vocab_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = params.default_weight_loader

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().compute_logits(hidden, out)
        return logits if self.bias is None else logits.add_(self.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
