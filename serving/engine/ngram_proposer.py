"""Prompt lookup (n-gram) proposals: draft tokens copied from the sequence's own earlier text.

It exists because input-grounded generation (editing code, quoting a passage, extracting fields)
repeats spans of its prompt: after the last n tokens occurred earlier, the tokens that followed
them there are a cheap guess at what comes next, checked by the target model in one forward.
"""

from __future__ import annotations

import numpy as np


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
