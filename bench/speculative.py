"""Speculative decoding (issue 29) on random weights at batch 1: what a verify step costs, and ms/token.

    python3 bench/speculative.py --model-root /tmp/open-lmi-bench-models --tokenizer-dir .bench_models/tokenizer

Two engines, one after the other (one process, one GPU, "uni" executor, async scheduling on):
speculation off, and n-gram speculation on (k=4, the default acceptance floor). On the second the
script swaps the proposer through the speculator's private `_proposer` for one that always
proposes k tokens (a fixed function of the last token: ~never what random weights pick), and for
the all-accepted rows sets the runner's private `_accept_all_drafts` (verification then accepts
every draft, whatever the target says: the emitted tokens are the drafts, which is fine for a cost
measurement). Both are benchmark hooks: no option, config key or environment variable reaches them.
With forced acceptance every step after the prefill is a verify step of k+1 rows, whatever bf16
near-ties a verify forward and a decode forward break differently.

Rows (the bars of issue 29):
  step          median wall time of a plain decode step (engine off) and of a verify step with k=4
                drafts, all accepted (engine on), each step run synchronously: ratio <= 1.25
  silent        ms/token with speculation on and nothing proposed vs off: must be ~1.00 (a step
                without drafts runs as plain decoding, async included)
  all_accepted  ms/token, k drafts every step, all accepted (forced), vs off: <= 0.35
  none_accepted ms/token, k drafts every step, verified (~none accepted), default acceptance floor
                (speculation turns itself down), vs off: <= 1.05; `none_accepted_no_floor` (floor
                off: every step verifies) is printed for the raw cost
  reference     8 random prompts, default n-gram config (~0 acceptance) vs off: within 5 %
Then (no bar; `--draft-shape none` skips it) a third engine with a draft model of `--draft-shape`
(random weights too, the same vocabulary: ~0 acceptance), k=4, acceptance floor off:
  draft_step    a verify step whose 4 drafts the draft model proposed (its k forwards included)
                vs a plain decode step; `draft_propose_ms` = that minus the all-accepted verify
                step above (the same k+1-row target forward)
  draft_all_accepted  ms/token with the draft proposing and every draft accepted (forced): what a
                draft that always agreed would give, its own cost included
  draft_none    ms/token proposing every step, ~none accepted, vs off; and with the default
                acceptance floor (`draft_none_floor`)
Each row is one JSON line; a table follows. `--shape tiny --device cpu` runs the logic on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the random-weight model builder lives with the tests' support

from dummy_model import SHAPES, dummy_dir, make_dummy_model_dir  # noqa: E402
from serving.llm import LLM  # noqa: E402
from serving.sampling_params import SamplingParams  # noqa: E402

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


class _BenchProposer:
    """What a proposer keeps per sequence: nothing here (drafts are point masses)."""

    def take_probs(self, seq_id: int) -> None:
        return None

    def propose_many(self, seqs, ks: list[int]) -> list[list[int]]:  # noqa: ANN001
        return [self.propose(seq, k) for seq, k in zip(seqs, ks)]  # type: ignore[attr-defined]

    def forget(self, seq_id: int) -> None:
        pass


class SilentProposer(_BenchProposer):
    """Proposes nothing."""

    def propose(self, seq, k: int) -> list[int]:  # noqa: ANN001
        return []

    def may_propose(self, seq) -> bool:  # noqa: ANN001
        return False


class AnyProposer(_BenchProposer):
    """Benchmark only: always `k` drafts, a fixed function of the sequence's last token (random
    weights ~never pick them: verified, none is accepted; under forced acceptance, all are)."""

    def propose(self, seq, k: int) -> list[int]:  # noqa: ANN001
        last = seq.token_ids[-1]
        return [100 + (last * 7919 + 104729 * (j + 1)) % 29900 for j in range(k)]

    def may_propose(self, seq) -> bool:  # noqa: ANN001
        return True


def accept_all(llm: LLM, on: bool) -> None:
    """The benchmark-only forced acceptance on the engine's verifier (the in-process runner)."""
    llm.llm_engine.executor.runner._accept_all_drafts = on


def _sync(device: str) -> None:
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


def model_dir(args, shape: str) -> Path:  # noqa: ANN001
    return make_dummy_model_dir(shape, dummy_dir(args.model_root, shape), args.tokenizer_dir)


def build(args, spec: dict | None) -> LLM:  # noqa: ANN001
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    options = dict(load_format="dummy", dtype=dtype, max_num_seqs=getattr(args, "max_num_seqs", 8),
                   max_model_len=min(4096, SHAPES[args.shape]["max_position_embeddings"]), device=args.device,
                   distributed_executor_backend="uni", speculative_config=spec, skip_tokenizer_init=True,
                   async_scheduling=True)
    if args.device == "cpu":
        options["kv_cache_memory_gb"] = 0.2
    return LLM(str(model_dir(args, args.shape)), **options)


