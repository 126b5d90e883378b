"""The custom all-reduce on two CUDA GPUs (skipped without them): the same sums as NCCL and the
same tokens as one process.

- Kernels: float32 integer messages from 16 bytes to 16 MiB through `parallel.all_reduce` (eager
  and replayed from a CUDA graph) equal NCCL's all-reduce exactly, on the one-shot, two-shot and
  NCCL paths, as do bfloat16 ones (small integers: exact); both ranks get the same bits; with the
  switch off every size goes to NCCL.
- Engine: greedy tokens of a tiny Llama in float32 at TP=2 with the custom all-reduce (decode and
  mixed-step CUDA graphs, chunked prompts; the sums fused with the norms) equal TP=1's, and shutting
  down leaves nothing in /dev/shm.
- Fused all-reduce + residual add + RMSNorm (`kernels/all_reduce_norm.py`) at TP=2 and 4, eager
  (three calls in a row: the buffers rotate) and replayed from a CUDA graph: the reference's rows on
  every rank, bitwise the same on every rank; a message over its slot takes the unfused path.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from all_reduce_worker import all_reduce_worker
from model_fixtures import build_tiny_model

from serving.executor.custom_all_reduce import ONE_SHOT, TWO_SHOT
from serving.llm import LLM
from serving.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs two CUDA GPUs")]

CASES = [(4, "float32"), (2048, "float32"), (64 << 10, "float32"), (1 << 20, "float32"), (4 << 20, "float32"),
         (6, "float32"), (8192, "bfloat16"), (1 << 20, "bfloat16")]


def _run(tmp_path, custom: bool) -> list[dict]:  # noqa: ANN001
    mp.spawn(all_reduce_worker, args=(2, str(tmp_path / "store"), "nccl", custom, CASES, str(tmp_path)), nprocs=2)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def test_custom_all_reduce_equals_nccl_eager_and_in_graphs(tmp_path):
    ranks = _run(tmp_path, custom=True)
    assert all(r["custom_on"] for r in ranks)
    paths = ranks[0]["paths"]
    assert ranks[1]["paths"] == paths
    assert paths[:5] == [ONE_SHOT, ONE_SHOT, ONE_SHOT, TWO_SHOT, "nccl"], paths  # by size (default policy)
    assert paths[5] == "nccl"  # 24 bytes: not a multiple of 16
    for r in ranks:
        for (numel, dtype), got, graphed, oracle in zip(CASES, r["got"], r["graphed"], r["oracle"]):
            if dtype == "float32":
                assert torch.equal(got, oracle), (numel, dtype)
                assert torch.equal(graphed, oracle), (numel, dtype)
            else:  # integers up to 16 in magnitude: bfloat16 sums are exact too
                assert torch.equal(got, oracle), (numel, dtype)
    for a, b in zip(ranks[0]["got"] + ranks[0]["graphed"], ranks[1]["got"] + ranks[1]["graphed"]):
        assert torch.equal(a, b)  # every rank the same bits


def test_switched_off_every_size_takes_nccl(tmp_path):
    ranks = _run(tmp_path, custom=False)
    assert not any(r["custom_on"] for r in ranks)
    assert ranks[0]["paths"] == ["nccl"] * len(CASES)
    for got, oracle in zip(ranks[0]["got"], ranks[0]["oracle"]):
        assert torch.equal(got, oracle)


def test_tp2_with_the_custom_all_reduce_gives_tp1_tokens_and_leaves_no_shared_memory(tmp_path):
    # The GPU machine has no embedded default model: take the bench tokenizer where it was carried,
    # else none at all (the engines below skip the tokenizer and read token ids only).
    tok = Path(__file__).resolve().parents[3] / ".bench_models" / "tokenizer"
    path = str(build_tiny_model("llama", tmp_path / "llama", tokenizer_dir=tok if tok.is_dir() else tmp_path / "none"))
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    # A 24-token budget chunks the longer prompts into steps shared with decodes (mixed-step graphs).
    options = dict(dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=24,
                   gpu_memory_utilization=0.3, skip_tokenizer_init=True)

    def tokens(llm: LLM) -> list[list[int]]:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    one = LLM(path, **options)
    expected = tokens(one)
    one.llm_engine.shutdown()
    del one
    torch.cuda.empty_cache()
    two = LLM(path, tensor_parallel_size=2, **options)
    try:
        assert tokens(two) == expected
    finally:
        two.llm_engine.shutdown()
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not (shm_after - shm_before)


def _spawn_ranks(worker, world: int, cases: list, tmp_path, prefix: str) -> list[dict]:  # noqa: ANN001
    """Run `worker` on `world` GPUs (skip with fewer) and load what each rank saved as `{prefix}{rank}.pt`."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    mp.spawn(worker, args=(world, str(tmp_path / "store"), cases, str(tmp_path)), nprocs=world)
    return [torch.load(tmp_path / f"{prefix}{r}.pt") for r in range(world)]


