"""Scheduler: chunked prefill, decode-first batches, FCFS admission, preemption order, stops."""

from __future__ import annotations

import pytest
from core_factories import FakeRunner, make_sequence

from serving.engine.block_manager import BlockManager
from serving.engine.plan_builder import build_plan
from serving.engine.scheduler import Scheduler
from serving.executor.plan import SampledToken, StepOutput
from serving.engine.sequence import PLACEHOLDER, FinishReason, SequenceStatus


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=4, budget=8, max_model_len=64, eos=(), **kw):
    bm = BlockManager(num_blocks, block_size, kw.pop("enable_prefix_caching", True))
    return Scheduler(bm, max_num_seqs, budget, max_model_len, eos, **kw), FakeRunner()


def step(sched: Scheduler, runner: FakeRunner):
    out = sched.schedule()
    return out, sched.update(out, runner.execute(out))


def run_to_end(sched: Scheduler, runner: FakeRunner, limit: int = 200) -> None:
    for _ in range(limit):
        if not sched.has_unfinished():
            return
        step(sched, runner)
    raise AssertionError("scheduler did not finish (deadlock?)")


def test_chunked_prefill_then_mixed_decode_first() -> None:
    sched, runner = make_scheduler(budget=8)
    s0 = make_sequence(0, list(range(10)), max_tokens=3)
    s1 = make_sequence(1, list(range(100, 103)), max_tokens=3)
    s2 = make_sequence(2, list(range(200, 212)), max_tokens=2)
    sched.add_sequences([s0])
    sched.add_sequences([s1])
    out, _ = step(sched, runner)
    assert runner.steps[-1] == [(0, 8, False)] and out.num_decodes == 0
    assert s0.block_table == [0, 1] and s0.num_computed_tokens == 8 and s0.num_output_tokens == 0
    out, got = step(sched, runner)
    assert runner.steps[-1] == [(0, 2, True), (1, 3, True)]
    assert [(s.seq_id, t.token_id) for s, t in got] == [(0, 1000), (1, 1001)]
    assert s0.block_table == [0, 1, 2] and s1.block_table == [3]
    sched.add_sequences([s2])
    out, _ = step(sched, runner)
    # Two decodes, then a 6-token chunk of the new prompt within the 8-token budget.
    assert runner.steps[-1] == [(0, 1, True), (1, 1, True), (2, 6, False)] and out.num_decodes == 2
    assert s1.block_table == [3] and s2.block_table == [4, 5]
    out, _ = step(sched, runner)
    assert runner.steps[-1] == [(0, 1, True), (1, 1, True), (2, 6, True)]
    assert s0.is_finished and s1.is_finished and s0.finish_reason is FinishReason.LENGTH
    assert s0.output_token_ids == [1000] * 3
    run_to_end(sched, runner)
    assert s2.output_token_ids == [1002, 1002]
    assert sched.block_manager.num_free_blocks == 16


def test_decodes_ordered_before_a_running_prefill() -> None:
    # A preempted, earlier sequence re-prefills while a later one decodes: decodes go first.
    sched, runner = make_scheduler(num_blocks=4, budget=16, max_model_len=16, enable_prefix_caching=False)
    s0 = make_sequence(0, [1, 2, 3], max_tokens=9)
    s1 = make_sequence(1, [4, 5, 6], max_tokens=2)
    sched.add_sequences([s0])
    sched.add_sequences([s1])
    step(sched, runner)
    sched.running.remove(s0)  # simulate s0 coming back: a 4-token prefill, running before s1
    sched.block_manager.free(s0)
    s0.num_computed_tokens = 0
    sched.block_manager.allocate(s0, 4)
    sched.running.insert(0, s0)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_tokens) for s in out.scheduled] == [(1, 1), (0, 4)] and out.num_decodes == 1


