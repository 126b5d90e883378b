"""The worker's persistent input batch: rows join, leave and are reused; columns set at join;
block tables grow; the device mirror gets exactly the entries written; step inputs built from
the rows equal a per-sequence reference, placeholders included (async scheduling)."""

from __future__ import annotations

import bisect
import random

import numpy as np
import pytest
import torch

from serving.engine.plan_builder import build_plan
from serving.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from serving.engine.sequence import Sequence
from serving.executor.batch_state import BatchState
from serving.executor.cuda_graphs import DecodeGraphRunner
from serving.executor.input_batch import InputBatch
from serving.executor.plan import PLACEHOLDER, StepOutput
from serving.executor.step_inputs import prepare_inputs
from serving.sampling_params import SamplingParams

BS = 4  # block size
PLAIN = SamplingParams(temperature=0.5)


def test_rows_are_reused_lowest_first_and_columns_set_at_join():
    ib = InputBatch(max_rows=4, max_blocks=4)
    assert [ib.add(s, PLAIN, [s]) for s in (10, 11, 12)] == [0, 1, 2]
    ib.remove(11)
    row = ib.add(13, SamplingParams(temperature=0.0, top_k=5, prompt_logprobs=1), [3, 4])
    assert row == 1 and ib.row_of == {10: 0, 12: 2, 13: 1}
    assert ib.prompt_logprobs.tolist()[:3] == [False, True, False]
    assert ib.inv_temperature[1] == 0.0 and not ib.plain[1]  # greedy, and top_k is not plain
    assert ib.inv_temperature[0] == np.float32(2.0) and ib.plain[0]
    assert ib.block_table[1, :3].tolist() == [3, 4, 0] and ib.num_blocks[1] == 2
    ib.remove(10)
    assert ib.block_table[0].tolist() == [0, 0, 0, 0] and ib.num_blocks[0] == 0
    ib.remove(99)  # unknown: ignored
    assert ib.rows([12, 13]).tolist() == [2, 1]


def test_rows_and_width_grow_keeping_contents():
    ib = InputBatch(max_rows=2, max_blocks=2)
    for s in range(5):
        ib.add(s, PLAIN, [100 + s])
    ib.append_blocks(ib.row_of[3], [7, 8, 9, 10])
    assert ib.block_table.shape[0] >= 5 and ib.block_table.shape[1] >= 5
    assert ib.block_table[ib.row_of[3], :5].tolist() == [103, 7, 8, 9, 10]
    assert [int(ib.block_table[ib.row_of[s], 0]) for s in range(5)] == [100, 101, 102, 103, 104]


def test_extra_columns_take_their_default_or_the_value_given_at_join():
    ib = InputBatch(max_rows=2)
    slot = ib.add_column("adapter_slot", default=-1)
    a = ib.add(1, PLAIN, [], adapter_slot=3)
    b = ib.add(2, PLAIN, [])
    ib.add(3, PLAIN, [], adapter_slot=5)  # grows: the column grows with the rows
    assert ib.extra["adapter_slot"][[a, b, ib.row_of[3]]].tolist() == [3, -1, 5]
    assert slot is not ib.extra["adapter_slot"] or ib.extra["adapter_slot"].shape[0] >= 3


def test_the_device_mirror_gets_exactly_the_written_entries_once():
    ib = InputBatch(max_rows=2, max_blocks=2, mirror=True)
    ib.add(1, PLAIN, [4, 5])
    ib.add(2, PLAIN, [6])
    ib.remove(1)  # its entries never reached the device: dropped, not raced with the next occupant
    ib.add(3, PLAIN, [9])
    ib.append_blocks(ib.row_of[2], [7, 8])  # grows the width
    ib.apply_dirty(torch.from_numpy(ib.take_dirty()))
    assert ib.take_dirty().shape == (3, 0)
    table = ib.device_block_table
    assert table is not None and table.data_ptr() != ib.block_table.ctypes.data
    assert table[ib.row_of[2], :3].tolist() == [6, 7, 8] and table[ib.row_of[3], 0] == 9
    assert ib.tables(torch.tensor([ib.row_of[3], ib.row_of[2]]), 3).tolist() == [[9, 0, 0], [6, 7, 8]]


# ---- BatchState + prepare_inputs against a per-sequence reference ------------------------


