"""Who waits for whom in a batch-1 decode step: the engine's host or the GPU, in-process and across ranks.

`bench/latency.py` gives ms per step; this gives the same figure per configuration plus, in the driver
process, the mean wall time of `LLMEngine.step()` and the part of it spent in
`MultiprocExecutor._fetch` waiting for rank 0's sampled tokens (worker-process executors only). A
driver that spends nearly all of its step waiting there is not the bottleneck: the step is set by the
ranks (their GPU work, or their own host work between graph replays). Compare the figure with
`bench/decode_profile.py`'s "graph alone" for the same shape to see what a step costs outside its graph.

  python3 bench/step_wait.py 1:bf16:ip,1:gptq:ip,2:bf16:mp,2:gptq:mp    # TP:variant:(ip|mp), 2 GPUs
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "support")]


def main() -> None:
    from bench.parallel import decode_ms, engine
    from dummy_model import QUANT_VARIANTS, dummy_dir, make_dummy_model_dir
    from serving.engine import llm_engine
    from serving.executor import multiproc

    spent = {"step": [0.0, 0], "fetch": [0.0, 0]}

    def timed(fn, key):  # noqa: ANN001, ANN202
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key][0] += time.perf_counter() - t0
                spent[key][1] += 1
        return wrapper

    llm_engine.LLMEngine.step = timed(llm_engine.LLMEngine.step, "step")
    multiproc.MultiprocExecutor._fetch = timed(multiproc.MultiprocExecutor._fetch, "fetch")
    for spec in sys.argv[1].split(",") if len(sys.argv) > 1 else ["1:bf16:ip"]:
        tp, variant, where = spec.split(":")
        assert where in ("ip", "mp"), f"{spec}: ip (in-process executor) or mp (worker processes)"
        model_dir = make_dummy_model_dir("llama-3-8b", dummy_dir("/tmp/open-lmi-bench-models", "llama-3-8b", variant),
                                         quantize=variant)
        llm = engine(model_dir, tp=int(tp), multiprocess=where == "mp", quantization=QUANT_VARIANTS[variant][1])
        decode_ms(llm, 16)  # warm
        for key in spent:
            spent[key] = [0.0, 0]
        ms = decode_ms(llm, 128)
        (step_s, steps), (fetch_s, fetches) = spent["step"], spent["fetch"]
        print(f"8B TP={tp} {variant} {where}: {ms:.3f} ms/token; driver step() {step_s / max(steps, 1) * 1e3:.3f} ms "
              f"({steps} steps), waiting for rank 0 {fetch_s / max(fetches, 1) * 1e3:.3f} ms ({fetches})", flush=True)
        llm.shutdown()


if __name__ == "__main__":
    main()
