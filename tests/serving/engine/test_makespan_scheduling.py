"""Makespan scheduling (batch work ends early) and step-size filling, on the real Scheduler.

With `makespan_target`, waiting requests start longest `max_tokens` first and a step that decodes
takes prompt tokens only up to the target, unless a waiting request would otherwise end after the
longest running one. `step_sizes` lets a step that carries prompt tokens fill the padding up to the
executor's next graph size. Every step here comes from `Scheduler.schedule` and a fake runner.
"""

from __future__ import annotations

import random

from core_factories import FakeRunner, make_sequence

from serving.engine.block_manager import BlockManager
from serving.engine.scheduler import Scheduler


def make_scheduler(num_blocks=256, block_size=4, max_num_seqs=8, budget=64, max_model_len=256, **kw):
    bm = BlockManager(num_blocks, block_size, kw.pop("enable_prefix_caching", False))
    return Scheduler(bm, max_num_seqs, budget, max_model_len, (), **kw), FakeRunner()


def step(sched: Scheduler, runner: FakeRunner) -> list[tuple[int, int, bool]]:
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    return runner.steps[-1]


def run_to_end(sched: Scheduler, runner: FakeRunner, limit: int = 2000) -> int:
    """Steps until every sequence finished."""
    for n in range(limit):
        if not sched.has_unfinished():
            return n
        step(sched, runner)
    raise AssertionError("scheduler did not finish")


def test_waiting_requests_start_longest_first_and_fcfs_among_equals() -> None:
    sched, runner = make_scheduler(max_num_seqs=1, makespan_target=8)
    seqs = [make_sequence(i, [1, 2, 3], max_tokens=n) for i, n in enumerate([3, 9, 5, 9])]
    for s in seqs:
        sched.add_sequences([s])
    assert [s.seq_id for s in sched.waiting] == [1, 3, 2, 0]
    started: list[int] = []
    while sched.has_unfinished():
        for seq_id, _, _ in step(sched, runner):
            if seq_id not in started:
                started.append(seq_id)
    assert started == [1, 3, 2, 0]
    assert [s.num_output_tokens for s in seqs] == [3, 9, 5, 9]


def test_off_keeps_fcfs() -> None:
    sched, _ = make_scheduler(max_num_seqs=1)
    for i, n in enumerate([3, 9, 5]):
        sched.add_sequences([make_sequence(i, [1, 2, 3], max_tokens=n)])
    assert [s.seq_id for s in sched.waiting] == [0, 1, 2]


def test_preempted_sequences_stay_ahead_of_new_longer_requests() -> None:
    sched, runner = make_scheduler(makespan_target=8)
    a = make_sequence(0, [1, 2, 3], max_tokens=4)
    sched.add_sequences([a])
    step(sched, runner)
    sched.requeue_all()  # as after a failed step: `a` recomputes, ahead of what arrives later
    sched.add_sequences([make_sequence(1, [4, 5], max_tokens=50)])
    assert [s.seq_id for s in sched.waiting] == [0, 1]
    run_to_end(sched, runner)
    assert a.output_token_ids == [1000] * 4


def test_steps_that_decode_take_prompt_tokens_up_to_the_target() -> None:
    sched, runner = make_scheduler(makespan_target=8)
    a = make_sequence(0, [1, 2, 3], max_tokens=40)
    sched.add_sequences([a])
    assert step(sched, runner) == [(0, 3, True)]
    b = make_sequence(1, list(range(10, 30)), max_tokens=2)  # 20 prompt tokens, due long after `a` ends
    sched.add_sequences([b])
    assert step(sched, runner) == [(0, 1, True), (1, 7, False)]  # 1 decode + 7 = the target of 8
    assert step(sched, runner) == [(0, 1, True), (1, 7, False)]
    assert step(sched, runner) == [(0, 1, True), (1, 6, True)]
    run_to_end(sched, runner)
    assert b.num_output_tokens == 2 and a.num_output_tokens == 40


def test_a_request_that_would_end_late_gets_the_whole_budget() -> None:
    sched, runner = make_scheduler(makespan_target=8)
    a = make_sequence(0, [1, 2, 3], max_tokens=10)
    sched.add_sequences([a])
    step(sched, runner)
    b = make_sequence(1, list(range(10, 40)), max_tokens=9)  # as long as what `a` has left: no time to wait
    sched.add_sequences([b])
    assert step(sched, runner) == [(0, 1, True), (1, 30, True)]
    n = 0
    while sched.has_unfinished():
        step(sched, runner)
        n += 1
        assert a.is_finished == b.is_finished  # they end in the same step
    assert a.num_output_tokens == 10 and b.num_output_tokens == 9


def test_makespan_is_the_longest_request_and_never_worse_than_fcfs() -> None:
    rng = random.Random(7)
    work = [(rng.randint(5, 40), rng.randint(2, 60)) for _ in range(24)]  # (prompt tokens, max_tokens)
    steps = {}
    for target in (0, 16):
        sched, runner = make_scheduler(num_blocks=1024, max_num_seqs=24, budget=64, makespan_target=target)
        seqs = [make_sequence(i, list(range(100, 100 + p)), max_tokens=o) for i, (p, o) in enumerate(work)]
        for s in seqs:
            sched.add_sequences([s])
        steps[target] = run_to_end(sched, runner)
        assert [s.num_output_tokens for s in seqs] == [o for _, o in work]
    longest = max(o for _, o in work)
    assert steps[16] <= steps[0] and steps[16] <= longest + 1, (steps, longest)


def test_a_running_chunk_never_pushes_a_later_decode_out_of_the_step() -> None:
    sched, runner = make_scheduler(num_blocks=8, budget=4, max_num_seqs=2, max_model_len=32)
    s0 = make_sequence(0, [1, 2, 3], max_tokens=9)
    s1 = make_sequence(1, [4, 5, 6], max_tokens=3)
    sched.add_sequences([s0])
    step(sched, runner)
    sched.add_sequences([s1])
    step(sched, runner)
    # s0 comes back for a 4-token recompute, ahead of s1 in arrival order; the budget is 4.
    sched.running.remove(s0)
    sched.block_manager.free(s0)
    s0.num_computed_tokens = 0
    sched.block_manager.allocate(s0, 4)
    sched.running.insert(0, s0)
    assert step(sched, runner) == [(1, 1, True), (0, 3, False)]


def test_a_step_with_prompt_tokens_fills_up_to_the_next_step_size() -> None:
    sched, runner = make_scheduler(max_prefill_tokens_while_decoding=5, step_sizes=(4, 8, 16))
    a = make_sequence(0, [1, 2, 3], max_tokens=20)
    sched.add_sequences([a])
    assert step(sched, runner) == [(0, 3, True)]
    assert step(sched, runner) == [(0, 1, True)]  # a decode-only step is left as it is
    b = make_sequence(1, list(range(10, 40)), max_tokens=2)
    sched.add_sequences([b])
    # 1 decode + 5 prompt tokens would run padded to 8: the padding takes 2 more prompt tokens.
    assert step(sched, runner) == [(0, 1, True), (1, 7, False)]
    sched2, runner2 = make_scheduler(max_prefill_tokens_while_decoding=20, step_sizes=(4, 8, 16))
    sched2.add_sequences([make_sequence(0, [1, 2, 3], max_tokens=20)])
    step(sched2, runner2)
    sched2.add_sequences([make_sequence(1, list(range(10, 40)), max_tokens=2)])
    # 1 + 20 is past the largest size (an eager step, no padding): the cap stands.
    assert step(sched2, runner2) == [(0, 1, True), (1, 20, False)]