class Engine:
    """The engine side of a few steps: live sequences, block handout, plans, placeholders."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.free = list(range(400))
        self.rng.shuffle(self.free)
        self.seqs: list[Sequence] = []
        self.next_id = 0
        self.finished: list[int] = []
        self.preempted: list[int] = []

    def add(self, n: int, params: SamplingParams = PLAIN) -> Sequence:
        seq = Sequence(self.next_id, f"r{self.next_id}", [self.rng.randrange(3, 900) for _ in range(n)], params)
        self.next_id += 1
        self.seqs.append(seq)
        return seq

    def leave(self, seq: Sequence, preempt: bool = False) -> None:
        self.seqs.remove(seq)
        self.free.extend(seq.block_table)
        seq.block_table = []
        if seq.in_worker:
            (self.preempted if preempt else self.finished).append(seq.seq_id)
        seq.in_worker = False
        if preempt:  # recompute: it comes back later with its resolved ids
            seq.num_computed_tokens = 0
            seq.drop_placeholders()

    def schedule(self, chunk: int) -> SchedulerOutput:
        items = []
        for seq in self.seqs:
            n = min(seq.num_tokens - seq.num_computed_tokens, chunk)
            if n <= 0:
                continue
            start = seq.num_computed_tokens
            while len(seq.block_table) * BS < start + n:
                seq.block_table.append(self.free.pop())
            seq.num_computed_tokens += n
            items.append(ScheduledSequence(seq, n, start + n == seq.num_tokens, start))
        decodes = [i for i in items if i.num_tokens == 1]
        return SchedulerOutput(decodes + [i for i in items if i.num_tokens != 1], len(decodes))

    def plan(self, out: SchedulerOutput, step: int):  # noqa: ANN201
        plan = build_plan(step, out, self.finished, self.preempted)
        self.finished, self.preempted = [], []
        return plan


def reference_inputs(out: SchedulerOutput, device_ids: dict[int, int]) -> dict[str, list]:
    """What a step's inputs must be, one sequence at a time (the engine's own view)."""
    ids, pos, slots, qsl, lens, tables, sample_rows = [], [], [], [0], [], [], []
    for item in out.scheduled:
        seq = item.seq
        for p in range(item.start, item.end):
            t = seq.token_ids[p]
            ids.append(device_ids[seq.seq_id] if t == PLACEHOLDER else t)
            pos.append(p)
            slots.append(seq.block_table[p // BS] * BS + p % BS)
        qsl.append(qsl[-1] + item.num_tokens)
        lens.append(item.end)
        tables.append(list(seq.block_table))
        if item.sample:
            sample_rows.append(qsl[-1] - 1)
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]
    return dict(ids=ids, pos=pos, slots=slots, qsl=qsl, lens=lens, tables=tables, sample_rows=sample_rows)


@pytest.mark.parametrize("mirror, staged", [(False, False), (True, False), (True, True)])
def test_steps_with_joins_leaves_preemption_and_placeholders_match_the_reference(mirror, staged):
    # staged: decode-only steps go into a decode-graph runner's static buffers (`DecodeGraphRunner.stage`,
    # `kernels.stage_decode_inputs`; here its torch reference), the rest as before; the same inputs either way.
    graphs = DecodeGraphRunner(None, max_num_seqs=16, max_blocks_per_seq=32, hidden_size=8, max_seq_len=512,
                               device=torch.device("cpu")) if staged else None
    num_staged = 0
    eng = Engine(seed=1)
    batch = BatchState(max_rows=2, max_blocks=1)  # both grow during the run
    batch.input_batch = InputBatch(2, 1, mirror=mirror)
    prev: StepOutput | None = None
    on_device: dict[int, int] = {}  # seq_id -> token sampled by the step in flight
    for s in range(4):
        eng.add(3 + 5 * s)
    counter = 1000
    for step in range(40):
        if step % 7 == 3:
            eng.add(2 + step % 5)  # joins mid-run
        if step % 11 == 5 and len(eng.seqs) > 2:
            eng.leave(eng.seqs[1])  # finishes
        if step % 13 == 8:
            victim = eng.seqs[-1]
            eng.leave(victim, preempt=True)
            eng.seqs.append(victim)  # re-admitted at once: a new sequence for the worker
        out = eng.schedule(chunk=1 if step % 5 == 2 else 4)  # 1: one-token chunks inside prompts
        plan = eng.plan(out, step)
        batch.apply(plan)
        inputs = prepare_inputs(plan, batch, BS, torch.device("cpu"), prev, graphs=graphs)
        ref = reference_inputs(out, on_device)
        if graphs is not None and inputs.input_ids.data_ptr() == graphs.input_ids.data_ptr():
            num_staged += 1
            n = len(out.scheduled)
            bucket = graphs.batch_sizes[bisect.bisect_left(graphs.batch_sizes, n)]
            assert out.num_decodes == n and inputs.meta.slot_mapping.data_ptr() == graphs.slot_mapping.data_ptr()
            assert graphs.slot_mapping[n:bucket].eq(-1).all() and graphs.seq_lens[n:bucket].eq(0).all()
        assert inputs.input_ids.tolist() == ref["ids"]
        assert inputs.positions.tolist() == ref["pos"]
        assert inputs.meta.slot_mapping.tolist() == ref["slots"]
        assert inputs.meta.query_start_loc.tolist() == ref["qsl"]
        assert inputs.meta.seq_lens.tolist() == ref["lens"]
        # (a reused row's mirror keeps stale ids past its blocks: seq_lens bound every read)
        tables = inputs.meta.block_tables.tolist()
        assert [t[: len(item.seq.block_table)] for t, item in zip(tables, out.scheduled)] == \
            [t[: len(item.seq.block_table)] for t, item in zip(ref["tables"], out.scheduled)]
        assert len(tables[0]) == len(ref["tables"][0])
        assert inputs.sample_rows.tolist() == ref["sample_rows"]
        assert inputs.meta.num_decodes == out.num_decodes
        # The step samples; its tokens stay "on the device" (async): placeholders in the ids.
        sampled = [item.seq for item in out.scheduled if item.sample]
        tokens = list(range(counter, counter + len(sampled)))
        counter += len(sampled)
        rows = inputs.batch_rows[np.flatnonzero(np.array(plan.sample, dtype=bool))]
        assert rows.tolist() == [batch.seqs[s.seq_id].row for s in sampled]
        prev = StepOutput([], token_ids=torch.tensor(tokens), rows=rows)
        # The previous step's tokens resolve now; this step's are placeholders.
        for seq, t in on_device.items():
            match = [s for s in eng.seqs if s.seq_id == seq]
            if match and PLACEHOLDER in match[0].token_ids:
                match[0].token_ids[match[0].token_ids.index(PLACEHOLDER)] = t
        on_device = {s.seq_id: t for s, t in zip(sampled, tokens)}
        for seq in sampled:
            seq.token_ids.append(PLACEHOLDER)
    assert len(batch.seqs) == len(batch.input_batch.row_of)
    assert sorted(batch.input_batch.row_of) == sorted(s.seq_id for s in eng.seqs if s.in_worker)
    assert num_staged >= 10 if staged else num_staged == 0, num_staged


def test_apply_syncs_ids_extends_tables_and_frees_rows():
    eng = Engine(seed=2)
    batch = BatchState()
    a, b = eng.add(5), eng.add(6)
    batch.apply(eng.plan(eng.schedule(chunk=16), 0))
    ib = batch.input_batch
    ra, rb = ib.row_of[a.seq_id], ib.row_of[b.seq_id]
    assert (batch.seqs[a.seq_id].row, batch.seqs[b.seq_id].row) == (ra, rb) and ra != rb
    a.token_ids += [77, 78, 79, PLACEHOLDER]  # a gains a block: 9 tokens in blocks of 4
    batch.apply(eng.plan(eng.schedule(chunk=16), 1))
    assert batch.seqs[a.seq_id].token_ids == a.token_ids and ib.num_blocks[ra] == len(a.block_table) == 3
    assert ib.block_table[ra, :3].tolist() == a.block_table
    eng.leave(a)
    b.token_ids.append(88)
    batch.apply(eng.plan(eng.schedule(chunk=16), 2))
    assert a.seq_id not in ib.row_of and a.seq_id not in batch.seqs and ra in ib._free
    assert batch.seqs[b.seq_id].token_ids[-1] == 88 and ib.row_of[b.seq_id] == rb
