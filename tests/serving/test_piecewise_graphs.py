"""Piecewise graphs' plumbing on the CPU: the forward cut at attention, bucket padding, buffers.

CUDA graphs cannot be captured on a CPU, so each "graph" here replays its piece eagerly under
the same static metadata a capture sees (the bucket's slot-mapping buffer); everything else
(bucket choice, padded rows with slot -1, the q / attn / residual buffers, eager attention
between pieces with the step's real metadata) is the code that runs on a GPU. The oracle is
HF transformers' greedy generate, as for the plain runner; a prompt chunk of 8 beside decodes
makes the mixed steps the piecewise path exists for.
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import tiny_models  # noqa: F401  (fixture)
from paged_driver import PagedDriver

from serving.engine_config import EngineConfig
from serving.executor.attention_metadata import forward_context
from serving.executor.model_runner import ModelRunner
from serving.executor.piecewise_graphs import PiecewiseGraphRunner, piecewise_buckets
from serving.sampling_params import SamplingParams


class _EagerPiece:
    """Stands in for one captured piece: replays it eagerly on the bucket's static buffers."""

    def __init__(self, runner: PiecewiseGraphRunner, i: int, t: int) -> None:
        self.runner, self.i, self.t = runner, i, t
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        with forward_context(self.runner._meta(self.t)):
            self.runner._piece(self.i, self.t)


def _cpu_piecewise(runner: ModelRunner, max_tokens: int) -> PiecewiseGraphRunner:
    pw = PiecewiseGraphRunner(runner.model, max_tokens, runner.device)
    pw.graphs = {t: [_EagerPiece(pw, i, t) for i in range(runner.model.model.num_pieces)] for t in pw.buckets}
    return pw


def test_buckets_end_at_the_limit() -> None:
    assert piecewise_buckets(2048)[-1] == 2048 and piecewise_buckets(100)[-1] == 100
    assert piecewise_buckets(100) == [16, 32, 64, 96, 100]


def test_piecewise_steps_match_hf_greedy(tiny_models) -> None:  # noqa: F811
    path = tiny_models("llama")
    runner = ModelRunner(EngineConfig(model=str(path), block_size=4, kv_cache_memory_gb=0.01, device="cpu"))
    runner.piecewise = pw = _cpu_piecewise(runner, 40)
    prompts = [torch.randint(3, 49000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 17, 30)]
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    together = PagedDriver(runner, seed=1).generate(prompts, greedy, 10, chunk=8)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for p, s in zip(prompts, together):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert s.output_token_ids == ref
    # every step ran through the pieces (no decode graphs on a CPU), padded to buckets 16 / 32
    assert {t for t, g in pw.graphs.items() if g[0].replays} >= {16}
    assert all(len({p.replays for p in g}) == 1 for g in pw.graphs.values())  # whole forwards only


def test_a_step_past_the_largest_bucket_runs_eagerly(tiny_models) -> None:  # noqa: F811
    runner = ModelRunner(EngineConfig(model=str(tiny_models("llama")), block_size=4, kv_cache_memory_gb=0.01,
                                      device="cpu"))
    runner.piecewise = pw = _cpu_piecewise(runner, 16)
    PagedDriver(runner).generate([list(range(5, 45))], SamplingParams(temperature=0.0, max_tokens=8), 2)
    assert pw.graphs[16][0].replays == 1  # the 40-token prompt ran eagerly, the decode after it did not