# (rows, hidden, dtype, with a residual): decode rows of an 8B / 70B width, a 7-row odd batch,
# the first layer's input (no residual), float32 (the agreement runs), and one too large to fuse.
FUSED_CASES = [(1, 4096, "bfloat16", True), (7, 4096, "bfloat16", True), (32, 4096, "bfloat16", True),
               (2, 8192, "bfloat16", False), (3, 1000, "float32", True), (256, 4096, "bfloat16", True)]


@pytest.mark.parametrize("world", [2, 4])
def test_fused_all_reduce_rms_norm_equals_the_reference_on_every_rank(tmp_path, world):
    from all_reduce_worker import fused_norm_input, fused_norm_shared, fused_norm_worker

    from kernels import reference

    ranks = _spawn_ranks(fused_norm_worker, world, FUSED_CASES, tmp_path, "fused")
    assert all(r["on"] == {"bfloat16": True, "float32": True} for r in ranks), [r["on"] for r in ranks]
    assert ranks[0]["paths"][:-1] == ["fused"] * (len(FUSED_CASES) - 1), ranks[0]["paths"]
    assert ranks[0]["paths"][-1] != "fused"  # 2 MiB: over the fused kernel's slot, all-reduce then norm
    for i, (rows, hidden, name, with_residual) in enumerate(FUSED_CASES):
        dtype = getattr(torch, name)
        for call, key in [(0, "eager"), (1, "eager"), (2, "eager"), (3, "graphed")]:
            partials = [fused_norm_input(r, rows, hidden, dtype, call) for r in range(world)]
            residual, weight = fused_norm_shared(rows, hidden, dtype, call)
            want_normed, want_res = reference.all_reduce_rms_norm(partials, weight, 1e-5,
                                                                  residual if with_residual else None)
            for r in ranks:
                got = r[key][i][call] if key == "eager" else r[key][i][0]
                # bf16: the unfused path (256 rows: two-shot) sums in bf16, one ulp (1/32 at |x| in 4..8) off
                tol = dict(atol=6.25e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(got[1], want_res, **tol)
                torch.testing.assert_close(got[0], want_normed, **tol)
        for key in ("eager", "graphed"):  # every rank the same bits, every call and replay
            for r in ranks[1:]:
                for (n0, r0), (n1, r1) in zip(ranks[0][key][i], r[key][i]):
                    assert torch.equal(n0, n1) and torch.equal(r0, r1), (FUSED_CASES[i], key)
        for a, b in zip(ranks[0]["graphed"][i], ranks[0]["graphed"][i][1:]):  # replays of one input agree
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# (rows, hidden, in_features): an 8B rank's o_proj / down_proj shapes at TP=2 and 4, two rows, a 70B width
PUSH_CASES = [(1, 4096, 4096), (1, 4096, 14336), (2, 4096, 4096), (1, 8192, 8192)]


@pytest.mark.parametrize("world", [2, 4])
def test_pushed_partials_equal_the_fused_kernels_own_push(tmp_path, world):
    from all_reduce_worker import pushed_partial_worker

    ranks = _spawn_ranks(pushed_partial_worker, world, PUSH_CASES, tmp_path, "pushed")
    assert all(all(r["can_push"]) for r in ranks), [r["can_push"] for r in ranks]  # the GEMV pushed every case
    for i, case in enumerate(PUSH_CASES):
        for r in ranks:
            for (n_p, r_p), (n_q, r_q) in zip(r["pushed"][i], r["plain"][i]):  # bitwise: the same bits were sent
                assert torch.equal(n_p, n_q) and torch.equal(r_p, r_q), case
            replays, eager = r["graphed"][i]
            for (n_g, r_g), (n_e, r_e) in zip(replays, eager):
                assert torch.equal(n_g, n_e) and torch.equal(r_g, r_e), case
            for (n0, r0), (n1, r1) in zip(ranks[0]["pushed"][i], r["pushed"][i]):  # every rank the same rows
                assert torch.equal(n0, n1) and torch.equal(r0, r1), case


def test_tp2_bf16_tokens_are_the_same_with_and_without_pushed_partials(tmp_path, monkeypatch):
    # bf16 decode of one or two rows runs the GEMV that pushes (float32 never does): the tokens of
    # TP=2 must not depend on who pushes the rows (the same bits either way).
    tok = Path(__file__).resolve().parents[3] / ".bench_models" / "tokenizer"
    path = str(build_tiny_model("llama", tmp_path / "llama", tokenizer_dir=tok if tok.is_dir() else tmp_path / "none"))
    prompts = [list(range(5, 5 + n)) for n in (3, 17)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    options = dict(dtype="bfloat16", max_model_len=128, max_num_seqs=2, gpu_memory_utilization=0.3,
                   skip_tokenizer_init=True, tensor_parallel_size=2)
    got = {}
    for push in ("1", "0"):
        monkeypatch.setenv("OPEN_LMI_PUSH_PARTIALS", push)
        llm = LLM(path, **options)
        try:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
            got[push] = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.llm_engine.shutdown()
        del llm
        torch.cuda.empty_cache()
    assert got["1"] == got["0"]
