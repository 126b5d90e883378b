"""The worker's persistent input batch: one row per sequence it holds, kept across steps.

It exists so a decode step's inputs come from vectorised numpy/torch ops over rows, not from
per-sequence Python (vLLM v1's input batch). A row is taken from a free list when a sequence
joins (`add`) and given back when it finishes or is preempted (`remove`); a step lists its
sequences' rows in chunk order. Host columns (numpy) hold the block table
`[rows, max_blocks]` int32 and the sampling parameters set once at join; the device holds a
mirror of the block table, updated from the entries written since the last step
(`take_dirty`), so steady decoding uploads a few new block ids per step, not whole tables.
`extra` holds per-row int columns set at join by other features (`add_column`; e.g. an
adapter slot, turned into a per-token index by `np.repeat(col[rows], num_tokens)`). Rows and
columns grow on demand.
"""

from __future__ import annotations

import numpy as np
import torch

from serving.sampling_params import SamplingParams


def plain_sampling(p: SamplingParams) -> bool:
    """Whether a row samples on the sampler's plain path: temperature only (or greedy), drawn
    from the shared generator, with nothing that reads its history or its logprobs."""
    return (p.seed is None and p.logprobs is None and p.min_tokens == 0 and not p.logit_bias
            and not p.needs_token_history and p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0)


class InputBatch:
    """Rows, host columns and the device block table of the sequences a worker holds."""

    def __init__(self, max_rows: int = 8, max_blocks: int = 16, device: torch.device | None = None,
                 mirror: bool | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")
        # On the CPU the "device" table is the host table itself, unless a mirror is asked for (tests).
        self.mirror = self.device.type != "cpu" if mirror is None else mirror
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self._free: list[int] = []  # free rows, lowest last (pop() takes it)
        self._rows = 0
        self._width = 0
        self.extra: dict[str, np.ndarray] = {}
        self._extra_default: dict[str, int] = {}
        self._dirty: list[tuple[int, int, list[int]]] = []  # (row, first column, block ids)
        self._resize(max(1, max_rows), max(1, max_blocks))

    # ---- storage -------------------------------------------------------------------------

    def _resize(self, rows: int, width: int) -> None:
        old_rows, old_width = self._rows, self._width
        first = old_rows == 0

        def grown(name: str, dtype: type, fill: int | float = 0, table: bool = False) -> np.ndarray:
            out = np.full((rows, width) if table else (rows,), fill, dtype=dtype)
            if not first:
                old = getattr(self, name)
                out[tuple(slice(0, n) for n in old.shape)] = old
            return out

        self.block_table = grown("block_table", np.int32, table=True)  # [rows, width]
        self.num_blocks = grown("num_blocks", np.int64)
        self.inv_temperature = grown("inv_temperature", np.float32)  # 0: greedy
        self.plain = grown("plain", np.bool_, True)  # samples on the plain path (`plain_sampling`)
        self.prompt_logprobs = grown("prompt_logprobs", np.bool_, False)
        for name, col in self.extra.items():
            out = np.full(rows, self._extra_default[name], dtype=np.int64)
            out[: col.shape[0]] = col
            self.extra[name] = out
        self._free = list(range(rows - 1, old_rows - 1, -1)) + self._free
        self._rows, self._width = rows, width
        if not self.mirror:
            self.device_block_table = torch.from_numpy(self.block_table)  # shares the host memory
        else:
            table = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
            if not first:
                table[:old_rows, :old_width] = self.device_block_table
            self.device_block_table = table

    def add_column(self, name: str, default: int = 0) -> np.ndarray:
        """A per-row int64 column set at join by another feature (e.g. an adapter slot); returns it."""
        if name not in self.extra:
            self._extra_default[name] = default
            self.extra[name] = np.full(self._rows, default, dtype=np.int64)
        return self.extra[name]

    # ---- rows ----------------------------------------------------------------------------

    def add(self, seq_id: int, params: SamplingParams, block_ids: list[int], **extra: int) -> int:
        """Give a joining sequence a row and set its columns; returns the row."""
        assert seq_id not in self.row_of, f"seq {seq_id} already holds a row"
        if not self._free:
            self._resize(2 * self._rows, self._width)
        row = self._free.pop()
        self.row_of[seq_id] = row
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        self.inv_temperature[row] = 0.0 if params.greedy else 1.0 / params.temperature
        self.plain[row] = plain_sampling(params)
        self.prompt_logprobs[row] = params.prompt_logprobs is not None
        for name, col in self.extra.items():
            col[row] = extra.get(name, self._extra_default[name])
        return row

    def remove(self, seq_id: int) -> None:
        """Give the sequence's row back (unknown ids are ignored)."""
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            # NOTE: the device copy keeps stale ids past num_blocks; seq_lens bound every read.
            self.block_table[row, : self.num_blocks[row]] = 0
            self.num_blocks[row] = 0
            self._free.append(row)
            if self._dirty:  # not yet on the device: a later occupant must not race them in one write
                self._dirty = [d for d in self._dirty if d[0] != row]

    def clear(self) -> None:
        for seq_id in list(self.row_of):
            self.remove(seq_id)
        self._dirty.clear()

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        """Extend a row's block table (written to the device with the next step's inputs)."""
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self._width:
            self._resize(self._rows, max(end, 2 * self._width))
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end
        if self.mirror:
            self._dirty.append((row, start, list(block_ids)))

    def rows(self, seq_ids: list[int]) -> np.ndarray:
        """Rows of `seq_ids`, in order (int64)."""
        return np.fromiter(map(self.row_of.__getitem__, seq_ids), dtype=np.int64, count=len(seq_ids))

    # ---- device mirror -------------------------------------------------------------------

    def take_dirty(self) -> np.ndarray:
        """Block-table entries written since the last call, as int64 `[3, n]` (row, column, id)."""
        if not self._dirty:
            return np.empty((3, 0), dtype=np.int64)
        lens = np.fromiter((len(b) for _, _, b in self._dirty), dtype=np.int64, count=len(self._dirty))
        out = np.empty((3, int(lens.sum())), dtype=np.int64)
        out[0] = np.repeat([r for r, _, _ in self._dirty], lens)
        starts = np.repeat([c for _, c, _ in self._dirty], lens)
        out[1] = starts + np.arange(out.shape[1]) - np.repeat(np.cumsum(lens) - lens, lens)
        out[2] = [b for _, _, blocks in self._dirty for b in blocks]
        self._dirty.clear()
        return out

    def apply_dirty(self, entries: torch.Tensor) -> None:
        """Write `take_dirty`'s entries, already on the device (`[3, n]` int64), into its table."""
        if entries.shape[1]:
            self.device_block_table.index_put_((entries[0], entries[1]), entries[2].to(torch.int32))

    def tables(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """Block tables `[len(rows), width]` int32 of these rows (rows on the table's device)."""
        return self.device_block_table[:, :width].index_select(0, rows)
