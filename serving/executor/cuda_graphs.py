"""Decode-only CUDA graphs: capture the model forward once per batch-size bucket, then replay.

In: a decode step's `input_ids`/`positions` `[num_seqs]` and its `AttentionMetadata` (one query
token per sequence). Out: the hidden states `[num_seqs, hidden]`, exactly what an eager forward
returns. Buckets are `[1, 2, 4, 8, 16, 32, 48, ...]` up to `max_num_seqs`, captured largest-first
into one shared memory pool; a step with n sequences replays the smallest bucket >= n. The padded
rows get slot -1 (the cache write skips them) and seq_len 0 (decode attention returns zeros), so
they cost a little compute and touch no real KV blocks. `enforce_eager` means this is never built.

With `compute_logits`, each graph also runs the LM head on every row into one static buffer
(`logits`, shared by all buckets; `logits_dtype`, the model's dtype on one rank, so the matmul
writes it with no upcast copy): the biggest GEMM of a decode step then costs no launch or cuBLAS
set-up on the host. Readers upcast (an exact widening of the head's bf16 output).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

import kernels
from serving.executor.attention_metadata import AttentionMetadata, forward_context

logger = logging.getLogger(__name__)

ForwardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids, positions) -> hidden
LogitsFn = Callable[..., torch.Tensor]  # (hidden [n, H], out=[n, vocab]) -> the logits, in `out`


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Bucket sizes: 1, 2, 4, 8, then every multiple of 16, and max_num_seqs itself."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphRunner:
    """Holds one captured graph per bucket and the static input buffers they all read."""

    def __init__(
        self,
        forward: ForwardFn,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        hidden_size: int,
        max_seq_len: int,
        device: torch.device,
        compute_logits: LogitsFn | None = None,
        vocab_size: int = 0,
        logits_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.forward = forward
        self.compute_logits = compute_logits
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_seq_len = max_seq_len
        n = self.batch_sizes[-1]
        with torch.device(device):
            # NOTE: every graph reads these exact tensors; replay() only ever copies into them.
            self.input_ids = torch.zeros(n, dtype=torch.int64)
            self.positions = torch.zeros(n, dtype=torch.int64)
            self.slot_mapping = torch.full((n,), -1, dtype=torch.int64)
            self.seq_lens = torch.zeros(n, dtype=torch.int32)
            self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32)
            self.logits = torch.zeros(n, vocab_size, dtype=logits_dtype) if compute_logits is not None else None
        self.hidden_size = hidden_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, rows: int, width: int | None = None, max_seq_len: int | None = None) -> AttentionMetadata:
        """Metadata over the first `rows` rows of the static buffers (a bucket at capture; a staged step's
        rows and block-table width in `stage`)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:rows],
            query_start_loc=self.query_start_loc[: rows + 1],
            seq_lens=self.seq_lens[:rows],
            block_tables=self.block_tables[:rows, :width],
            num_decodes=rows,
            num_decode_tokens=rows,
            max_query_len=1,
            max_seq_len=self.max_seq_len if max_seq_len is None else max_seq_len,
        )

    def _bucket(self, n: int) -> int:
        """The smallest captured batch size that holds n rows."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, so smaller graphs reuse the big one's pool."""
        # Padded-state inputs during capture: no slot is written, attention reads nothing.
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        for bs in reversed(self.batch_sizes):
            meta = self._meta(bs)
            with forward_context(meta):
                self._step(bs)  # warm-up: compiles, sizes workspaces
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._step(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out
        for graph in self.graphs.values():
            graph.replay()  # the first launch uploads the graph: before ready, not in a user's step
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.graphs), self.batch_sizes)

    def _step(self, bs: int) -> torch.Tensor:
        """What a graph holds: the forward of `bs` rows (+ their logits into the static buffer)."""
        hidden = self.forward(self.input_ids[:bs], self.positions[:bs])
        if self.logits is not None:
            self.compute_logits(hidden, out=self.logits[:bs])  # type: ignore[misc]
        return hidden

    def can_run(self, num_seqs: int, block_table_width: int) -> bool:
        """True when a captured bucket fits this decode step."""
        return 0 < num_seqs <= self.batch_sizes[-1] and block_table_width <= self.block_tables.shape[1]

    def stage(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
              rows: torch.Tensor, fix_rows: torch.Tensor, fix_src: torch.Tensor, prev_ids: torch.Tensor | None,
              block_table: torch.Tensor, width: int, max_seq_len: int,
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Write a decode step's inputs straight into the static buffers (`kernels.stage_decode_inputs`:
        one launch instead of the copies `run` makes) -> (input_ids, positions, meta): views of the
        buffers, which `run` then replays as they are. Ask `can_run` first."""
        n = ids.shape[0]
        kernels.stage_decode_inputs(ids, positions, slots, seq_lens, rows, fix_rows, fix_src, prev_ids, block_table,
                                    width, self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                                    self.block_tables, self._bucket(n))
        return self.input_ids[:n], self.positions[:n], self._meta(n, width, max_seq_len)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the bucket for this decode step -> hidden [num_seqs, hidden] (a view; copy to keep).

        Inputs from `stage` are the static buffers already; others are copied into them here.
        With `compute_logits`, `self.logits[:num_seqs]` then holds the logits of every row
        (valid until the next replay).
        """
        n = input_ids.shape[0]
        bs = self._bucket(n)
        if input_ids.data_ptr() == self.input_ids.data_ptr():  # staged: the buffers hold the step
            assert meta.slot_mapping.data_ptr() == self.slot_mapping.data_ptr(), "inputs staged in part"
            self.graphs[bs].replay()
            return self.outputs[bs][:n]
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if bs > n:
            # Padded rows: write nothing (slot -1), attend to nothing (seq_len 0).
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].zero_()
        # NOTE: columns past `width` keep stale block ids; seq_lens bounds every read.
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

    def close(self) -> None:
        """Destroy the graphs and drop their outputs and static buffers, so that the shared pool
        goes back to the allocator (`torch.cuda.empty_cache()` then returns it to the device)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
        self.forward = self.compute_logits = None  # type: ignore[assignment]  # they hold the model
        self.input_ids = self.positions = self.slot_mapping = torch.empty(0)
        self.seq_lens = self.block_tables = self.query_start_loc = torch.empty(0)
        self.logits = None
        self.batch_sizes = [0]  # `can_run` is False from now on