def test_preempts_latest_arrival_and_recomputes() -> None:
    sched, runner = make_scheduler(num_blocks=6, budget=64, max_num_seqs=8, max_model_len=24)
    seqs = [make_sequence(i, [10 * i + k for k in range(4)], max_tokens=8) for i in range(3)]
    for s in seqs:
        sched.add_sequences([s])
    for _ in range(5):
        out, _ = step(sched, runner)
        assert out.preempted == []
    assert [s.block_table for s in seqs] == [[0, 3], [1, 4], [2, 5]]
    out, _ = step(sched, runner)  # everyone needs a 3rd block; only by preempting seq 2
    assert out.preempted == [seqs[2]] and [s.seq.seq_id for s in out.scheduled] == [0, 1]
    assert sched.waiting == [seqs[2]] and seqs[2].status is SequenceStatus.WAITING
    assert seqs[2].num_computed_tokens == 0 and seqs[2].block_table == [] and seqs[2].num_preemptions == 1
    # seq 2's computed full blocks (2, 5) were cached; evicted LRU-first for seq 0, then seq 1.
    assert seqs[0].block_table == [0, 3, 5] and seqs[1].block_table == [1, 4, 2]
    step(sched, runner)
    assert runner.steps[-1] == [(0, 1, True), (1, 1, True)]  # no room yet to re-admit seq 2
    step(sched, runner)
    assert seqs[0].is_finished and seqs[1].is_finished
    step(sched, runner)  # seq 2 recomputes prompt + its 5 outputs in one chunk
    assert runner.steps[-1] == [(2, 9, True)]
    run_to_end(sched, runner)
    assert seqs[2].output_token_ids == [1002] * 8 and seqs[2].finish_reason is FinishReason.LENGTH
    assert sched.block_manager.num_free_blocks == 6 and sched.num_preemptions == 1


def test_two_victims_in_one_step_keep_arrival_order() -> None:
    sched, runner = make_scheduler(num_blocks=5, budget=64, max_num_seqs=8, max_model_len=20)
    seqs = [make_sequence(i, [10 * i + k for k in range(3)], max_tokens=6) for i in range(4)]
    for s in seqs:
        sched.add_sequences([s])
    step(sched, runner)
    step(sched, runner)
    assert [s.block_table for s in seqs] == [[0], [1], [2], [3]]
    out, _ = step(sched, runner)  # all need a 2nd block, one is free
    assert out.preempted == [seqs[3], seqs[2]]  # latest first
    assert sched.waiting == [seqs[2], seqs[3]]  # but re-queued in arrival order
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]
    assert seqs[0].block_table == [0, 4] and seqs[1].block_table == [1, 3]
    run_to_end(sched, runner)
    assert all(s.output_token_ids == [1000 + s.seq_id] * 6 for s in seqs)
    assert sched.block_manager.num_free_blocks == 5


def test_single_sequence_that_fits_never_deadlocks() -> None:
    sched, runner = make_scheduler(num_blocks=4, budget=4, max_num_seqs=2, max_model_len=16)
    s0 = make_sequence(0, list(range(10)), max_tokens=6)
    sched.add_sequences([s0])
    run_to_end(sched, runner)
    assert s0.num_output_tokens == 6 and sched.block_manager.num_free_blocks == 4


def test_admission_rejects_requests_that_can_never_fit() -> None:
    sched, _ = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len=32"):
        sched.check_fits(30, 5)
    with pytest.raises(ValueError, match="KV cache"):
        sched.check_fits(10, 10)
    with pytest.raises(ValueError, match="empty"):
        sched.check_fits(0, 1)
    sched.check_fits(10, 6)  # 16 tokens: the whole KV cache
    with pytest.raises(AssertionError, match="not admitted"):  # the engine asserts what admission checked
        sched.add_sequences([make_sequence(0, list(range(30)), max_tokens=5)])
    assert not sched.has_unfinished()
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(max_num_seqs=16, budget=8)


def test_max_num_seqs_cap_and_fcfs() -> None:
    sched, runner = make_scheduler(max_num_seqs=2, budget=64)
    seqs = [make_sequence(i, [i, i + 1], max_tokens=2) for i in range(3)]
    for s in seqs:
        sched.add_sequences([s])
    step(sched, runner)
    assert runner.steps[-1] == [(0, 2, True), (1, 2, True)] and sched.waiting == [seqs[2]]
    step(sched, runner)
    step(sched, runner)
    assert runner.steps[-1] == [(2, 2, True)]


