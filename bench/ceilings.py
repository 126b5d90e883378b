"""Hardware ceilings measured in the same run as a benchmark: copy bandwidth and bf16 matmul rate.

Both are medians over timed repetitions after a warm-up, on random data (zeros run faster).
"""

from __future__ import annotations

import torch


def _time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth_gbs(num_bytes: int = 4 << 30) -> float:
    """Device-to-device copy, bytes read + written per second, in GB/s."""
    src = torch.randn(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def matmul_tflops(n: int = 8192) -> float:
    """An n x n x n bf16 matmul rate in TFLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of `fn` on the current CUDA stream."""
    return _time_ms(fn, iters, warmup)


def graphed(fn, reps: int = 1):
    """Capture `reps` calls of fn in one CUDA graph and return its replay (launch gaps out of the timing)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return g.replay
