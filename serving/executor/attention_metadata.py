"""Per-step attention metadata (runner -> model layers -> kernels), and the ambient context.

The batch is ordered decodes first: sequences [0, num_decodes) have exactly one query token and
use the paged decode kernel; the rest (prefill chunks, possibly with cached context) use the
prefill/extend kernel. A mixed-step graph's metadata (`mixed`) instead hands every row to the
fixed-grid mixed kernel. The same tensors feed the Triton kernels and the torch references.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where this step's K/V go and what each query attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = padded row, not written
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32 (cu_seqlens_q)
    seq_lens: torch.Tensor  # [num_seqs] int32: K/V length after this step (context + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    num_decodes: int  # leading sequences with one query token each
    num_decode_tokens: int  # == num_decodes
    max_query_len: int
    max_seq_len: int
    # True in a mixed-step graph (`mixed_graphs.py`): one `kernels.mixed_attention` launch whose grid
    # depends only on the buffers' shapes; unused sequence slots are zero-length.
    mixed: bool = False
    _prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes

    def prefill_part(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block_tables, query_start_loc, seq_lens) of the prefill sequences alone, query rows
        counted from the first prefill token: what the prefill kernel takes in a step that also
        decodes. Built once per step, not once per layer, each tensor at an aligned address of its
        own (a row slice past the decodes is not aligned, which Triton would compile a variant for)."""
        if self._prefill is None:
            nd = self.num_decodes
            self._prefill = (self.block_tables[nd:].clone(), self.query_start_loc[nd:] - self.num_decode_tokens,
                             self.seq_lens[nd:].clone())
        return self._prefill


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Make `meta` visible to attention layers for the duration of one forward."""
    global _current
    prev, _current = _current, meta
    try:
        yield meta
    finally:
        _current = prev


def get_attention_metadata() -> AttentionMetadata:
    assert _current is not None, "attention layer called outside forward_context()"
    return _current