def test_stop_conditions() -> None:
    outputs = {0: [5, 7], 1: [7, 7, 7], 2: [7, 7, 7, 9], 3: [3, 4, 8, 1]}
    runner = FakeRunner(lambda seq: outputs[seq.seq_id][seq.num_output_tokens])
    sched, _ = make_scheduler(eos=[7], budget=16)
    s0 = make_sequence(0, [1, 2], max_tokens=4)
    s1 = make_sequence(1, [1, 2], max_tokens=3, ignore_eos=True)
    s2 = make_sequence(2, [1, 2], max_tokens=4, min_tokens=3, stop_token_ids=[9])
    s3 = make_sequence(3, [1, 2], max_tokens=4, stop_token_ids=[8])
    for s in (s0, s1, s2, s3):
        sched.add_sequences([s])
    run_to_end(sched, runner)
    assert (s0.output_token_ids, s0.finish_reason, s0.stop_reason) == ([5, 7], FinishReason.EOS, None)
    assert (s1.output_token_ids, s1.finish_reason) == ([7, 7, 7], FinishReason.LENGTH)
    assert (s2.output_token_ids, s2.finish_reason) == ([7, 7, 7], FinishReason.EOS)  # eos counts from 3
    assert (s3.output_token_ids, s3.finish_reason, s3.stop_reason) == ([3, 4, 8], FinishReason.EOS, 8)
    assert sched.block_manager.num_free_blocks == 16


def test_abort_frees_blocks_at_once() -> None:
    sched, runner = make_scheduler()
    a = make_sequence(0, list(range(9)), request_id="a")
    b = make_sequence(1, list(range(50, 53)), request_id="b")
    sched.add_sequences([a])
    sched.add_sequences([b])
    step(sched, runner)
    assert a.block_table == [0, 1]
    assert sched.abort_request("a") == [a]
    assert a.finish_reason is FinishReason.ABORT and a.block_table == [] and sched.running == []
    assert sched.abort_request("a") == []
    assert sched.abort_request("b") == [b] and b.finish_reason is FinishReason.ABORT
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 16


def test_n_samples_share_the_leaders_prompt_blocks() -> None:
    for caching in (True, False):
        sched, runner = make_scheduler(budget=16, enable_prefix_caching=caching)
        group = [make_sequence(i, list(range(10)), request_id="r", index=i, max_tokens=3) for i in range(2)]
        sched.add_sequences(group)
        step(sched, runner)
        assert runner.steps[-1] == [(0, 10, True)]  # the sibling waits for the prompt's K/V
        step(sched, runner)
        assert runner.steps[-1] == [(0, 1, True), (1, 2, True)]
        assert group[0].block_table == [0, 1, 2] and group[1].block_table == [0, 1, 3]
        assert group[1].num_cached_tokens == 8
        assert [b.ref_count for b in sched.block_manager.blocks[:4]] == [2, 2, 1, 1]
        run_to_end(sched, runner)
        assert sched.block_manager.num_free_blocks == 16


def test_prefix_cache_hit_across_requests() -> None:
    sched, runner = make_scheduler(budget=16)
    a = make_sequence(0, list(range(12)), max_tokens=1)
    sched.add_sequences([a])
    run_to_end(sched, runner)
    b = make_sequence(1, list(range(8)) + [99, 98], max_tokens=2)
    sched.add_sequences([b])
    step(sched, runner)
    assert runner.steps[-1] == [(1, 2, True)] and b.num_cached_tokens == 8
    assert b.block_table[:2] == [0, 1]


