"""Mixed-step graphs' plumbing on the CPU: bucket padding, static buffers, unused sequence slots.

CUDA graphs cannot be captured on a CPU, so each "graph" here replays the bucket's forward
eagerly under the same static metadata a capture sees (the bucket's views of the buffers, with
`mixed` set, so attention goes through `kernels.mixed_attention`'s reference); everything else
(bucket choice, padded rows with slot -1, the copies into the buffers, zero-length unused slots)
is the code that runs on a GPU. The oracle is HF transformers' greedy generate, as for the plain
runner; a prompt chunk of 8 beside decodes makes the mixed steps these graphs exist for.
"""

from __future__ import annotations

import torch
from lora_fixtures import peft_greedy
from paged_driver import PagedDriver

from serving.engine_config import EngineConfig
from serving.executor.attention_metadata import forward_context
from serving.executor.mixed_graphs import MixedGraphRunner, faster_buckets, mixed_buckets
from serving.executor.model_runner import ModelRunner
from serving.lora_request import LoRARequest
from serving.sampling_params import SamplingParams


class _EagerGraph:
    """Stands in for one captured bucket: runs its forward eagerly on the static buffers."""

    def __init__(self, runner: MixedGraphRunner, t: int) -> None:
        self.runner, self.t = runner, t
        self.replays = 0
        self.seen: list[tuple[list[int], list[int]]] = []  # (query_start_loc, seq_lens) of each replay

    def replay(self) -> None:
        self.replays += 1
        r, t = self.runner, self.t
        meta = r._meta(t)
        self.seen.append((meta.query_start_loc.tolist(), meta.seq_lens.tolist()))
        with forward_context(meta):
            r.outputs[t].copy_(r.forward(r.input_ids[:t], r.positions[:t]))

    def reset(self) -> None:  # what `close` calls on a captured graph
        self.replays = -1


def _cpu_mixed(runner: ModelRunner, max_tokens: int) -> MixedGraphRunner:
    mg = MixedGraphRunner(runner._model_forward, max_tokens, runner.config.max_num_seqs,
                          runner.batch.input_batch.block_table.shape[1], runner.device)
    hidden = runner.model_args.hidden_size
    mg.graphs = {t: _EagerGraph(mg, t) for t in mg.buckets}  # type: ignore[misc]
    mg.outputs = {t: torch.full((t, hidden), float("nan")) for t in mg.buckets}
    return mg


def test_buckets_end_at_the_limit() -> None:
    assert mixed_buckets(2048)[-1] == 2048 and mixed_buckets(100)[-1] == 100
    assert mixed_buckets(100) == [16, 32, 64, 96, 100]


def test_buckets_no_faster_than_a_larger_one_are_dropped() -> None:
    # (an H100's 8B layer: 288 rows took longer than 320, 224 longer than 256; bench/studies/step_gemms.py)
    buckets = [16, 32, 64, 96, 128]
    assert faster_buckets(buckets, [1.0, 2.0, 5.0, 4.0, 4.5]) == [16, 32, 96, 128]
    assert faster_buckets(buckets, [1.0, 1.0, 1.0, 1.0, 1.0]) == [128]  # ties go to the larger bucket
    assert faster_buckets(buckets, [1.0, 2.0, 3.0, 4.0, 5.0]) == buckets
    assert faster_buckets([2048], [9.0]) == [2048]


def test_mixed_steps_match_hf_greedy(tiny_models) -> None:  # noqa: F811
    path = tiny_models("llama")
    runner = ModelRunner(EngineConfig(model=str(path), block_size=4, kv_cache_memory_gb=0.01, device="cpu",
                                      max_num_seqs=8))
    runner.mixed_graphs = mg = _cpu_mixed(runner, 40)
    prompts = [torch.randint(3, 49000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 17, 30)]
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    together = PagedDriver(runner, seed=1).generate(prompts, greedy, 10, chunk=8)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for p, s in zip(prompts, together):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert s.output_token_ids == ref
    # every step ran through the graphs (no decode graphs on a CPU), padded to bucket 16 (8 slots)
    assert mg.graphs[16].replays > 0
    for qsl, lens in mg.graphs[16].seen:
        used = sum(1 for n in lens if n)
        assert len(lens) == 8 and qsl[0] == 0 and all(n == 0 for n in lens[used:])
        assert qsl[used + 1:] == [qsl[used]] * (8 - used)  # unused slots: no query rows


def test_a_step_past_the_largest_bucket_runs_eagerly(tiny_models) -> None:  # noqa: F811
    runner = ModelRunner(EngineConfig(model=str(tiny_models("llama")), block_size=4, kv_cache_memory_gb=0.01,
                                      device="cpu"))
    runner.mixed_graphs = mg = _cpu_mixed(runner, 16)
    PagedDriver(runner).generate([list(range(5, 45))], SamplingParams(temperature=0.0, max_tokens=8), 2)
    assert mg.graphs[16].replays == 1  # the 40-token prompt ran eagerly, the decode after it did not


def test_more_sequences_than_slots_run_eagerly(tiny_models) -> None:  # noqa: F811
    runner = ModelRunner(EngineConfig(model=str(tiny_models("llama")), block_size=4, kv_cache_memory_gb=0.01,
                                      device="cpu", max_num_seqs=4))
    mg = _cpu_mixed(runner, 32)
    assert mg.slots(16) == 4 and mg.can_run(16, 4, 1) and not mg.can_run(16, 5, 1)
    assert not mg.can_run(16, 2, mg.block_tables.shape[1] + 1) and not mg.can_run(33, 2, 1)


def test_lora_rows_through_mixed_graphs_match_peft(lora_adapters) -> None:  # noqa: F811
    # Each row's adapter is read from the staged grouping inside the graph; the bucket's padded rows
    # are in no group (the base model). A 16-token budget puts prompt chunks beside decodes.
    from serving.llm import LLM

    base, adapters = lora_adapters("llama")
    llm = LLM(str(base), enable_lora=True, max_loras=2, device="cpu", dtype="float32", block_size=4,
              max_model_len=256, kv_cache_memory_gb=0.05, max_num_batched_tokens=16, max_num_seqs=8)
    try:
        runner = llm.llm_engine.executor.runner
        runner.mixed_graphs = mg = _cpu_mixed(runner, 16)
        names = ["r8", None, "r16"]
        reqs = [None if n is None else LoRARequest(n, 1 + sorted(adapters).index(n), str(adapters[n])) for n in names]
        prompts = ["The capital of France is", "Write a haiku about the sea:", "List three prime numbers:"]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                            lora_request=reqs, use_tqdm=False)
        for out, name in zip(outs, names):
            want = peft_greedy(str(base), None if name is None else str(adapters[name]), tuple(out.prompt_token_ids), 8)
            assert tuple(out.outputs[0].token_ids) == want, name
        assert mg.graphs[16].replays > 0
    finally:
        llm.llm_engine.shutdown()
