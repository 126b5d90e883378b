"""Whole-step CUDA graphs for steps that carry prompt tokens (decodes and prompt chunks mixed).

Why: a decode-only step replays one whole-model graph (`cuda_graphs.py`), but a step that also
carries a prompt chunk ran its attention eagerly between graph pieces (the decode and prefill
kernels size their grids from the step): 33 graph launches, 2-3 Triton launches a layer and their
metadata slicing, ~6 ms of host time per 8B step on a fast host and 13-16 ms on a slow one
(RESULTS run 17), longer than the GPU's ~12 ms. Those steps set the serving inter-token tail.

What: `kernels.mixed_attention` launches a grid that depends only on its buffers' shapes (T query
rows, S sequence slots), so each token bucket's whole forward, attention included, is captured
once and a step is one graph launch plus a few copies into static buffers. A step with n tokens
and s sequences replays the smallest bucket T >= n; padded rows get slot -1 (no KV write) and
are never read; unused sequence slots are zero-length (`query_start_loc` repeats n, `seq_lens`
0), which the kernel skips. Bucket T has min(T, max_num_seqs) slots (each sequence brings at
least one token). Steps larger than the largest bucket (long prefills, where launch cost is
small beside the compute) stay eager. After capture each bucket is timed once and dropped when a
larger one is no slower (GEMM speed is not monotonic in rows); the scheduler reads the buckets
kept (`ExecutorInfo.step_sizes`) and fills a step's padding with prompt tokens.

Graphs share one memory pool; each bucket's output (`[T, hidden]`) is a view of that pool valid
until the next replay. The LoRA manager's per-step grouping is read through the forward
(`ModelRunner._model_forward`), as in decode graphs.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from serving.executor import parallel
from serving.executor.attention_metadata import AttentionMetadata, forward_context

logger = logging.getLogger(__name__)

ForwardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids, positions) -> hidden

# Steps of a few dozen decodes plus a prompt chunk of up to 256 tokens (the server's cap on prompt
# tokens while streams decode) land in 160-288: steps of 32 there, so the padding's compute stays
# under ~12 % where a step's length is what the inter-token tail measures.
_BUCKETS = (16, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048)


def mixed_buckets(max_tokens: int) -> list[int]:
    """Token buckets up to `max_tokens` (itself the last when it is not one of them)."""
    sizes = [b for b in _BUCKETS if b < max_tokens]
    sizes.append(max_tokens)
    return sizes


def faster_buckets(buckets: list[int], times: list[float]) -> list[int]:
    """The buckets (ascending) each faster than every larger one; the largest always stays."""
    assert len(buckets) == len(times) and buckets == sorted(buckets), (buckets, times)
    keep, fastest = [], float("inf")
    for t, ms in zip(reversed(buckets), reversed(times)):
        if ms < fastest or not keep:
            keep.append(t)
            fastest = ms
    return keep[::-1]


class MixedGraphRunner:
    """One captured whole-forward graph per token bucket, and the static inputs they all read."""

    def __init__(self, forward: ForwardFn, max_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        self.forward = forward
        self.buckets = mixed_buckets(max_tokens)
        self.max_num_seqs = max_num_seqs
        n, s = self.buckets[-1], min(self.buckets[-1], max_num_seqs)
        with torch.device(device):
            # NOTE: every graph reads these exact tensors; `run` only ever copies into them.
            self.input_ids = torch.zeros(n, dtype=torch.int64)
            self.positions = torch.zeros(n, dtype=torch.int64)
            self.slot_mapping = torch.full((n,), -1, dtype=torch.int64)
            self.query_start_loc = torch.zeros(s + 1, dtype=torch.int32)
            self.seq_lens = torch.zeros(s, dtype=torch.int32)
            self.block_tables = torch.zeros((s, max_blocks_per_seq), dtype=torch.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None  # the graphs' shared memory pool, set by the first capture

    def slots(self, t: int) -> int:
        """Sequence slots of bucket `t`."""
        return min(t, self.max_num_seqs)

    def _meta(self, t: int) -> AttentionMetadata:
        """Bucket `t`'s view of the static buffers, for `kernels.mixed_attention`."""
        s = self.slots(t)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t], query_start_loc=self.query_start_loc[: s + 1],
            seq_lens=self.seq_lens[:s], block_tables=self.block_tables[:s], num_decodes=0, num_decode_tokens=0,
            max_query_len=t, max_seq_len=0, mixed=True,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller ones reuse its pool)."""
        t0 = time.monotonic()
        # Capture state: no slot written, every sequence slot empty (attention reads nothing).
        self.slot_mapping.fill_(-1)
        self.query_start_loc.zero_()
        self.seq_lens.zero_()
        for t in reversed(self.buckets):
            with forward_context(self._meta(t)):
                self.forward(self.input_ids[:t], self.positions[:t])  # warm-up: compiles, sizes workspaces
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self.forward(self.input_ids[:t], self.positions[:t])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[t] = graph
            self.outputs[t] = out
        # A graph's first launch also uploads it (ms for a big one): do that now, not in a user's
        # first step of each size. Harmless: slot -1 writes no KV, the buffers hold no one's data.
        for graph in self.graphs.values():
            graph.replay()
        torch.cuda.synchronize()
        dropped = self._drop_slow_buckets()
        logger.info("captured %d mixed-step CUDA graphs (token buckets %s; dropped as no faster than a larger one: "
                    "%s) in %.1f s", len(self.graphs), self.buckets, dropped or "none", time.monotonic() - t0)

    def _drop_slow_buckets(self, replays: int = 3) -> list[int]:
        """Time each bucket's replay and drop those no faster than a larger bucket: a GEMM's speed is
        not monotonic in its rows (tile shapes), e.g. 288 rows of an 8B layer took longer than 320 on
        an H100 (bench/studies/step_gemms.py). Steps then pad to the faster size, and the scheduler fills
        that padding with prompt tokens. Every rank replays the same graphs in the same order (their
        collectives pair up) and keeps rank 0's verdict, so all ranks keep the same buckets."""
        times = []
        for t in self.buckets:
            graph = self.graphs[t]
            graph.replay()  # a warm replay, untimed
            best = float("inf")
            for _ in range(replays):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end))
            times.append(best)
        times = parallel.broadcast_from_driver(torch.tensor(times, device=self.input_ids.device)).tolist()
        keep = faster_buckets(self.buckets, times)
        dropped = [t for t in self.buckets if t not in keep]
        self.buckets = keep  # (dropped graphs stay until `close`: their memory is the shared pool's)
        return dropped

    def can_run(self, num_tokens: int, num_seqs: int, block_table_width: int) -> bool:
        return (0 < num_tokens <= self.buckets[-1] and num_seqs <= self.max_num_seqs
                and block_table_width <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The forward of this step -> hidden `[num_tokens, hidden]` (a view; valid until the next run)."""
        n, s = input_ids.shape[0], meta.num_seqs
        t = self.buckets[bisect.bisect_left(self.buckets, n)]
        slots = self.slots(t)
        assert s <= slots, (s, slots)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.query_start_loc[: s + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.seq_lens[:s].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:s, :width].copy_(meta.block_tables, non_blocking=True)
        if t > n:
            self.slot_mapping[n:t].fill_(-1)  # padded rows write no KV (their outputs are never read)
        if slots > s:
            self.query_start_loc[s + 1 : slots + 1].fill_(n)  # unused slots: no query rows ...
            self.seq_lens[s:slots].zero_()  # ... and no context
        # NOTE: columns past `width` keep stale block ids; seq_lens bounds every read.
        self.graphs[t].replay()
        return self.outputs[t][:n]

    def close(self) -> None:
        """Destroy the graphs and drop the buffers, so their pool can go back to the device."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
        self.forward = None  # type: ignore[assignment]  # it holds the model
        self.buckets = [0]  # `can_run` is False from now on
        self.input_ids = self.positions = self.slot_mapping = torch.empty(0)
        self.query_start_loc = self.seq_lens = self.block_tables = torch.empty(0)
