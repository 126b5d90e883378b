"""Which sequences speculate this step, with what draft tokens; acceptance counters.

It exists so the scheduler asks one object "how many draft tokens for this sequence now?" and
tells it what was accepted, while the policy (method, k, batch-size cut-off, per-sequence
acceptance floor) and the `/metrics` counters live in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.engine.ngram_proposer import propose_ngram
from serving.engine.sequence import PLACEHOLDER, Sequence
from serving.speculative_config import SpeculativeConfig


SPEC_PREFIX = "spec_decode_"
PER_POSITION_PREFIX = SPEC_PREFIX + "num_accepted_tokens_pos_"


@dataclass(slots=True)
class _Acceptance:
    """One sequence's recent proposals: tokens proposed and accepted in the current window,
    and how many steps it sits out after a poor window."""

    proposed: int = 0
    accepted: int = 0
    pause: int = 0


@dataclass
class SpeculationStats:
    """Counters as vLLM exports them (`vllm:spec_decode_num_*`): verify steps (drafts), draft
    tokens proposed, accepted, and accepted per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculator:
    """Proposes draft tokens per sequence (see `SpeculativeConfig` for the policy)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.stats = SpeculationStats(accepted_per_position=[0] * self.k)
        self._seqs: dict[int, _Acceptance] = {}

    def active(self, num_running: int) -> bool:
        """Whether any sequence may speculate in a step with `num_running` sequences."""
        return num_running <= self.config.disable_by_batch_size

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Whether `seq`'s sampling can be verified exactly here: not with penalties, logit bias,
        a min_tokens still to reach or guided decoding (those rows take the plain path)."""
        p = seq.params
        return not (p.needs_token_history or p.logit_bias or p.guided_decoding is not None
                    or p.min_tokens > seq.num_output_tokens)

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """Draft tokens for `seq` (its last token known, nothing else to compute); at most `room`."""
        state = self._seqs.get(seq.seq_id)
        if state is not None and state.pause:
            state.pause -= 1
            return []
        k = min(self.k, room)
        if k <= 0 or not self.eligible(seq):
            return []
        ids = seq.token_ids
        assert ids[-1] != PLACEHOLDER, f"seq {seq.seq_id}: proposing with a token in flight"
        c = self.config
        return propose_ngram(ids, k, c.prompt_lookup_max, c.prompt_lookup_min)

    def record(self, seq_id: int, num_proposed: int, num_accepted: int) -> None:
        """One verify step's outcome for a sequence (draft tokens proposed, accepted)."""
        assert 0 <= num_accepted <= num_proposed <= self.k, (num_proposed, num_accepted)
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_proposed
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_position[i] += 1
        c = self.config
        if not c.acceptance_floor:
            return
        state = self._seqs.setdefault(seq_id, _Acceptance())
        state.proposed += num_proposed
        state.accepted += num_accepted
        if state.proposed >= c.acceptance_window:
            if state.accepted < c.acceptance_floor * state.proposed:
                state.pause = c.acceptance_window
            state.proposed = state.accepted = 0

    def metrics(self) -> dict[str, int]:
        """The counters as flat numeric stats (summed over model copies; `/metrics` reads them)."""
        s = self.stats
        out = {SPEC_PREFIX + "num_drafts": s.num_drafts, SPEC_PREFIX + "num_draft_tokens": s.num_draft_tokens,
               SPEC_PREFIX + "num_accepted_tokens": s.num_accepted_tokens}
        for pos, count in enumerate(s.accepted_per_position):
            out[f"{PER_POSITION_PREFIX}{pos}"] = count
        return out

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
