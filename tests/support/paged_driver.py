"""Test helper: drive a ModelRunner step by step without the engine or scheduler.

`PagedDriver` hands out KV blocks from a shuffled free list (so block tables are scattered,
never contiguous), builds `SchedulerOutput`s (decodes first) from `(seq, num_tokens)` pairs,
and advances counters as the scheduler would. `logits(...)` runs the same inputs through the
model but returns the logits of every row, for comparisons with transformers.
"""

from __future__ import annotations

import itertools
import random

import torch

from serving.sampling_params import SamplingParams
from serving.engine.plan_builder import build_plan
from serving.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from serving.executor.plan import StepOutput
from serving.engine.sequence import Sequence, SequenceStatus
from serving.executor.step_inputs import prepare_inputs


_SEQ_IDS = itertools.count()  # unique across drivers: the runner keys seeded state by seq_id


class PagedDriver:
    """Minimal stand-in for the scheduler + block manager around a ModelRunner."""

    def __init__(self, runner, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.free = list(range(runner.cache_config.num_blocks))
        random.Random(seed).shuffle(self.free)

    def add(self, prompt_ids: list[int], params: SamplingParams | None = None, index: int = 0) -> Sequence:
        sid = next(_SEQ_IDS)
        seq = Sequence(seq_id=sid, request_id=f"r{sid}", prompt_token_ids=list(prompt_ids),
                       params=params or SamplingParams(temperature=0.0, max_tokens=64), index=index)
        seq.status = SequenceStatus.RUNNING
        return seq

    def release(self, seq: Sequence) -> None:
        self.free.extend(seq.block_table)
        seq.block_table = []
        self.runner.free_sequence(seq.seq_id)

    def _schedule(self, work: list[tuple[Sequence, int]]) -> SchedulerOutput:
        items = []
        for seq, n in work:
            need = (seq.num_computed_tokens + n + self.block_size - 1) // self.block_size
            while len(seq.block_table) < need:
                seq.block_table.append(self.free.pop())
            items.append(ScheduledSequence(seq, n, seq.num_computed_tokens + n == seq.num_tokens, seq.num_computed_tokens))
        decodes = [i for i in items if i.num_tokens == 1]
        return SchedulerOutput(decodes + [i for i in items if i.num_tokens != 1], num_decodes=len(decodes))

    def step(self, work: list[tuple[Sequence, int]]) -> tuple[SchedulerOutput, StepOutput]:
        """Run one step; sampled tokens are appended to their sequences."""
        out = self._schedule(work)
        res = self.runner.execute(build_plan(0, out))
        samples = iter(res.sampled)
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            if item.sample:
                item.seq.token_ids.append(next(samples).token_id)
        return out, res

    @torch.inference_mode()
    def logits(self, work: list[tuple[Sequence, int]]) -> dict[int, torch.Tensor]:
        """Forward one step and return {seq_id: logits [num_tokens, vocab]} without sampling."""
        out = self._schedule(work)
        plan = build_plan(0, out)
        self.runner.batch.apply(plan)
        inputs = prepare_inputs(plan, self.runner.batch, self.block_size, self.runner.device)
        hidden = self.runner._forward(inputs.input_ids, inputs.positions, inputs.meta)
        logits = self.runner.model.compute_logits(hidden).cpu()
        result, row = {}, 0
        for item in out.scheduled:
            result[item.seq.seq_id] = logits[row : row + item.num_tokens]
            row += item.num_tokens
            item.seq.num_computed_tokens += item.num_tokens
        return result

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 max_new_tokens: int, chunk: int | None = None) -> list[Sequence]:
        """Run all prompts together (chunked prefill of `chunk` tokens) for max_new_tokens each."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add(p, sp) for p, sp in zip(prompts, plist)]
        while any(s.num_output_tokens < max_new_tokens for s in seqs):
            work = []
            for s in seqs:
                if s.num_output_tokens >= max_new_tokens:
                    continue
                left = s.num_tokens - s.num_computed_tokens
                work.append((s, min(left, chunk) if chunk else left))
            self.step(work)
        return seqs
