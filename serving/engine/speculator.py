"""Which sequences speculate this step, with what draft tokens; acceptance counters.

It exists so the scheduler asks one object "how many draft tokens for this sequence now?" and
tells it what was accepted, and the engine asks it "is any proposal likely next step?" (whether
to wait for the tokens in flight, which a proposal needs, or to launch the next step
asynchronously as plain decoding), while the policy (method, k, batch-size cut-off,
per-sequence acceptance floor) and the `/metrics` counters live in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from serving.engine.ngram_proposer import NgramProposer
from serving.engine.sequence import PLACEHOLDER, Sequence
from serving.speculative_config import SpeculativeConfig


SPEC_PREFIX = "spec_decode_"
PER_POSITION_PREFIX = SPEC_PREFIX + "num_accepted_tokens_pos_"


class Proposer(Protocol):
    """Where draft tokens come from (prompt lookup; a benchmark's oracle, bench/speculative.py)."""

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` draft tokens to follow `seq.token_ids` (all known: none in flight)."""
        ...

    def propose_many(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """`propose` for several sequences (a draft model batches their forwards)."""
        ...

    def may_propose(self, seq: Sequence) -> bool:
        """Whether `propose` is likely to return drafts once `seq`'s token in flight is known
        (its last ids may be placeholders): cheap, and wrong only at some cost in speed."""
        ...

    def take_probs(self, seq_id: int) -> object | None:
        """The distributions `[k, V]` the last drafts of a sampled sequence were drawn from (a
        tensor), for rejection sampling; None: point masses (prompt lookup)."""
        ...

    def forget(self, seq_id: int) -> None:
        """The sequence ended: drop whatever is kept for it."""
        ...


@dataclass(slots=True)
class _Acceptance:
    """One sequence's recent proposals: tokens proposed and accepted in the current window,
    and the length it must reach before it proposes again after a poor window."""

    proposed: int = 0
    accepted: int = 0
    resume_at: int = 0
    poor: int = 0  # poor windows in a row: each doubles the pause (up to 32 windows)


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

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.stats = SpeculationStats(accepted_per_position=[0] * self.k)
        self._seqs: dict[int, _Acceptance] = {}
        self._prefetched: dict[int, list[int]] = {}  # this step's proposals, made together (`prefetch`)
        # (a benchmark may put its own here: bench/speculative.py; never a serving option)
        self._proposer: Proposer = (NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
                                    if proposer is None else proposer)

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

    def _paused(self, seq: Sequence) -> bool:
        state = self._seqs.get(seq.seq_id)
        return state is not None and len(seq.token_ids) < state.resume_at

    def _wanted(self, seq: Sequence, room: int) -> int:
        """How many drafts `seq` may get now (0: none)."""
        k = min(self.k, room, seq.max_tokens - seq.num_output_tokens - 1)
        return 0 if k <= 0 or self._paused(seq) or not self.eligible(seq) else k

    def prefetch(self, seqs: list[Sequence]) -> None:
        """Make this step's proposals for the decodes `seqs` (last tokens known) at once, so a draft
        model runs one batched forward per draft position; `propose` then hands them out."""
        self._prefetched.clear()
        ks = [self._wanted(seq, self.k) for seq in seqs]
        todo = [i for i, k in enumerate(ks) if k]
        if todo:
            proposals = self._proposer.propose_many([seqs[i] for i in todo], [ks[i] for i in todo])
            self._prefetched = {seqs[i].seq_id: drafts for i, drafts in zip(todo, proposals)}

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """Draft tokens for `seq` (its last token known, nothing else to compute); at most `room`."""
        k = self._wanted(seq, room)
        prefetched = self._prefetched.pop(seq.seq_id, None)
        if not k:
            return []
        assert seq.token_ids[-1] != PLACEHOLDER, f"seq {seq.seq_id}: proposing with a token in flight"
        drafts = prefetched[:k] if prefetched is not None else self._proposer.propose(seq, k)
        assert len(drafts) <= k, (len(drafts), k)
        return drafts

    def wants_tokens_in_flight(self, running: list[Sequence]) -> bool:
        """Whether the next step should wait for the tokens in flight because some running
        decode is likely to propose once its token is known. When not, the next step runs as
        plain decoding does, overlapped with the device (async scheduling), and nobody proposes
        in it (its last tokens are placeholders)."""
        if not self.active(len(running)):
            return False
        proposer = self._proposer
        for seq in running:
            ids = seq.token_ids
            if (ids[-1] == PLACEHOLDER and len(ids) - seq.num_computed_tokens == 1
                    and seq.num_output_tokens + 1 < seq.max_tokens and not self._paused(seq)
                    and self.eligible(seq) and proposer.may_propose(seq)):
                return True
        return False

    def record(self, seq_id: int, num_proposed: int, num_accepted: int, length: int) -> None:
        """One verify step's outcome for a sequence (draft tokens proposed, accepted; its length
        after it)."""
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
                state.resume_at = length + (c.acceptance_window << min(state.poor, 5))
                state.poor += 1
            else:
                state.poor = 0
            state.proposed = state.accepted = 0

    def metrics(self) -> dict[str, int]:
        """The counters as flat numeric stats (summed over model copies; `/metrics` reads them)."""
        s = self.stats
        out = {SPEC_PREFIX + "num_drafts": s.num_drafts, SPEC_PREFIX + "num_draft_tokens": s.num_draft_tokens,
               SPEC_PREFIX + "num_accepted_tokens": s.num_accepted_tokens}
        for pos, count in enumerate(s.accepted_per_position):
            out[f"{PER_POSITION_PREFIX}{pos}"] = count
        return out

    def draft_probs(self, seq_id: int) -> object | None:
        """What the last drafts of `seq_id` were drawn from (see `Proposer.take_probs`)."""
        return self._proposer.take_probs(seq_id)

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self._proposer.forget(seq_id)
