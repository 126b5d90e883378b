"""Batched multi-LoRA shrink/expand (kernels/lora.py) vs the torch reference and a dense oracle.

Rows of a batch sit on different adapter slots (and some on none, -1): each row must get
exactly its own adapter's x·Aᵀ·Bᵀ on its packed output slices, and base rows nothing. Runs
in Triton's interpreter on CPU; the GPU test adds bf16, 8B-like shapes and a CUDA-graph replay.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_helpers import tol

from kernels import reference
from kernels.lora import lora_expand, lora_shrink


def _dense(x, a, b, slots, slice_sizes, r):
    """y delta row by row from the definition."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        h = x[t].double() @ a[s].double().T  # [slices * r]
        col = 0
        for p, n in enumerate(slice_sizes):
            out[t, col : col + n] = h[p * r : (p + 1) * r] @ b[s, col : col + n].double().T
            col += n
    return out


def _case(num_tokens, num_slots, k, r, slice_sizes, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=g).to(dtype).to(device)
    a = (0.1 * torch.randn(num_slots, len(slice_sizes) * r, k, generator=g)).to(dtype).to(device)
    b = (0.1 * torch.randn(num_slots, sum(slice_sizes), r, generator=g)).to(dtype).to(device)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=g).to(device)
    y0 = torch.randn(num_tokens, sum(slice_sizes), generator=g).to(dtype).to(device)
    return x, a, b, slots, y0


def test_segments_group_rows_by_slot():
    slots = torch.tensor([2, -1, 0, 2, 1, -1, 0, 2])
    rows, starts, counts, block_slot, block_m0 = reference.lora_segments(slots, 4)
    assert counts.tolist() == [2, 1, 3, 0]
    assert starts.tolist() == [0, 2, 3, 6]
    assert rows[:6].tolist() == [2, 6, 4, 0, 3, 7]
    assert block_slot.tolist() == [0, 1, 2, -1, -1]  # one block each, slot 3 none
    assert block_m0.tolist()[:3] == [0, 0, 0]
    slots = torch.tensor([1] * 40 + [0] * 3)  # slot 1 spans three blocks of 16
    _, _, _, block_slot, block_m0 = reference.lora_segments(slots, 2)
    assert block_slot.tolist()[:4] == [0, 1, 1, 1] and block_m0.tolist()[:4] == [0, 0, 16, 32]


@pytest.mark.parametrize("num_tokens, num_slots", [(0, 3), (1, 16), (4, 16), (16, 2), (17, 3), (40, 1), (300, 16)])
def test_host_segments_match_the_torch_oracle(num_tokens, num_slots):
    # The engine groups rows on the host (numpy, into persistent device buffers); the torch
    # grouping is the oracle: same rows per slot, same blocks, for random and one-slot patterns.
    rng = np.random.default_rng(num_tokens * 31 + num_slots)
    patterns = [rng.integers(-1, num_slots, num_tokens) for _ in range(4)]
    patterns += [np.full(num_tokens, s) for s in (-1, 0, num_slots - 1)]
    patterns.append(np.where(np.arange(num_tokens) >= num_tokens // 2, -1, rng.integers(0, num_slots, num_tokens)))
    for slots in patterns:
        rows, starts, counts, block_slot, block_m0 = reference.lora_segments(torch.from_numpy(slots), num_slots)
        h_rows, h_starts, h_counts, h_slot, h_m0 = reference.lora_segments_host(slots, num_slots)
        listed = int((slots >= 0).sum())
        assert np.array_equal(h_rows[:listed], rows[:listed].numpy())
        assert np.array_equal(h_starts, starts.numpy()) and np.array_equal(h_counts, counts.numpy())
        assert np.array_equal(h_slot, block_slot.numpy())
        used = h_slot >= 0
        assert np.array_equal(h_m0[used], block_m0.numpy()[used])
        # A larger block table (a bigger graph bucket) only adds slot -1 entries.
        _, _, _, big_slot, big_m0 = reference.lora_segments_host(slots, num_slots, len(h_slot) + 5)
        assert np.array_equal(big_slot[: len(h_slot)], h_slot) and (big_slot[len(h_slot):] == -1).all()
        assert np.array_equal(big_m0[: len(h_slot)][used], h_m0[used])


@pytest.mark.parametrize("num_tokens, slice_sizes, k, r", [
    (5, (48,), 96, 8),  # decode-like, one slice (o_proj / down_proj)
    (70, (64, 32, 32), 80, 16),  # packed q|k|v, rows over several blocks per slot
    (20, (40, 40), 520, 16),  # gate|up, K over two shrink splits
    (3, (40,), 1100, 16),  # K over three splits (the expand loads a padded tile of 4 partials)
])
def test_shrink_expand_match_reference_and_dense(device, num_tokens, slice_sizes, k, r):
    dtype = torch.float32
    x, a, b, slots, y0 = _case(num_tokens, 3, k, r, slice_sizes, dtype, device)
    seg = reference.lora_segments(slots, 3)
    y = y0.clone()
    lora_expand(y, lora_shrink(x, a, *seg), b, slice_sizes, *seg)
    y_ref = y0.clone()
    reference.lora_expand(y_ref, reference.lora_shrink(x, a, *seg), b, slice_sizes, *seg)
    torch.testing.assert_close(y, y_ref, **tol(dtype))
    dense = _dense(x.cpu(), a.cpu(), b.cpu(), slots.cpu(), slice_sizes, r)
    torch.testing.assert_close(y.cpu().double() - y0.cpu().double(), dense, atol=1e-3, rtol=1e-3)
    base = slots.cpu() < 0
    assert torch.equal(y.cpu()[base], y0.cpu()[base])  # base rows untouched


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 256])
def test_bf16_8b_shapes_and_cuda_graph(num_tokens):
    dtype, device = torch.bfloat16, "cuda"
    r, k = 16, 4096
    sizes = (4096, 1024, 1024)  # Llama-3-8B q|k|v
    x, a, b, slots, y0 = _case(num_tokens, 16, k, r, sizes, dtype, device, seed=num_tokens)
    seg = reference.lora_segments(slots, 16)
    y_ref = y0.clone()
    reference.lora_expand(y_ref, reference.lora_shrink(x, a, *seg), b, sizes, *seg)
    static_slots = slots.clone()
    y = y0.clone()

    def run():
        s = reference.lora_segments(static_slots, 16)
        lora_expand(y, lora_shrink(x, a, *s), b, sizes, *s)

    run()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, y_ref, **tol(dtype))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    perm = slots[torch.randperm(num_tokens, device=device)]
    static_slots.copy_(perm)
    y.copy_(y0)
    graph.replay()
    seg = reference.lora_segments(perm, 16)
    y_ref = y0.clone()
    reference.lora_expand(y_ref, reference.lora_shrink(x, a, *seg), b, sizes, *seg)
    torch.testing.assert_close(y, y_ref, **tol(dtype))


