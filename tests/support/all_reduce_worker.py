"""Test helper: spawned ranks that sum tensors through `parallel.all_reduce` and save what they got.

`all_reduce_worker` joins a group (gloo on CPU, NCCL on `cuda:rank`), and for every message in
`cases` ((numel, dtype name)) records the path `all_reduce` takes and the sum it returns (eager
and, on CUDA, replayed from a CUDA graph) next to the process group's own all-reduce of the
same inputs: the oracle. Inputs are integers in [-8, 8] drawn per rank, so float32 sums are
exact whatever the summation order.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from serving.executor import parallel


def _input(rank: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * rank + numel)
    return torch.randint(-8, 9, (numel,), generator=gen).to(dtype=dtype, device=device)


def _graphed_sum(x: torch.Tensor) -> torch.Tensor:
    static = torch.zeros_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        parallel.all_reduce(static)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        parallel.all_reduce(static)
    static.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    return static.clone()


def all_reduce_worker(rank: int, world_size: int, init_file: str, backend: str, custom: bool,
                      cases: list[tuple[int, str]], out_dir: str) -> None:
    """One rank: save `rank{r}.pt` = {"paths": [...], "got": [...], "graphed": [...], "oracle": [...],
    "custom_on": bool}."""
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    parallel.init_tensor_parallel(rank, world_size, f"file://{init_file}", backend, device=device,
                                  custom_all_reduce=custom)
    try:
        out: dict[str, list] = {"paths": [], "got": [], "graphed": [], "oracle": []}
        for numel, dtype_name in cases:
            x = _input(rank, numel, getattr(torch, dtype_name), device)
            oracle = x.clone()
            dist.all_reduce(oracle)
            out["paths"].append(parallel.all_reduce_path(x))
            out["got"].append(parallel.all_reduce(x.clone()).cpu())
            out["graphed"].append(_graphed_sum(x).cpu() if device.type == "cuda" else None)
            out["oracle"].append(oracle.cpu())
        out["custom_on"] = parallel._custom is not None  # noqa: SLF001 - what init set up
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        parallel.destroy_tensor_parallel()
