"""Guided decoding on the engine side (host): grammars, one matcher per constrained sample.

It exists so constrained rows batch with free ones: the engine keeps an xgrammar matcher per
constrained sequence, advances it with each token the step returned, and hands the next
step's plan a packed bitmask per constrained sampling row (`[R, ceil(V/32)]` int32, bit v of
row r set = token v allowed); rank 0's sampler masks those rows' logits before any sampling
path. A matcher that can only end (its grammar is complete and nothing but a stop token
remains) finishes its sample with finish_reason "stop".

xgrammar was chosen over llguidance and outlines-core on mask cost per step and JSON-schema
coverage (`bench/studies/grammar_libs.py`, figures in bench/RESULTS.md). Constraints are compiled in
child processes within a time and size bound, and kept in a cache bounded in bytes
(`serving/engine/grammar_compiler.py`). A constraint that admits no output at all (nothing but a
stop token from its first token: an unsatisfiable schema, an empty language) is refused.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable

import numpy as np

from serving.engine.grammar_compiler import CompiledGrammarCache
from serving.sampling_params import GuidedDecodingParams

logger = logging.getLogger("serving.engine.guided")
_BATCH_MIN = 16  # fewer constrained rows: one thread (the batch API's hand-off costs more than it saves)


class GuidedDecoder:
    """Compiles constraints, keeps the matchers, fills the bitmasks of a step."""

    def __init__(self, tokenizer: object, vocab_size: int, stop_token_ids: Iterable[int], *,
                 compile_timeout: float = 10.0, max_bytes: int = 64 * 1024, cache_bytes: int = 256 << 20) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.width = (vocab_size + 31) // 32
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self.stop_token_ids = list(info.stop_token_ids)
        self._compiler = CompiledGrammarCache(info, timeout=compile_timeout, max_bytes=max_bytes,
                                              cache_bytes=cache_bytes, check=self._admits_output)
        self._matchers: dict[int, object] = {}  # seq_id -> xgr.GrammarMatcher
        threads = (os.cpu_count() or 1) // 2
        self._batch = xgr.BatchGrammarMatcher(max_threads=min(threads, 8)) if threads >= 4 else None
        self._scratch = np.zeros((1, self.width), dtype=np.int32)
        stop = np.zeros(self.width, dtype=np.int32)
        for t in self.stop_token_ids:
            if 0 <= t < vocab_size:
                stop[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        self._not_stop = ~stop

    # ---- grammars ------------------------------------------------------------------------

    def compile(self, g: GuidedDecodingParams) -> object:
        """The compiled grammar of a constraint; ValueError (names the problem) when it is invalid,
        too big, too slow to compile or admits no output."""
        return self._compiler.compile(g)

    def _admits_output(self, g: GuidedDecodingParams, compiled: object) -> None:
        """ValueError unless the grammar allows some token other than a stop token first."""
        mask = np.zeros((1, self.width), dtype=np.int32)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask, 0)
        if not (mask[0] & self._not_stop).any():
            raise ValueError(f"the guided decoding {g.kind} admits no output (an unsatisfiable schema or an "
                             "empty language): nothing could be generated under it")

    def close(self) -> None:
        """End the compile processes."""
        self._compiler.close()

    # ---- matchers ------------------------------------------------------------------------

    def add(self, seq_id: int, g: GuidedDecodingParams, tokens: Iterable[int] = ()) -> None:
        m = self._xgr.GrammarMatcher(self.compile(g))
        for t in tokens:  # outputs already produced (not the case today; kept for re-admission)
            m.accept_token(t)
        self._matchers[seq_id] = m

    def remove(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def accept(self, seq_id: int, token_id: int) -> str | None:
        """Advance the matcher; None (go on), "end" (the constraint is complete), or "invalid"."""
        m = self._matchers[seq_id]
        if not m.accept_token(token_id):
            return "invalid"
        if m.is_terminated():
            return "end"
        if m.is_completed():
            # Complete; does the grammar allow anything but a stop token now?
            m.fill_next_token_bitmask(self._scratch, 0)
            if not (self._scratch[0] & self._not_stop).any():
                return "end"
        return None

    def fill(self, seq_ids: list[int]) -> np.ndarray:
        """`[len(seq_ids), width]` int32: each sequence's allowed next tokens (packed bits).

        A sequence without a matcher (it finished while its next token was being computed, which
        is then dropped) gets every token allowed.
        """
        masks = np.empty((len(seq_ids), self.width), dtype=np.int32)
        rows, matchers = [], []
        for i, seq_id in enumerate(seq_ids):
            m = self._matchers.get(seq_id)
            if m is None:
                masks[i] = -1
            else:
                rows.append(i)
                matchers.append(m)
        if len(matchers) >= _BATCH_MIN and self._batch is not None:
            # Rows in parallel on native threads (half the cores: the GPU machines have 16).
            self._batch.batch_fill_next_token_bitmask(matchers, masks, rows)
        else:
            for i, m in zip(rows, matchers):
                m.fill_next_token_bitmask(masks, i)
        return masks
