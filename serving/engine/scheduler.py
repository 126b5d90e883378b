"""Rolling-batch scheduler: decides which tokens of which sequences run each step.

It schedules by counters, not phases: a sequence needs `num_tokens - num_computed_tokens`
more tokens computed; a prefill is just a large number (chunked by the token budget), a decode
is one. In: sequences (`add_sequences`), runner results (`update`). Out: a `SchedulerOutput`
per step, and the sequences that got new tokens / finished. Blocks come from `BlockManager`;
when they run out the latest-arrived running sequence is preempted by recompute.

`schedule()` advances `num_computed_tokens` at once, and the plan builder (`build_plan` with
`placeholders`) stands a `PLACEHOLDER` in for each token being sampled, so step N+1 can be planned
while step N still runs on the device (async scheduling); `update()` later writes the real ids and applies stops.
Called in order schedule -> update (no placeholders) it is the plain synchronous loop.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable

from serving.engine.block_manager import BlockManager
from serving.engine.speculator import Speculator
from serving.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from serving.executor.plan import SampledToken, StepOutput
from serving.engine.sequence import PLACEHOLDER, FinishReason, Sequence, SequenceStatus

CONTEXT_OVERFLOW = "This model's maximum context length is"  # OpenAI's words: clients map them to their overflow error


def context_overflow_message(max_model_len: int, num_prompt_tokens: int, max_tokens: int | None) -> str:
    """A request longer than the context, in OpenAI's (and vLLM's) words: LangChain, LiteLLM and
    others recognise this sentence (and the `context_length_exceeded` code the HTTP layer adds)."""
    if max_tokens is None:
        return (f"{CONTEXT_OVERFLOW} {max_model_len} tokens. However, your request has {num_prompt_tokens} "
                f"input tokens. Please reduce the length of the input messages (max_model_len={max_model_len}).")
    return (f"{CONTEXT_OVERFLOW} {max_model_len} tokens. However, you requested {num_prompt_tokens + max_tokens} "
            f"tokens ({num_prompt_tokens} in the messages, {max_tokens} in the completion). Please reduce the "
            f"length of the messages or completion (max_model_len={max_model_len}).")


class Scheduler:
    """Admission under a per-step token budget and sequence cap, with preemption: FCFS, or longest
    `max_tokens` first with prompts spread over the decode steps (`makespan_target`).

    Args:
        block_manager: owns the KV blocks.
        max_num_seqs: most sequences running at once (LMI `max_rolling_batch_size`).
        max_num_batched_tokens: most tokens computed in one step (LMI
            `max_rolling_batch_prefill_tokens`); decodes and prefill chunks share it.
        max_model_len: most tokens (prompt + output) of one sequence.
        eos_token_ids: ids that end a sample unless `ignore_eos`.
        enable_chunked_prefill: when False a prompt is only admitted whole.
        long_prefill_token_threshold: most tokens one sequence computes in a step when it has more
            to compute (vLLM's; 0: only the budget limits it).
        max_prefill_tokens_while_decoding: most prompt tokens (of all sequences together) in a step
            that also decodes (0: only the budget limits them). Every such step stays short, so the
            streams already running keep their pace while prompts arrive; a step with no decode
            (an idle server's first prompts) still fills the whole budget.
        max_loras: most distinct LoRA adapters in one step (the device slots; None: LoRA off).
            A sequence whose adapter would be one too many waits (running ones keep their blocks).
        makespan_target: 0 (off: FCFS, prompts as fast as the budget allows), or a step size in
            tokens for batch work that should end as early as possible. Waiting requests are then
            admitted longest `max_tokens` first, and a step that decodes takes only enough prompt
            tokens to reach `makespan_target` tokens (where its GEMMs stop being bound by reading
            the weights, so those tokens are nearly free), or more when a waiting request would
            otherwise start too late to finish by the time the longest running one does.
        step_sizes: the token counts the executor runs a step at (its CUDA graphs' buckets, ascending;
            empty: any count). A step that decodes and takes prompt tokens is padded up to the next
            size anyway, so its prompt tokens may fill that padding: they cost nothing more.
        speculator: speculative decoding (None: off). A decode whose last token is known may carry
            its draft tokens (taken from the step's prompt-token room, never preempting for them);
            `update` then keeps the accepted ones and rolls the rest back.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        enable_chunked_prefill: bool = True,
        max_loras: int | None = None,
        long_prefill_token_threshold: int = 0,
        max_prefill_tokens_while_decoding: int = 0,
        makespan_target: int = 0,
        step_sizes: Iterable[int] = (),
        speculator: Speculator | None = None,
    ) -> None:
        if max_num_batched_tokens < max_num_seqs:
            # Otherwise the decodes at the back of the running list could starve forever.
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs})"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_chunked_prefill = enable_chunked_prefill
        for cap in (long_prefill_token_threshold, max_prefill_tokens_while_decoding):
            assert cap >= 0 and (enable_chunked_prefill or not cap), cap
        # (as the budget when off: min() below then never binds)
        self.chunk_cap = long_prefill_token_threshold or max_num_batched_tokens
        self.prefill_cap_while_decoding = max_prefill_tokens_while_decoding
        assert makespan_target >= 0 and (enable_chunked_prefill or not makespan_target), makespan_target
        self.makespan_target = makespan_target
        self.step_sizes = sorted(step_sizes)
        self.max_loras = max_loras
        self.speculator = speculator
        # FCFS (or `_admission_key` order with makespan_target); preempted sequences go back to the front
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # sorted by seq_id (= arrival order)
        self._groups: dict[str, list[Sequence]] = {}  # request_id -> its n samples
        self.num_preemptions = 0
        # Requests that were in a step that failed (see LLMEngine.recover): at most one of
        # them runs at a time, so the next failure names its culprit.
        self.suspects: set[str] = set()

    # ---- admission -----------------------------------------------------------------------

    def _context_limit(self) -> int:
        bm = self.block_manager
        return min(self.max_model_len, bm.num_blocks * bm.block_size)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Raise ValueError when a request could never be scheduled: the one check of a request's
        length limit, made at admission (`LLMEngine.validate`); `add_sequences` asserts it held."""
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty; at least one token is needed")
        total = num_prompt_tokens + (max_tokens if max_tokens is not None else 0)
        if num_prompt_tokens >= self.max_model_len or total > self.max_model_len:
            raise ValueError(context_overflow_message(self.max_model_len, num_prompt_tokens, max_tokens))
        if max_tokens is None:  # up to the context limit: room for the prompt and one token is enough
            total = num_prompt_tokens + 1
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if self.block_manager.blocks_for(total) > self.block_manager.num_blocks:
            raise ValueError(context_overflow_message(capacity, num_prompt_tokens, max_tokens)
                             + f" (On this server the whole KV cache holds {capacity} tokens: give it more memory"
                             " to serve longer requests.)")
        if not self.enable_chunked_prefill and num_prompt_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens} and chunked prefill is disabled"
            )

    def add_sequences(self, seqs: list[Sequence]) -> None:
        """Queue the samples of one request, admitted by `check_fits` (raises ValueError, queues nothing,
        only for a request id in use).

        Each sample's `max_tokens` is resolved here, once: the request's, else up to the context limit
        (max_model_len, or what the whole KV cache holds when that is less)."""
        assert seqs and len({s.request_id for s in seqs}) == 1
        request_id = seqs[0].request_id
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._groups[request_id] = list(seqs)
        context = self._context_limit()
        for seq in seqs:
            asked, prompt = seq.params.max_tokens, seq.num_prompt_tokens
            assert 0 < prompt < self.max_model_len and (asked is None or prompt + asked <= self.max_model_len), \
                f"request {request_id!r} was not admitted by check_fits"
            seq.max_tokens = min(context - prompt if asked is None else asked, self.max_model_len - prompt)
            seq.status = SequenceStatus.WAITING
            if self.makespan_target:  # longest first; FCFS among equals (and behind preempted ones)
                self.waiting.insert(bisect.bisect_right(self.waiting, _admission_key(seq), key=_admission_key), seq)
            else:
                self.waiting.append(seq)

    # ---- one step ------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop its K/V, put it at the head of the waiting queue."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, seq)

    def _leader(self, seq: Sequence) -> Sequence | None:
        """The index-0 sample of `seq`'s request, if `seq` is another sample of it."""
        if seq.index == 0:
            return None
        group = self._groups.get(seq.request_id)
        return group[0] if group else None

    def _waits_for_leader(self, seq: Sequence, leader: Sequence | None) -> bool:
        """A sibling sample waits until its leader's prompt K/V exist, so it can share them."""
        if leader is None or leader.is_finished:
            return False
        if (seq.num_prompt_tokens - 1) // self.block_manager.block_size == 0:
            return False  # no full prompt block to share
        # Its first token back means the step that wrote the prompt's K/V was processed (so the
        # blocks are also registered in the prefix cache), even with async scheduling.
        return leader.num_resolved_output_tokens == 0

    def prompt_work_ahead(self) -> bool:
        """Whether the next `schedule()` is likely to compute prompt tokens: a running sequence is
        mid-prompt, or the first waiting one could be admitted (a slot and a free block are there).
        Cheap and conservative; the engine reads it to decide how to order its next step."""
        if self.waiting and len(self.running) < self.max_num_seqs and self.block_manager.num_free_blocks > 0:
            return True
        return any(len(s.token_ids) - s.num_computed_tokens > 1 for s in self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running sequences first (preempting if needed), then FCFS admissions."""
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        num_prompt = 0  # tokens of chunks that start inside the prompt (a statistic)
        loras: set | None = set() if self.max_loras is not None else None  # this step's adapters

        # Running sequences in arrival order; victims are taken from the back, so a sequence
        # already scheduled this step is never preempted.
        block_size = bm.block_size
        if self.makespan_target:  # one pass: the decodes, the horizon and the prompts under way
            num_decodes, horizon, under_way = 0, 0, []
            for s in self.running:
                n = len(s.token_ids)
                left = n - s.num_computed_tokens
                if left == 1:
                    num_decodes += 1
                elif left > 1:
                    under_way.append(s)
                horizon = max(horizon, s.num_prompt_tokens + s.max_tokens - n)
        else:
            num_decodes = sum(1 for s in self.running if len(s.token_ids) - s.num_computed_tokens == 1)
        # Prompt tokens (chunks of more than one token) this step may still take. The budget's room
        # for them is what the decodes leave: a chunk of an earlier sequence never pushes a later
        # sequence's decode out of the step (budget >= max_num_seqs >= the decodes).
        prefill_left = budget - num_decodes
        assert prefill_left >= 0, (budget, num_decodes)
        if num_decodes and self.prefill_cap_while_decoding:
            prefill_left = min(prefill_left, self.prefill_cap_while_decoding)
        if num_decodes and self.makespan_target and (self.waiting or under_way):
            due = self._prompt_tokens_due(horizon, under_way)
            prefill_left = min(prefill_left, max(self.makespan_target - num_decodes, due))
        sizes = self.step_sizes
        if num_decodes and prefill_left > 0 and sizes and num_decodes + prefill_left <= sizes[-1]:
            # The step runs padded to the next size: prompt tokens may fill the padding.
            size = min(sizes[bisect.bisect_left(sizes, num_decodes + prefill_left)], budget)
            prefill_left = size - num_decodes
        spec = self.speculator if self.speculator is not None and self.speculator.active(len(self.running)) else None
        if spec is not None:  # every decode's proposal at once (a draft model batches its forwards)
            spec.prefetch([s for s in self.running
                           if s.token_ids[-1] != PLACEHOLDER and len(s.token_ids) - s.num_computed_tokens == 1])
        num_verify = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            ids = seq.token_ids
            num_tokens = len(ids)
            if ids[-1] == PLACEHOLDER and num_tokens - seq.num_prompt_tokens >= seq.max_tokens:
                i += 1  # its token in flight is its last: nothing more to compute
                continue
            if loras is not None and not self._lora_fits(seq, loras):
                i += 1  # its adapter would need one slot too many: it waits a step
                continue
            if spec is not None and num_tokens - seq.num_computed_tokens == 1 and ids[-1] != PLACEHOLDER:
                item = self._verify_item(seq, spec, min(prefill_left, budget - 1))
                if item is not None:
                    scheduled.append(item)
                    budget -= item.num_tokens
                    prefill_left -= item.num_drafts
                    num_verify += 1
                    i += 1
                    continue
            computed = seq.num_computed_tokens
            num_new = min(num_tokens - computed, budget, self.chunk_cap)
            assert num_new > 0, f"running seq {seq.seq_id} has nothing to compute"
            if num_new > 1:  # a prompt (or recompute) chunk
                num_new = min(num_new, prefill_left)
                if num_new == 0:
                    i += 1  # this step's prompt tokens are spent: it goes on next step
                    continue
                prefill_left -= num_new
            end = computed + num_new
            if end <= len(seq.block_table) * block_size:
                # The common decode: its slots exist already (no new block, nothing to preempt).
                # (`_advance`, inlined: this runs for every running sequence every step)
                seq.num_computed_tokens = end
                scheduled.append(ScheduledSequence(seq, num_new, end == num_tokens, computed))
                if computed < len(seq.prompt_token_ids):
                    num_prompt += num_new
                budget -= num_new
                i += 1
                continue
            while not bm.can_append(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: it was the last running sequence
            bm.append_slots(seq, num_new)
            if computed < len(seq.prompt_token_ids):
                num_prompt += num_new
            scheduled.append(self._advance(seq, num_new))
            budget -= num_new
            i += 1

        # Admit waiting sequences FCFS, unless this step had to preempt (no room to grow).
        j = 0
        while not preempted and j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[j]
            assert seq.token_ids[-1] != PLACEHOLDER, f"seq {seq.seq_id} waits with a token in flight"
            leader = self._leader(seq)
            if (self._waits_for_leader(seq, leader) or (self.suspects and self._another_suspect_runs(seq))
                    or (loras is not None and not self._lora_fits(seq, loras, admit=False))):
                j += 1
                continue
            donor = leader if leader is not None and not leader.is_finished else None
            num_cached = bm.num_cached_tokens(seq, donor)
            num_new = min(seq.num_tokens - num_cached, budget, self.chunk_cap)
            if num_new > 1:
                num_new = min(num_new, prefill_left)
                if num_new == 0:
                    break  # this step's prompt tokens are spent
            if not self.enable_chunked_prefill and num_new < seq.num_tokens - num_cached:
                break
            if not bm.can_allocate(seq, num_new, donor):
                break
            num_cached = bm.allocate(seq, num_new, donor)
            if loras is not None and seq.lora_request is not None:
                loras.add(seq.lora_request)
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            del self.waiting[j]
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)
            if num_cached < len(seq.prompt_token_ids):
                num_prompt += num_new
            scheduled.append(self._advance(seq, num_new))
            budget -= num_new
            if num_new > 1:
                prefill_left -= num_new

        # Decodes (one query token) first, as AttentionMetadata expects; stable otherwise.
        decodes = [s for s in scheduled if s.num_tokens == 1]
        if len(decodes) == len(scheduled):  # the steady decode step: nothing to reorder
            return SchedulerOutput(scheduled, len(scheduled), preempted, num_prompt)
        others = [s for s in scheduled if s.num_tokens != 1]
        return SchedulerOutput(decodes + others, len(decodes), preempted, num_prompt, num_verify)

    def _verify_item(self, seq: Sequence, spec: Speculator, room: int) -> ScheduledSequence | None:
        """A decode of `seq` carrying draft tokens (at most `room` of them), or None: nothing to
        propose, or no free block for them (a draft never preempts anyone)."""
        # (the step yields up to drafts + 1 tokens: no draft past the sample's last token)
        room = min(room, seq.max_tokens - seq.num_output_tokens - 1)
        if room <= 0:
            return None
        drafts = spec.propose(seq, room)
        if not drafts or not self.block_manager.can_append(seq, 1 + len(drafts)):
            return None
        start = seq.num_computed_tokens
        seq.token_ids.extend(drafts)
        seq.num_drafts = len(drafts)
        self.block_manager.append_slots(seq, 1 + len(drafts))
        seq.num_computed_tokens = start + 1 + len(drafts)
        return ScheduledSequence(seq, 1 + len(drafts), True, start, len(drafts))

    def _prompt_tokens_due(self, horizon: int, under_way: list[Sequence]) -> int:
        """Prompt tokens per step that let every waiting sequence start decoding in time.

        The running sequences may decode for up to `horizon` more steps; `under_way` are those
        still computing their prompts (their chunks take a step's tokens first). A waiting sequence with
        `o` tokens to produce must have its prompt (and those of the sequences admitted before it)
        computed within `horizon - o` steps, or it finishes later than they do; the answer is the
        highest rate any of them needs (the whole budget once one is out of time). The horizon
        comes from `max_tokens`, an upper bound: a sequence that stops early only shortens it, and
        each later step sees that.
        """
        due = tokens = 0
        for seq in itertools.chain(under_way, self.waiting):
            n = len(seq.token_ids)
            tokens += n - seq.num_computed_tokens
            steps = horizon - seq.num_prompt_tokens - seq.max_tokens + n - 1
            if steps <= 0:
                return self.max_num_batched_tokens
            rate = -(-tokens // steps)
            if rate > due:
                due = rate
        return due

    def _lora_fits(self, seq: Sequence, loras: set, admit: bool = True) -> bool:
        """Whether `seq`'s adapter (if any) fits this step's slots; with `admit`, count it in."""
        lora = seq.lora_request
        if lora is None or lora in loras:
            return True
        if len(loras) >= self.max_loras:  # type: ignore[operator]
            return False
        if admit:
            loras.add(lora)
        return True

    def _another_suspect_runs(self, seq: Sequence) -> bool:
        """Whether `seq` is a suspect and a different suspect request is already running."""
        rid = seq.request_id
        return rid in self.suspects and any(
            s.request_id in self.suspects and s.request_id != rid for s in self.running)

    def requeue_all(self) -> None:
        """Forget every step in flight: drop placeholders, preempt every running sequence (recompute).

        Used after a failed step, whose device state cannot be trusted: each sequence keeps
        its resolved tokens and recomputes its KV cache when it is admitted again.
        """
        for seq in reversed(list(self.running)):
            self._preempt(seq)
        for seq in self.waiting:
            seq.drop_placeholders()
        assert not self.running

    @staticmethod
    def _advance(seq: Sequence, num_new: int) -> ScheduledSequence:
        """Record `num_new` tokens of `seq` as scheduled and count them computed from now on."""
        start = seq.num_computed_tokens
        seq.num_computed_tokens = start + num_new
        return ScheduledSequence(seq, num_new, start + num_new == seq.num_tokens, start)

    def update(self, sched_out: SchedulerOutput, runner_out: StepOutput) -> list[tuple[Sequence, SampledToken]]:
        """Store sampled tokens, register computed blocks, finish sequences that hit EOS / length.

        Returns:
            (sequence, sampled token) for every sequence that got a token this step, in
            schedule order; finished ones have status FINISHED and their blocks freed.
        """
        samples = iter(runner_out.sampled)
        results: list[tuple[Sequence, SampledToken]] = []
        bm = self.block_manager
        block_size = bm.block_size
        caching = bm.enable_prefix_caching
        finished, running = SequenceStatus.FINISHED, SequenceStatus.RUNNING
        eos = self.eos_token_ids
        for item in sched_out.scheduled:
            seq = item.seq
            sampled = next(samples) if item.sample else None
            status = seq.status
            if status is finished:
                continue  # aborted (or ended by an earlier token) while the step ran
            if item.num_drafts:
                self._accept(item, sampled, results)  # type: ignore[arg-type]
                continue
            start, end = item.start, item.start + item.num_tokens
            if caching and status is running and end // block_size > start // block_size:
                # A block filled up (and the sequence was not preempted since, so its blocks
                # hold this step's K/V): register it in the prefix cache.
                bm.cache_computed_blocks(seq, end)
            if sampled is None:
                continue
            token_id = sampled.token_id
            ids = seq.token_ids
            if len(ids) == end:
                ids.append(token_id)
            else:
                assert ids[end] == PLACEHOLDER, f"seq {seq.seq_id}: position {end} already resolved"
                ids[end] = token_id
            results.append((seq, sampled))
            # (only a token that can end it pays for `_check_stop`: most tokens of most steps cannot)
            if end + 1 - seq.num_prompt_tokens >= seq.max_tokens or token_id in eos or seq.params.stop_token_ids:
                reason, stop = self._check_stop(seq, end + 1, token_id)
                if reason is not None:
                    self.finish(seq, reason, stop)
        assert next(samples, None) is None, "runner returned more samples than scheduled"
        return results

    def _accept(self, item: ScheduledSequence, sampled: SampledToken,
                results: list[tuple[Sequence, SampledToken]]) -> None:
        """A verify step's tokens: drafts out, the accepted ones and the target's token in, K/V of
        the rejected positions rolled back (their slots are written over by the next step; the
        blocks stay with the sequence, which grows into them), stops applied token by token."""
        seq = item.seq
        assert seq.status is SequenceStatus.RUNNING and seq.num_drafts == item.num_drafts, (
            f"seq {seq.seq_id}: verify result for a sequence that moved on")
        tokens = [sampled, *(sampled.following or ())]
        accepted = len(tokens) - 1
        assert accepted <= item.num_drafts, (accepted, item.num_drafts)
        start = item.start
        ids = seq.token_ids
        # (accepted drafts are the tokens already there: the worker's copy stays valid up to them)
        del ids[start + 1:]
        ids.extend(t.token_id for t in tokens)
        seq.num_drafts = 0
        seq.num_computed_tokens = start + 1 + accepted
        seq.num_synced = min(seq.num_synced, start + 1 + accepted)
        self.speculator.record(seq.seq_id, item.num_drafts, accepted, len(ids))  # type: ignore[union-attr]
        bm = self.block_manager
        if bm.enable_prefix_caching and (start + 1 + accepted) // bm.block_size > start // bm.block_size:
            bm.cache_computed_blocks(seq, start + 1 + accepted)  # only what holds accepted K/V
        eos, stop_ids = self.eos_token_ids, seq.params.stop_token_ids
        for j, token in enumerate(tokens):
            n = start + 2 + j  # tokens of the sample with this one
            token.more = 0
            results.append((seq, token))
            if n - seq.num_prompt_tokens >= seq.max_tokens or token.token_id in eos or stop_ids:
                reason, stop = self._check_stop(seq, n, token.token_id)
                if reason is not None:
                    del ids[n:]
                    self.finish(seq, reason, stop)
                    break
        else:
            j = len(tokens) - 1
        for m, token in enumerate(tokens[:j]):
            token.more = j - m

    def _check_stop(self, seq: Sequence, num_tokens: int, token_id: int) -> tuple[FinishReason | None, int | None]:
        """Why `seq` ends with `token_id` as its token number `num_tokens`, if it does."""
        params = seq.params
        if num_tokens - seq.num_prompt_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return FinishReason.EOS, token_id
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.EOS, None
        if num_tokens - seq.num_prompt_tokens >= seq.max_tokens:
            return FinishReason.LENGTH, None
        return None, None

    # ---- ending --------------------------------------------------------------------------

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End one sample now (EOS, length, stop string, abort): frees its blocks at once."""
        if seq.is_finished:
            return
        seq.drop_placeholders()
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        group = self._groups.get(seq.request_id)
        if group is not None and all(s.is_finished for s in group):
            del self._groups[seq.request_id]

    def abort_request(self, request_id: str) -> list[Sequence]:
        """Finish every unfinished sample of a request with ABORT; returns the ones it ended."""
        group = self._groups.get(request_id)
        if group is None:
            return []
        ended = [s for s in group if not s.is_finished]
        for seq in ended:
            self.finish(seq, FinishReason.ABORT)
        return ended

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)


def _admission_key(seq: Sequence) -> int:
    """Waiting order with `makespan_target`: preempted sequences first (as FCFS puts them), then the
    most output tokens still to produce first."""
    return -(1 << 62) if seq.num_preemptions else -(seq.max_tokens - seq.num_output_tokens)
