"""What the NaN/Inf weight check at load costs (`serving/executor/finite_weights.py`), on this machine.

Loads the embedded default model's checkpoint (SmolLM2-135M) into memory, then times, best of 3,
the load-time check (one `torch.aminmax` per tensor, one host wait for all) against the obvious
per-tensor `isfinite().all().item()`, in fp32 and bf16, on 1 and 2 threads:

    PYTHONPATH=. python -m bench.studies.finite_weights
"""

from __future__ import annotations

import time

import torch
from safetensors.torch import load_file

from serving.checkpoint.default_model import default_model_path
from serving.executor.finite_weights import check_finite
from serving.executor.weights import checkpoint_files


def _best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    path = default_model_path()
    tensors: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(path):
        tensors.update(load_file(str(f)))
    values = sum(t.numel() for t in tensors.values())
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            cast = {k: v.to(dtype) for k, v in tensors.items()}
            check = _best(lambda: check_finite(cast.items(), str(path)))
            naive = _best(lambda: [torch.isfinite(t).all().item() for t in cast.values()])
            print(f"{path.name}: {len(cast)} tensors, {values / 1e6:.1f}M values, {dtype}, {threads} thread(s): "
                  f"aminmax check {check * 1e3:.0f} ms, per-tensor isfinite().all().item() {naive * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
