"""Host time per steady decode step, by part: how much Python the engine spends per step.

The model forward is replaced by a trivial one (zero hidden states, zero logits of a small
vocabulary, as a decode CUDA graph hands them back), so what is timed is the host work only:
`schedule`, `plan` (the engine's `_plan`), `apply` (the worker's batch-state update),
`prepare` (step inputs), `sample` (the sampler's host part: the fused sampling kernel is
replaced by an argmax over a [rows, vocab] tensor), `process` (reading tokens back: `Scheduler.update` and the
engine's per-sample bookkeeping) and `step` (the whole `LLMEngine.step`), in CPU time of the
engine's thread (`time.thread_time`: steadier than wall time on a shared machine). Async scheduling
is on, as on a GPU. Rows: `--num-seqs` sequences of `--prompt-len` tokens all decoding; the
timed steps come after every prompt is computed; `--churn` ends and admits a sequence every
few steps (joins and leaves in the steady batch).

  python bench/studies/host_step.py [--num-seqs 256] [--steps 200] [--repeat 5] [--churn 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support

PARTS = ("schedule", "plan", "apply", "prepare", "sample", "process", "step")


def _model_dir(vocab: int) -> Path:
    from dummy_model import SHAPES, _COMMON

    out = Path(tempfile.mkdtemp(prefix="open-lmi-host-step-"))
    config = {**_COMMON, **SHAPES["tiny"], "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config))
    return out


class Timers:
    """Wall time per named part, summed over the steps being timed."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, obj: object, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.thread_time() - t0

        setattr(obj, attr, timed)


def build_engine(args: argparse.Namespace):  # noqa: ANN201
    import torch

    import kernels
    import serving.executor.model_runner as model_runner
    from serving.engine.llm_engine import LLMEngine
    from serving.engine_config import EngineConfig

    config = EngineConfig(model=str(_model_dir(args.vocab)), load_format="dummy", device="cpu", dtype="float32",
                          skip_tokenizer_init=True, max_num_seqs=args.num_seqs, max_model_len=2048,
                          max_num_batched_tokens=max(8192, args.num_seqs), kv_cache_memory_gb=1.0,
                          async_scheduling=True)
    engine = LLMEngine(config)
    runner = engine.executor.runner
    hidden = torch.zeros(args.num_seqs * args.prompt_len + args.num_seqs, runner.model_args.hidden_size)
    logits = torch.zeros(args.num_seqs, args.vocab)  # the decode graphs' static logits buffer

    def trivial_forward(input_ids, positions, meta):  # noqa: ANN001, ANN202
        n = input_ids.shape[0]
        if meta.num_prefills == 0 and n <= logits.shape[0]:
            return hidden[:n], logits[:n]
        return hidden[:n], None

    runner._run_model = trivial_forward
    runner.model.compute_logits = lambda h, out=None: torch.zeros(h.shape[0], args.vocab)
    # The fused sampling kernel is one launch on a GPU; its CPU reference loops over rows.
    kernels.gumbel_sample = lambda logits, inv_t, seeds: logits.argmax(dim=-1)
    timers = Timers()
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine, "_plan", "plan")
    timers.wrap(runner.batch, "apply", "apply")
    timers.wrap(model_runner, "prepare_inputs", "prepare")
    timers.wrap(runner.sampler, "sample", "sample")
    if hasattr(runner.sampler, "sample_plain"):
        timers.wrap(runner.sampler, "sample_plain", "sample")
    timers.wrap(engine, "_process", "process")
    return engine, timers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--churn", type=int, default=0, help="end one sequence and admit one every N steps (0: never)")
    args = ap.parse_args()
    import torch

    from serving.sampling_params import SamplingParams

    torch.set_num_threads(1)
    engine, timers = build_engine(args)
    max_tokens = args.steps * args.repeat + 64
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens, detokenize=False)
    rng = torch.Generator().manual_seed(0)
    next_id = 0

    def add() -> str:
        nonlocal next_id
        rid = f"r{next_id}"
        next_id += 1
        ids = torch.randint(3, args.vocab, (args.prompt_len,), generator=rng).tolist()
        engine.add_request(rid, None, params, prompt_token_ids=ids, final_only=True)
        return rid

    live = [add() for _ in range(args.num_seqs)]
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    for _ in range(20):  # warm
        engine.step()
    best: dict[str, float] = {}
    for _ in range(args.repeat):  # the least of each part over the repeats (a shared machine is noisy)
        timers.total.clear()
        timers.on = True
        t0 = time.thread_time()
        for i in range(args.steps):
            if args.churn and i % args.churn == 0:
                engine.abort_request(live.pop(0))
                live.append(add())
            engine.step()
        timers.total["step"] = time.thread_time() - t0
        timers.on = False
        for name in PARTS:
            best[name] = min(best.get(name, float("inf")), timers.total[name])
    n = args.steps
    print(f"{args.num_seqs} rows, {n} steps x {args.repeat}, churn {args.churn or 'none'}: host µs per decode step "
          f"(least of {args.repeat})")
    print("| part | µs/step |")
    print("|---|---|")
    for name in PARTS:
        print(f"| {name} | {best[name] / n * 1e6:,.0f} |")


if __name__ == "__main__":
    main()