def test_long_prefill_token_threshold_spreads_a_long_prompt_over_short_steps() -> None:
    # vLLM's option: a prompt with more than 4 tokens left gets 4 per step, whether it is newly
    # admitted or already running; short prompts and decodes are untouched, and the budget
    # still holds several capped chunks at once.
    sched, runner = make_scheduler(budget=16, max_num_seqs=4, long_prefill_token_threshold=4)
    a = make_sequence(0, [1, 2, 3], max_tokens=6)
    sched.add_sequences([a])
    step(sched, runner)
    assert runner.steps[-1] == [(0, 3, True)]
    long_ = make_sequence(1, list(range(10, 21)), max_tokens=2)  # 11 prompt tokens
    other = make_sequence(2, list(range(30, 36)), max_tokens=2)  # 6
    sched.add_sequences([long_])
    sched.add_sequences([other])
    step(sched, runner)
    assert runner.steps[-1] == [(0, 1, True), (1, 4, False), (2, 4, False)]
    step(sched, runner)
    assert runner.steps[-1] == [(0, 1, True), (1, 4, False), (2, 2, True)]
    step(sched, runner)
    assert runner.steps[-1] == [(0, 1, True), (2, 1, True), (1, 3, True)]
    run_to_end(sched, runner)
    assert long_.output_token_ids == [1001, 1001] and a.num_output_tokens == 6


def test_prompt_tokens_are_capped_only_in_steps_that_decode() -> None:
    # With nothing decoding, prompts fill the budget; once a stream decodes, all prompt chunks of a
    # step together take at most 5 tokens (two arrivals share them, first come first).
    sched, runner = make_scheduler(budget=32, max_num_seqs=4, num_blocks=32, max_prefill_tokens_while_decoding=5)
    a = make_sequence(0, list(range(12)), max_tokens=8)
    sched.add_sequences([a])
    step(sched, runner)
    assert runner.steps[-1] == [(0, 12, True)]  # no decode yet: the whole prompt at once
    b = make_sequence(1, list(range(20, 27)), max_tokens=2)  # 7 prompt tokens
    c = make_sequence(2, list(range(40, 46)), max_tokens=2)  # 6
    sched.add_sequences([b])
    sched.add_sequences([c])
    step(sched, runner)
    assert runner.steps[-1] == [(0, 1, True), (1, 5, False)]
    step(sched, runner)
    assert runner.steps[-1] == [(0, 1, True), (1, 2, True), (2, 3, False)]
    step(sched, runner)
    assert runner.steps[-1] == [(0, 1, True), (1, 1, True), (2, 3, True)]
    run_to_end(sched, runner)
    assert b.output_token_ids == [1001, 1001] and c.num_output_tokens == 2 and a.num_output_tokens == 8


def test_chunked_prefill_disabled_admits_whole_prompts_only() -> None:
    sched, runner = make_scheduler(budget=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="chunked prefill is disabled"):
        sched.check_fits(9, 16)
    a = make_sequence(1, list(range(5)), max_tokens=2)
    b = make_sequence(2, list(range(50, 55)), max_tokens=2)
    sched.add_sequences([a])
    sched.add_sequences([b])
    step(sched, runner)
    assert runner.steps[-1] == [(1, 5, True)]  # b does not fit in the 3 tokens left
    step(sched, runner)
    assert runner.steps[-1] == [(1, 1, True), (2, 5, True)]