def release(llm: LLM, device: str) -> None:
    """Free the engine's device memory now (weights, KV cache, graphs), before the next one sizes its cache."""
    llm.llm_engine.shutdown()
    gc.collect()
    if device != "cpu":
        import torch

        torch.cuda.empty_cache()


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def step_times(llm: LLM, request_id: str, prompt: list[int], steps: int, device: str) -> tuple[list[float], int]:
    """Wall time of each of `steps` synchronous decode steps of one sequence (after its prefill);
    how many of them verified drafts."""
    engine = llm.llm_engine
    engine.async_scheduling = False
    engine.add_request(request_id, None, greedy(steps * (K + 1) + K + 2), prompt_token_ids=prompt)
    engine.step()  # the prefill
    times, verify = [], 0
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            break
        drafts = engine.stats().get("spec_decode_num_drafts", 0)
        _sync(device)
        t0 = time.perf_counter()
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        verify += engine.stats().get("spec_decode_num_drafts", 0) > drafts
    engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.async_scheduling = True
    return times, verify


def ms_per_token(llm: LLM, prompts: dict[str, list[int]], max_tokens: int, device: str) -> dict:
    """Batch 1: each prompt alone to `max_tokens`; decode ms per generated token (the step that
    returns the first token excluded)."""
    engine = llm.llm_engine
    before = engine.stats()
    total_s, total_tokens = 0.0, 0
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, None, greedy(max_tokens), prompt_token_ids=prompt)
        first: list = []
        while not first:
            first = [d for d in engine.step() if d.token_ids]
        _sync(device)
        t0 = time.perf_counter()
        n = 0
        while engine.has_unfinished_requests():
            n += sum(len(d.token_ids) for d in engine.step())
        _sync(device)
        total_s += time.perf_counter() - t0
        total_tokens += n
    after = engine.stats()
    counts = {name: after.get("spec_decode_num_" + name, 0) - before.get("spec_decode_num_" + name, 0)
              for name in ("drafts", "draft_tokens", "accepted_tokens")}
    return {"ms_per_token": round(1000 * total_s / max(total_tokens, 1), 4), "tokens": total_tokens, **counts}


