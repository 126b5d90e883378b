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


def fused_norm_input(rank: int, rows: int, hidden: int, dtype: torch.dtype, call: int) -> torch.Tensor:
    """Rank `rank`'s partial rows for call `call` of `fused_norm_worker` (CPU; the test rebuilds them)."""
    gen = torch.Generator().manual_seed(104729 * rank + 31 * rows + hidden + 7 * call)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    x[0, :4] = -0.0  # senders must send -0.0 as +0.0: never the sentinel
    return x


def fused_norm_shared(rows: int, hidden: int, dtype: torch.dtype, call: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual, weight) every rank uses for that call."""
    gen = torch.Generator().manual_seed(1299709 + 31 * rows + hidden + 7 * call)
    return torch.randn(rows, hidden, generator=gen).to(dtype), (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)


def fused_norm_worker(rank: int, world_size: int, init_file: str, cases: list[tuple[int, int, str, bool]],
                      out_dir: str) -> None:
    """One rank: for each (rows, hidden, dtype name, with residual), call
    `parallel.all_reduce_rms_norm` eagerly three times in a row (both buffer phases and back), then
    once from a replayed CUDA graph; save `fused{r}.pt` = {"on": {dtype name: bool}, "paths": [path per
    case], "eager": [[(normed, residual) per call]], "graphed": [[per replay]]}."""
    torch.set_num_threads(1)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    parallel.init_tensor_parallel(rank, world_size, f"file://{init_file}", "nccl", device=device)
    try:
        # sorted: every rank must set the dtypes up in the same order (each is a collective)
        on = {name: parallel.enable_fused_norm(getattr(torch, name)) for name in sorted({c[2] for c in cases})}
        out: dict = {"on": on, "eager": [], "graphed": [], "paths": []}
        for rows, hidden, name, with_residual in cases:
            dtype = getattr(torch, name)
            got = []
            for call in range(3):
                x = fused_norm_input(rank, rows, hidden, dtype, call).to(device)
                if call == 0:
                    out["paths"].append(parallel.all_reduce_rms_norm_path(x))
                residual, weight = (t.to(device) for t in fused_norm_shared(rows, hidden, dtype, call))
                normed, res = parallel.all_reduce_rms_norm(x, weight, 1e-5, residual if with_residual else None)
                got.append((normed.cpu(), res.cpu()))
            out["eager"].append(got)
            x = fused_norm_input(rank, rows, hidden, dtype, 3).to(device)
            residual, weight = (t.to(device) for t in fused_norm_shared(rows, hidden, dtype, 3))
            static_x = torch.zeros_like(x)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                parallel.all_reduce_rms_norm(static_x, weight, 1e-5, residual if with_residual else None)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = parallel.all_reduce_rms_norm(static_x, weight, 1e-5, residual if with_residual else None)
            replays = []
            for _ in range(3):  # replays walk the phases too
                static_x.copy_(x)
                graph.replay()
                torch.cuda.synchronize()
                replays.append((static_out[0].cpu().clone(), static_out[1].cpu().clone()))
            out["graphed"].append(replays)
        torch.save(out, Path(out_dir) / f"fused{rank}.pt")
    finally:
        parallel.destroy_tensor_parallel()


def pushed_partial_worker(rank: int, world_size: int, init_file: str, cases: list[tuple[int, int, int]],
                          out_dir: str) -> None:
    """One rank: for each (rows, hidden, in_features), a bf16 `RowParallelLinear` then the fused
    all-reduce + add + norm (`RMSNorm.add_and_norm`), the partial made by `partial(x, push=True)` (the
    GEMV pushes its rows) and by `partial(x)` (the fused kernel pushes them), three eager calls of
    each interleaved, then two such layers captured in one CUDA graph (pushed) replayed three times
    beside the same two run eagerly unpushed; save `pushed{r}.pt` = {"pushed": [...], "plain": [...],
    "graphed": [(replays, eager)], "can_push": [...]}."""
    from kernels import skinny_can_push
    from serving.executor.models.linear import RowParallelLinear
    from serving.executor.models.norm import RMSNorm

    torch.set_num_threads(1)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    parallel.init_tensor_parallel(rank, world_size, f"file://{init_file}", "nccl", device=device)
    dtype = torch.bfloat16
    try:
        assert parallel.enable_fused_norm(dtype)
        out: dict[str, list] = {"pushed": [], "plain": [], "graphed": [], "can_push": []}
        for rows, hidden, in_features in cases:
            gen = torch.Generator().manual_seed(rows * 7 + hidden + in_features)
            full_w = (torch.randn(hidden, in_features, generator=gen) / in_features**0.5).to(dtype)
            lin = RowParallelLinear(in_features, hidden, bias=False, shard=parallel.tp_shard()).to(device, dtype)
            start, size = parallel.tp_shard().split(in_features)
            lin.weight.data.copy_(full_w[:, start:start + size].to(device))
            norm = RMSNorm(hidden, 1e-5).to(device, dtype)
            norm.weight.data.copy_((1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device))
            xs = [torch.randn(rows, in_features, generator=gen).to(dtype).to(device) for _ in range(3)]
            residual = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
            local = [x[:, start:start + size].contiguous() for x in xs]
            out["can_push"].append(skinny_can_push(local[0], lin.weight))

            def layer(x: torch.Tensor, res: torch.Tensor, push: bool) -> tuple[torch.Tensor, torch.Tensor]:
                return norm.add_and_norm(lin.partial(x, push=push), res, reduce=True)

            pushed, plain = [], []
            for x in local:
                pushed.append(tuple(t.cpu() for t in layer(x, residual, True)))
                plain.append(tuple(t.cpu() for t in layer(x, residual, False)))
            out["pushed"].append(pushed)
            out["plain"].append(plain)
            static_x = local[0].clone()

            def two_layers(push: bool) -> tuple[torch.Tensor, torch.Tensor]:
                _, res = layer(static_x, residual, push)
                return layer(static_x, res, push)  # the second call's residual: the first's sum

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the capture
                two_layers(True)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = two_layers(True)
            replays, eager = [], []
            for x in local:
                static_x.copy_(x)
                graph.replay()
                torch.cuda.synchronize()
                replays.append(tuple(t.cpu().clone() for t in static_out))
                eager.append(tuple(t.cpu() for t in two_layers(False)))
            out["graphed"].append((replays, eager))
        torch.save(out, Path(out_dir) / f"pushed{rank}.pt")
    finally:
        parallel.destroy_tensor_parallel()
