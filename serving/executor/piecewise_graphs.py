"""Piecewise CUDA graphs: steps that carry prompt tokens replay graphs too, with attention eager.

Why: a decode-only step replays one whole-model graph (`cuda_graphs.py`), but a step that also
carries a prompt chunk used to run eagerly: ~500 kernel launches for a 32-layer model, about
9 ms of host time on the 8B shape (RESULTS run 6: eager 14.3 ms against 5.0 ms with graphs at
batch 1). While serving, every arriving prompt made one such step, which is what the ITL p99
(~41 ms against a 6 ms p50, run 11) and part of the TTFT tail measured.

What: the model's forward is cut at each layer's attention (`LlamaModel.piece`): everything
between two attentions (norms, projections, RoPE, the KV write, o_proj, the MLP and their
all-reduces) launches the same kernels for a given token count, so it is captured once per
token bucket; attention, whose launches depend on how many rows decode and how the prompt
chunks are laid out, runs eagerly between the replays (2 to 4 launches a layer). A step with n
tokens replays the smallest bucket >= n; its padded rows get slot -1 (no KV write) and their
outputs are never read. Steps larger than the largest bucket (long prefills, where launch cost
is small beside the compute) stay eager.

Buffers every graph reads or writes (one set, sliced per bucket): the step's ids, positions
and slot mapping; `q` (each piece's attention input) and `attn` (each attention's output);
`residual` and `hidden` (the last piece's output). Graphs share one memory pool: their
temporaries are freed at the end of each capture and never outlive a replay. Per-forward state
that layers read (the LoRA manager's rows grouped by adapter slot) comes from a `scope` wrapped
around every piece, so each piece's graph recomputes it on the device from the staged slots.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable
from typing import ContextManager

import torch
from torch import nn

from serving.executor.attention_metadata import AttentionMetadata, forward_context

logger = logging.getLogger(__name__)

# Steps of a few dozen decodes plus a prompt chunk of up to 256 tokens (the server's cap on prompt
# tokens while streams decode) land in 160-288: steps of 32 there, so the padding's compute stays
# under ~12 % where a step's length is what the inter-token tail measures.
_BUCKETS = (16, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048)


def piecewise_buckets(max_tokens: int) -> list[int]:
    """Token buckets up to `max_tokens` (itself the last when it is not one of them)."""
    sizes = [b for b in _BUCKETS if b < max_tokens]
    sizes.append(max_tokens)
    return sizes


class PiecewiseGraphRunner:
    """One captured graph per (token bucket, piece); `run` interleaves them with eager attention."""

    def __init__(self, model: nn.Module, max_tokens: int, device: torch.device,
                 scope: Callable[[int], ContextManager[None]] | None = None) -> None:
        """`scope(num_tokens)`, when given, wraps every piece (captured with it): per-forward state
        the layers read, such as the LoRA manager's grouping of rows by adapter slot."""
        body = model.model  # LlamaModel: `piece`, `num_pieces`, `layers`
        self.body = body
        self.attention = [layer.self_attn for layer in body.layers]
        self.buckets = piecewise_buckets(max_tokens)
        n = self.buckets[-1]
        attn0 = self.attention[0]
        hidden_size = body.norm.weight.shape[0]
        dtype = body.norm.weight.dtype
        with torch.device(device):
            self.input_ids = torch.zeros(n, dtype=torch.int64)
            self.positions = torch.zeros(n, dtype=torch.int64)
            self.slot_mapping = torch.full((n,), -1, dtype=torch.int64)
            self.q = torch.zeros(n, attn0.num_heads, attn0.head_dim, dtype=dtype)
            self.attn = torch.zeros(n, attn0.q_size, dtype=dtype)
            self.residual = torch.zeros(n, hidden_size, dtype=dtype)
            self.hidden = torch.zeros(n, hidden_size, dtype=dtype)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = None  # the graphs' shared memory pool, set by the first capture
        self.scope = scope or (lambda _t: contextlib.nullcontext())

    def _meta(self, t: int) -> AttentionMetadata:
        """What the captured pieces read from the metadata: the slot mapping (the KV write)."""
        empty = torch.zeros(0, dtype=torch.int32, device=self.slot_mapping.device)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t], query_start_loc=torch.zeros(1, dtype=torch.int32,
                                                                            device=empty.device),
            seq_lens=empty, block_tables=empty.view(0, 1), num_decodes=0, num_decode_tokens=0,
            max_query_len=0, max_seq_len=0,
        )

    def _piece(self, i: int, t: int) -> None:
        """Piece i on the first t rows of the buffers, results copied back into them."""
        last = i == self.body.num_pieces - 1
        with self.scope(t):
            out, residual = self.body.piece(
                i, self.input_ids[:t], self.positions[:t], None if i == 0 else self.attn[:t],
                None if i == 0 else self.residual[:t],
            )
        (self.hidden if last else self.q)[:t].copy_(out)
        self.residual[:t].copy_(residual)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's pieces, largest bucket first (smaller ones reuse its pool)."""
        t0 = time.monotonic()
        self.slot_mapping.fill_(-1)  # capture writes no KV
        for t in reversed(self.buckets):
            with forward_context(self._meta(t)):
                for i in range(self.body.num_pieces):
                    self._piece(i, t)  # warm-up: compiles, sizes workspaces
                torch.cuda.synchronize()
                graphs = []
                for i in range(self.body.num_pieces):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        self._piece(i, t)
                    if self.pool is None:
                        self.pool = graph.pool()
                    graphs.append(graph)
            self.graphs[t] = graphs
        # A graph's first launch also uploads it (ms for a big one): do that now, not in a user's
        # first step of each size. Harmless: slot -1 writes no KV, the buffers hold no one's data.
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.replay()
        torch.cuda.synchronize()
        logger.info("captured %d piecewise CUDA graphs (%d pieces x token buckets %s) in %.1f s",
                    sum(len(g) for g in self.graphs.values()), self.body.num_pieces, self.buckets,
                    time.monotonic() - t0)

    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The forward of this step -> hidden `[num_tokens, hidden]` (a view; valid until the next run)."""
        n = input_ids.shape[0]
        t = self.buckets[bisect.bisect_left(self.buckets, n)]
        graphs = self.graphs[t]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        if t > n:
            self.slot_mapping[n:t].fill_(-1)  # padded rows write no KV (their outputs are never read)
        with forward_context(meta):
            for i, attention in enumerate(self.attention):
                graphs[i].replay()
                attention.attend(self.q[:n], out=self.attn[:n])  # written in place: no copy
        graphs[-1].replay()
        return self.hidden[:n]

    def close(self) -> None:
        """Destroy the graphs and drop the buffers, so their pool can go back to the device."""
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.reset()
        self.graphs.clear()
        self.pool = None
        self.body = None  # type: ignore[assignment]
        self.attention = []
        self.buckets = [0]  # `can_run` is False from now on
        self.input_ids = self.positions = self.slot_mapping = torch.empty(0)
        self.q = self.attn = self.residual = self.hidden = torch.empty(0)