def draft_rows(args, prompt: list[int], plain_ms: float, verify_ms: float, off_single: dict) -> list[dict]:  # noqa: ANN001
    """The draft-model engine's rows (see the module docstring)."""
    spec = {"model": str(model_dir(args, args.draft_shape)), "num_speculative_tokens": K, "acceptance_floor": 0.0}
    llm = build(args, spec)
    speculator = llm.llm_engine.speculator
    assert speculator is not None
    step_times(llm, "warm-draft", prompt, args.steps, args.device)
    times, num_verify = step_times(llm, "steps-draft", prompt, args.steps, args.device)
    none = ms_per_token(llm, {"none": prompt}, args.max_tokens, args.device)
    accept_all(llm, True)
    everything = ms_per_token(llm, {"all": prompt}, args.max_tokens, args.device)
    accept_all(llm, False)
    speculator.config = dataclasses.replace(speculator.config, acceptance_floor=0.1)  # the default floor
    none_floor = ms_per_token(llm, {"none-floor": prompt}, args.max_tokens, args.device)
    release(llm, args.device)
    del llm, speculator
    step_ms = 1000 * statistics.median(times)
    base = off_single["ms_per_token"]
    return [
        {"what": "draft_step", "plain_decode_ms": round(plain_ms, 4), "verify_k4_ms": round(step_ms, 4),
         "ratio": step_ms / plain_ms, "bar": None, "verify_steps": num_verify, "steps": len(times),
         "draft_propose_ms": round(step_ms - verify_ms, 4)},
        {"what": "draft_all_accepted", "off": off_single, "on": everything,
         "ratio": everything["ms_per_token"] / base, "bar": None},
        {"what": "draft_none", "off": off_single, "on": none, "ratio": none["ms_per_token"] / base, "bar": None},
        {"what": "draft_none_floor", "off": off_single, "on": none_floor, "ratio": none_floor["ms_per_token"] / base,
         "bar": None},
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-root", default="/tmp/open-lmi-bench-models")
    ap.add_argument("--tokenizer-dir", default=None)
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=48, help="timed steps per step-cost measurement")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--reference-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-shape", default="llama-3.2-1b", choices=[*sorted(SHAPES), "none"])
    args = ap.parse_args()
    t_start = time.perf_counter()
    prompt = random_prompt(args.prompt_len, 1000)
    reference = {f"ref{s}": random_prompt(args.prompt_len, s) for s in range(args.reference_prompts)}
    head = {"shape": args.shape, "device": args.device, "k": K}

    off = build(args, None)
    plain_times, _ = step_times(off, "warm-off", prompt, args.steps, args.device)
    plain_times, _ = step_times(off, "steps-off", prompt, args.steps, args.device)
    off_single = ms_per_token(off, {"single-off": prompt}, args.max_tokens, args.device)
    off_reference = ms_per_token(off, reference, args.max_tokens, args.device)
    release(off, args.device)
    del off

    on = build(args, NGRAM)
    on_reference = ms_per_token(on, reference, args.max_tokens, args.device)  # the default n-gram proposer
    spec = on.llm_engine.speculator
    assert spec is not None
    default_proposer, default_config = spec._proposer, spec.config
    spec._proposer = SilentProposer()  # the benchmark hooks (bench only)
    silent = ms_per_token(on, {"silent": prompt}, args.max_tokens, args.device)
    # (a verify step of k+1 rows replays the smallest mixed-step graph bucket >= its rows)
    buckets = list(getattr(getattr(getattr(on.llm_engine.executor, "runner", None), "mixed_graphs", None),
                           "buckets", []))
    spec._proposer = AnyProposer()
    accept_all(on, True)
    spec.config = dataclasses.replace(default_config, acceptance_floor=0.0)  # every step verifies
    step_times(on, "warm-on", prompt, args.steps, args.device)
    verify_times, num_verify = step_times(on, "steps-on", prompt, args.steps, args.device)
    spec.config = default_config
    all_accepted = ms_per_token(on, {"all": prompt}, args.max_tokens, args.device)
    accept_all(on, False)
    none_accepted = ms_per_token(on, {"none": prompt}, args.max_tokens, args.device)
    spec.config = dataclasses.replace(default_config, acceptance_floor=0.0)
    none_no_floor = ms_per_token(on, {"none-no-floor": prompt}, args.max_tokens, args.device)
    spec.config, spec._proposer = default_config, default_proposer
    release(on, args.device)
    del on, spec

    plain_ms = 1000 * statistics.median(plain_times)
    verify_ms = 1000 * statistics.median(verify_times)
    base = off_single["ms_per_token"]
    rows = [
        {"what": "step", "plain_decode_ms": round(plain_ms, 4), "verify_k4_ms": round(verify_ms, 4),
         "ratio": verify_ms / plain_ms, "bar": 1.25, "verify_steps": num_verify, "steps": len(verify_times),
         "mixed_graph_buckets": buckets[:4]},
        {"what": "silent", "off": off_single, "on": silent, "ratio": silent["ms_per_token"] / base, "bar": 1.05},
        {"what": "all_accepted", "off": off_single, "on": all_accepted, "ratio": all_accepted["ms_per_token"] / base,
         "bar": 0.35},
        {"what": "none_accepted", "off": off_single, "on": none_accepted,
         "ratio": none_accepted["ms_per_token"] / base, "bar": 1.05},
        {"what": "none_accepted_no_floor", "off": off_single, "on": none_no_floor,
         "ratio": none_no_floor["ms_per_token"] / base, "bar": None},
        {"what": "reference", "off": off_reference, "on": on_reference,
         "ratio": on_reference["ms_per_token"] / off_reference["ms_per_token"], "bar": 1.05},
    ]
    for row in rows:
        print(json.dumps({**head, **row}), flush=True)
    if args.draft_shape != "none":
        try:
            rows += draft_rows(args, prompt, plain_ms, verify_ms, off_single)
        except Exception as exc:  # noqa: BLE001 - the rows above stand on their own
            print(f"draft-model rows failed: {type(exc).__name__}: {exc}", flush=True)
        for row in rows[6:]:
            print(json.dumps({**head, "draft_shape": args.draft_shape, **row}), flush=True)
    print(f"\n{args.shape} on {args.device}, batch 1, k={K}, {time.perf_counter() - t_start:.0f} s")
    print(f"{'row':<24}{'off ms':>10}{'on ms':>10}{'ratio':>8}{'bar':>7}  drafts/draft tokens/accepted")
    for row in rows:
        if row["what"] in ("step", "draft_step"):
            off_ms, on_ms = row["plain_decode_ms"], row["verify_k4_ms"]
            counts = f"{row['verify_steps']} verify steps of {row['steps']}"
            if "draft_propose_ms" in row:
                counts += f" (draft_propose_ms {row['draft_propose_ms']:.2f} for k={K})"
        else:
            off_ms, on_ms = row["off"]["ms_per_token"], row["on"]["ms_per_token"]
            counts = "/".join(str(row["on"][n]) for n in ("drafts", "draft_tokens", "accepted_tokens"))
        bar = "-" if row["bar"] is None else f"{row['bar']:.2f}"
        print(f"{row['what']:<24}{off_ms:>10.3f}{on_ms:>10.3f}{row['ratio']:>8.3f}{bar:>7}  {counts}")


if __name__ == "__main__":
    main()