@pytest.mark.gpu
def test_engine_on_cuda_with_graphs_matches_the_cpu_reference_path(tmp_path, devices=("cpu", "cuda")):
    # The whole path on the GPU (Triton kernels, slots loaded between steps, decode CUDA graphs,
    # async scheduling) against the same engine on the CPU (torch reference), fp32, greedy; three
    # adapters on two slots and base rows in one batch.
    import json
    from pathlib import Path

    from random_adapter import write_random_adapter
    from model_fixtures import build_tiny_model
    from serving.llm import LLM
    from serving.lora_request import LoRARequest
    from serving.sampling_params import SamplingParams

    tok = Path(__file__).resolve().parents[2] / ".bench_models" / "tokenizer"  # (carried to the GPU machine)
    base = build_tiny_model("llama", tmp_path / "llama", tokenizer_dir=tok if tok.is_dir() else None)
    cfg = json.loads((base / "config.json").read_text())
    adapters = [LoRARequest(f"a{k}", k + 1, str(write_random_adapter(cfg, tmp_path / f"a{k}", rank, k, 0.05,
                                                                       torch.float32)))
                for k, rank in enumerate((8, 16, 16))]
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 130 + 11 * i))} for i in range(8)]
    loras = [adapters[0], adapters[1], adapters[2], None] * 2
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    opts = dict(dtype="float32", enable_lora=True, max_loras=2, max_model_len=512, block_size=16)
    tokens = {}
    for device in devices:
        extra = dict(kv_cache_memory_gb=0.1) if device == "cpu" else dict(gpu_memory_utilization=0.3)
        llm = LLM(str(base), device=device, **opts, **extra)
        tokens[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, lora_request=loras,
                                                                        use_tqdm=False)]
        if device == "cuda":
            assert llm.llm_engine.executor.runner.graph_runner is not None
        llm.llm_engine.shutdown()
    assert tokens[devices[1]] == tokens[devices[0]]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["split", "stream"])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_lora_linear_variants_replay_in_a_cuda_graph(monkeypatch, variant, num_tokens):
    # Each LORA_VARIANT as the engine runs it (LoRALinear reading host-grouped segments from
    # persistent buffers): captured once, replayed after the buffers get another slot pattern.
    from serving.executor import lora as lora_exec

    monkeypatch.setattr(lora_exec, "LORA_VARIANT", variant)
    device, dtype, sizes, k, r, num_slots = "cuda", torch.bfloat16, (512, 128, 128), 1024, 16, 4
    like = torch.empty(0, dtype=dtype, device=device)
    batch = lora_exec.LoRABatch()
    base = torch.nn.Linear(k, sum(sizes), bias=False, device=device, dtype=dtype)
    m = lora_exec.LoRALinear(base, [(str(i), 0, n) for i, n in enumerate(sizes)], None, k, num_slots, r, batch, like)
    m.lora_a.normal_(std=k**-0.5)
    m.lora_b.normal_(std=0.05)
    x = torch.randn(num_tokens, k, device=device, dtype=dtype)

    def grouped(seed):
        slots = torch.randint(-1, num_slots, (num_tokens,), generator=torch.Generator().manual_seed(seed))
        return [torch.from_numpy(a).to(device) for a in reference.lora_segments_host(slots.numpy(), num_slots)]

    def expected(seg):
        y = base(x)
        reference.lora_expand(y, reference.lora_shrink(x, m.lora_a, *seg), m.lora_b, sizes, *seg)
        return y

    batch.segments = tuple(grouped(0))
    torch.testing.assert_close(m(x), expected(batch.segments), **tol(dtype))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = m(x)
    for dst, src in zip(batch.segments, grouped(1)):
        dst.copy_(src)
    graph.replay()
    torch.testing.assert_close(out, expected(batch.segments), **tol(dtype))