def test_async_placeholders_length_eos_and_preemption() -> None:
    # seq 0 ends by length (never scheduled past its last token), seq 1 by EOS (one wasted
    # step, its placeholder dropped), seq 2 is preempted with a token in flight.
    sched, _ = make_scheduler(num_blocks=4, block_size=4, budget=32, max_num_seqs=4, eos=(7,))
    runner = FakeRunner(lambda seq: 7 if seq.seq_id == 1 else 50 + seq.num_output_tokens)
    s0 = make_sequence(0, [1, 2, 3], max_tokens=3)
    s1 = make_sequence(1, [4, 5, 6], max_tokens=8)
    s2 = make_sequence(2, [8, 9, 10, 11, 12, 13, 14], max_tokens=6)
    for s in (s0, s1, s2):
        sched.add_sequences([s])
    out = sched.schedule()
    runner.execute(out)  # (the fake runner reads the sequences, so it runs before the plan's placeholders go in)
    build_plan(0, out, placeholders=True)
    assert [(i.seq.seq_id, i.start, i.num_tokens) for i in out.scheduled] == [(0, 0, 3), (1, 0, 3), (2, 0, 7)]
    assert s0.token_ids == [1, 2, 3, PLACEHOLDER] and s0.num_computed_tokens == 3
    nxt = sched.schedule()  # planned before step 1's tokens are known: all three decode their placeholder
    assert [(i.seq.seq_id, i.start, i.num_tokens) for i in nxt.scheduled] == [(0, 3, 1), (1, 3, 1), (2, 7, 1)]
    res = runner.execute(nxt)
    build_plan(1, nxt, placeholders=True)  # launched before step 1's tokens are read, as the engine does
    sched.update(out, StepOutput([SampledToken(50), SampledToken(7), SampledToken(50)]))
    # s1 ended on EOS: its placeholder is dropped, its extra token is computed but never stored
    assert s1.is_finished and s1.output_token_ids == [7] and s1.finish_reason is FinishReason.EOS
    assert s0.token_ids == [1, 2, 3, 50, PLACEHOLDER] and s2.num_resolved_output_tokens == 1
    _async_run_from(sched, runner, (nxt, res))
    assert s0.output_token_ids == [50, 51, 52] and s0.finish_reason is FinishReason.LENGTH
    assert [n for step in runner.steps for sid, n, _ in step if sid == 0] == [3, 1, 1]  # no 4th step
    assert s2.output_token_ids == [50, 51, 52, 53, 54, 55] and s2.num_preemptions >= 1
    assert PLACEHOLDER not in s0.token_ids + s1.token_ids + s2.token_ids
    assert sched.block_manager.num_free_blocks == 4 and not sched.has_unfinished()


def _async_run_from(sched: Scheduler, runner: FakeRunner, inflight, limit: int = 100) -> None:  # noqa: ANN001
    """The async engine loop: launch step N (placeholders), then read step N-1's tokens."""
    for step_id in range(2, 2 + limit):
        out = sched.schedule()
        if out.is_empty:
            if inflight is None:
                return
            sched.update(*inflight)
            inflight = None
            continue
        res = runner.execute(out)
        build_plan(step_id, out, placeholders=True)
        if inflight is not None:
            sched.update(*inflight)
        inflight = (out, res)
    raise AssertionError("async loop did not finish")


def test_no_max_tokens_runs_to_the_context_limit_capped_by_the_kv_cache() -> None:
    """max_tokens=None (OpenAI chat without max_tokens): up to max_model_len, or up to what the whole
    KV cache holds when that is less (16 tokens here), never a refusal for a prompt that fits."""
    sched, runner = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    seq = make_sequence(0, list(range(10)), max_tokens=None)
    sched.add_sequences([seq])
    run_to_end(sched, runner)
    assert seq.num_output_tokens == 6 and seq.finish_reason is FinishReason.LENGTH
    sched, runner = make_scheduler(num_blocks=16, block_size=4, max_model_len=32)
    seq = make_sequence(1, list(range(10)), max_tokens=None)
    sched.add_sequences([seq])
    run_to_end(sched, runner)
    assert seq.num_output_tokens == 22 and sched.block_manager.num_free_blocks == 16
    with pytest.raises(ValueError, match="KV cache"):  # the prompt alone does not fit
        make_scheduler(num_blocks=4, block_size=4, max_model_len=32)[0].check_fits(20, None)


def test_prompt_token_count_matches_the_chunks_that_start_in_the_prompt() -> None:
    # Chunked prefill, prefix-cache hits (a one-token admission), decodes, preemption and its
    # recompute: every step's count is that of the chunks starting inside their prompt.
    sched, runner = make_scheduler(num_blocks=9, budget=6, max_num_seqs=4)
    prompt = list(range(9))
    for i in range(5):
        sched.add_sequences([make_sequence(i, prompt if i % 2 else list(range(10 * i, 10 * i + 7)), max_tokens=12)])
    counts = []
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        expected = sum(s.num_tokens for s in out.scheduled if s.start < s.seq.num_prompt_tokens)
        assert out.num_prompt_tokens == expected
        counts.append(expected)
        sched.update(out, runner.execute(out))
    assert not sched.has_unfinished() and sched.num_preemptions > 0
    assert sched.block_manager.num_prefix_hits > 0 and sum(counts) > 5 * 7
