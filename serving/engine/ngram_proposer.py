"""Prompt lookup (n-gram) proposals: draft tokens copied from the sequence's own earlier text.

It exists because input-grounded generation (editing code, quoting a passage, extracting fields)
repeats spans of its prompt: after the last n tokens occurred earlier, the tokens that followed
them there are a cheap guess at what comes next, checked by the target model in one forward.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of
    `token_ids`, for the longest n in [n_min, n_max] that occurs; [] when none does."""
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
            start = int(hits[-1]) + n  # the latest occurrence: its continuation is the most local
            return token_ids[start : start + k]
    return []
