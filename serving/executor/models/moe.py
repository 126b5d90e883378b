"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) with HF parameter names.

A router (`gate`, replicated) scores each token against every expert; the token goes to its
`top_k` experts, each a SwiGLU `GatedMLP`, and their outputs are summed, weighted by the
softmax probabilities of the chosen experts (renormalised over them when `norm_topk_prob`).
Qwen2-MoE adds a shared expert that every token passes through, scaled by
sigmoid(`shared_expert_gate`(x)).

Tensor parallel: every expert (and the shared one) splits its intermediate dim over the ranks,
as a dense MLP does, but their down projections skip their own all-reduce: the block sums its
experts' partial outputs on each rank and all-reduces once.

Three ways to run the experts, with the same result; what each reads of the experts' weights
decides which runs (a decode step is bound by those reads):
- picked (fewer picks than experts, T * top_k < num_experts: small decode batches, eager or in a
  CUDA graph): each (token, choice) multiplies by its own expert's matrices, gathered from the
  experts' weights stacked in one tensor; it reads only the chosen experts. Unquantized experts only;
- grouped (other eager steps): tokens sorted by expert, each expert runs on its own rows (the
  count per expert is read on the host, which a CUDA graph cannot do);
- dense (other steps inside a CUDA graph capture): every expert runs on every row, weighted 0
  where it was not chosen. With at least as many picks as experts most experts are chosen anyway,
  so it reads about what grouped reads, for num_experts / top_k times the FLOPs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from serving.executor import parallel
from serving.executor.models.linear import Linear
from serving.executor.models.mlp import GatedMLP
from serving.executor.parallel import TPShard
from serving.checkpoint.model_config import ModelArgs
from serving.checkpoint.quantization import QuantConfig


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one decoder layer: `forward(x [T, hidden]) -> [T, hidden]` (all-reduced)."""

    def __init__(self, args: ModelArgs, shard: TPShard, quant: QuantConfig | None = None, prefix: str = "mlp") -> None:
        super().__init__()
        assert args.num_experts > 0 and 0 < args.num_experts_per_tok <= args.num_experts, args
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.combine_fp32 = args.moe_combine_fp32
        self.reduce = shard.world_size > 1
        self.gate = Linear(args.hidden_size, args.num_experts)  # the router: replicated, never quantized
        self.experts = nn.ModuleList(
            GatedMLP(args.hidden_size, args.moe_intermediate_size, False, shard, quant, f"{prefix}.experts.{e}",
                     activation=args.hidden_act, reduce=False)
            for e in range(args.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if args.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(args.hidden_size, args.shared_expert_intermediate_size, False, shard, quant,
                                          f"{prefix}.shared_expert", activation=args.hidden_act, reduce=False)
            self.shared_expert_gate = Linear(args.hidden_size, 1)
        self.w13 = self.w2 = None  # [E, 2 * I, hidden], [E, hidden, I]: every expert's weights, stacked
        if args.hidden_act == "silu" and self.experts[0].gate_up_proj.quant_method is None:
            self.w13, self.w2 = self._stack_expert_weights()
        self.force_path: str | None = None  # tests: "picked", "grouped" or "dense" whatever the step

    def _stack_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Re-home each expert's two weights as views of one stacked tensor each (no copy: the
        loaders and the dummy fill write the stack through the views), for the picked path."""
        stacks = []
        for name in ("gate_up_proj", "down_proj"):
            first = getattr(self.experts[0], name).weight
            stack = torch.empty(len(self.experts), *first.shape, dtype=first.dtype, device=first.device)
            for e, expert in enumerate(self.experts):
                linear = getattr(expert, name)
                view = nn.Parameter(stack[e], requires_grad=False)
                view.weight_loader = linear.weight.weight_loader
                view.tp_sharded = getattr(linear.weight, "tp_sharded", False)
                linear.weight = view
            stacks.append(stack)
        return stacks[0], stacks[1]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k], expert ids [T, top_k]): softmax in float32 over all experts, top-k,
        renormalised over the k when `norm_topk_prob`; float32 (Mixtral) or the model dtype (Qwen)."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.combine_fp32 else weights.to(x.dtype)), ids

    def path(self, x: torch.Tensor) -> str:
        """Which way this step runs the experts (see the module docstring)."""
        if self.force_path is not None:
            return self.force_path
        if self.w13 is not None and x.shape[0] * self.top_k < len(self.experts):
            return "picked"
        return "dense" if x.is_cuda and torch.cuda.is_current_stream_capturing() else "grouped"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = getattr(self, f"_{self.path(x)}")(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return parallel.all_reduce(out) if self.reduce else out

    def _weighted(self, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # Mixtral multiplies the expert output by float32 weights and rounds the product once
        return (y.float() * w).to(y.dtype) if self.combine_fp32 else y * w

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        flat = ids.flatten()  # [T * top_k]: choice j of token t at t * top_k + j
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # the host read graphs avoid
        tokens = order // self.top_k
        flat_weights = weights.flatten()
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                rows, picks = tokens[start:start + n], order[start:start + n]
                out.index_add_(0, rows, self._weighted(expert(x[rows]), flat_weights[picks, None]))
            start += n
        return out

    def _picked(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # each token's choices in expert order, so the sum runs in the order the other paths add in
        ids, order = torch.sort(ids, dim=-1)
        weights = torch.gather(weights, 1, order)
        rows = x.repeat_interleave(self.top_k, dim=0).unsqueeze(-1)  # [T * top_k, hidden, 1]
        flat = ids.flatten()
        gate_up = torch.bmm(self.w13[flat], rows).squeeze(-1)  # [T * top_k, 2 * I]
        y = torch.bmm(self.w2[flat], kernels.silu_and_mul(gate_up).unsqueeze(-1)).squeeze(-1)  # [T * top_k, hidden]
        y = self._weighted(y, weights.reshape(-1, 1)).view(x.shape[0], self.top_k, -1)
        out = torch.zeros_like(x)
        for j in range(self.top_k):
            out += y[:, j]
        return out

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        per_expert = torch.zeros(x.shape[0], len(self.experts), dtype=weights.dtype, device=x.device)
        per_expert.scatter_(1, ids, weights)  # [T, E]: 0 where the expert was not chosen
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out += self._weighted(expert(x), per_expert[:, e:e + 1])
        return out


def mixtral_checkpoint_name(name: str) -> str:
    """Mixtral's checkpoint names in ours: `block_sparse_moe` is the layer's `mlp`; each expert's
    w1 / w3 / w2 are its gate / up / down projections."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    for hf, ours in ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
        name = name.replace(hf, ours)
    return name
