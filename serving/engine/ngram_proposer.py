"""Prompt lookup (n-gram) proposals: draft tokens copied from the sequence's own earlier text.

It exists because input-grounded generation (editing code, quoting a passage, extracting fields)
repeats spans of its prompt: after the last n tokens occurred earlier, the tokens that followed
them there are a cheap guess at what comes next, checked by the target model in one forward.
"""

from __future__ import annotations

import numpy as np

from serving.engine.sequence import PLACEHOLDER, Sequence


def propose_ngram(token_ids: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of the last n tokens of `token_ids`
    (the latest one followed by k tokens, else the earliest), for the longest n in [n_min, n_max]
    that occurs; [] when none does."""
    total = len(token_ids)
    if k <= 0 or total < n_min + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = arr[total - n:]
        # windows ending before the suffix itself: starts 0 .. total - n - 1
        windows = np.lib.stride_tricks.sliding_window_view(arr[: total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.shape[0]:
            # The latest occurrence with k tokens after it (the most local continuation); in a
            # short loop that is not the very last one, whose continuation runs into the suffix.
            whole = hits[hits + n + k <= total]
            start = int(whole[-1] if whole.shape[0] else hits[0]) + n
            return token_ids[start : start + k]
    return []


class NgramProposer:
    """Prompt lookup as a `Proposer` (serving/engine/speculator.py)."""

    def __init__(self, n_max: int, n_min: int) -> None:
        assert 1 <= n_min <= n_max, (n_min, n_max)
        self.n_max, self.n_min = n_max, n_min

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return propose_ngram(seq.token_ids, k, self.n_max, self.n_min)

    def propose_many(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [self.propose(seq, k) for seq, k in zip(seqs, ks)]

    def may_propose(self, seq: Sequence) -> bool:
        """Whether a lookup is likely to land once the token in flight is known: the known text's own
        last n-gram recurs. Inside a copied span both do; at the span's first token this says no and
        the lookup starts one step later (a step of plain decoding, async, instead of a wait for a
        lookup that mostly misses)."""
        ids = seq.token_ids
        end = len(ids)
        while end and ids[end - 1] == PLACEHOLDER:
            end -= 1
        return bool(propose_ngram(ids[:end], 1, self.n_max, self.n_min))

    def take_probs(self, seq_id: int) -> None:
        return None  # point masses: the drafts are copied, not drawn

    def forget(self, seq_id: int) -> None:
        pass  # nothing is kept per sequence
