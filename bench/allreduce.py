"""The tensor-parallel all-reduce alone, custom (symmetric memory) against NCCL; then decode per degree.

Part `micro` (spawns one process per GPU itself; TP=4 on all four and TP=2 on a sub-group of
ranks 0-1, the others idle): bf16 messages of 16 KiB ... 16 MiB, microseconds per call of NCCL,
the one-shot and the two-shot kernel (`serving/executor/custom_all_reduce.py`), eager (a loop of
launches) and inside a CUDA graph (20 calls a graph), the max over ranks, and the path
`parallel.all_reduce` would take at that size. Correctness at every size and degree, against
NCCL: float32 integers exactly equal on both kernels (eager and replayed from a graph),
bfloat16 within rounding, and bitwise the same result on every rank.

Part `fused` (one process per GPU): the all-reduce followed by the residual add + RMSNorm, as each
layer runs it twice, at decode sizes (1, 8, 32 rows of the 8B's 4096 and the 70B's 8192 columns):
NCCL + norm, one-shot + norm (the unfused path) and the fused one-launch kernel
(`kernels/all_reduce_norm.py`), us per pair in a CUDA graph and eager, max over ranks, with the
fused result checked against the unfused one (close) and across ranks (same bits).

Part `decode` (a child `bench/parallel.py`): batch-1 decode ms/token of the Llama-3-8B shape at
TP=1/2/4 and the 70B shape at TP=4, random bf16 weights, custom all-reduce on and off, against the
TP-GPU floor (weights / (TP x copy bandwidth)); then the fp32 greedy agreement of TP=2/4 (custom
all-reduce on) with TP=1.

Part `profile` (a child `bench/decode_profile.py`): the batch-1 decode graph of the 8B shape on rank 0
at TP=1 and TP=4 (`--profile-tp`) under torch.profiler: us per step by kernel kind and name, and the
gaps between kernels, so the per-layer cost above the floor has names.

  python bench/allreduce.py                      # everything, on 4 GPUs (~6 min); a table at the end
  python bench/allreduce.py --parts micro,profile   # the all-reduce alone, then the decode step's kernels
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.decode_profile import print_profile  # noqa: E402

SIZES = [16 << 10 << i for i in range(11)]  # 16 KiB .. 16 MiB
PATHS = ("nccl", "one_shot", "two_shot")


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


# ---- micro: one process per GPU ----------------------------------------------------------------

def _join(rank: int, world: int, init_file: str) -> torch.device:
    """This spawned rank's GPU, in the default NCCL group of `world` ranks."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=device)
    return device


def _micro_rank(rank: int, world: int, init_file: str, degrees: list[int], out_file: str) -> None:
    import torch.distributed as dist

    from serving.executor.custom_all_reduce import CustomAllReduce, default_policy

    device = _join(rank, world, init_file)
    rows = []
    for degree in degrees:
        group = dist.new_group(list(range(degree)))  # every rank calls new_group, the members use it
        if rank < degree:
            dist.all_reduce(torch.ones(1, device=device), group=group)  # NCCL communicator up before graphs
            policy = default_policy(degree)
            custom = CustomAllReduce.create(group, device, policy, buffer_bytes=max(SIZES))
            if custom is None:
                rows.append({"tp": degree, "error": "custom all-reduce could not be set up (see the log)"})
            else:
                rows += [_micro_size(custom, group, degree, rank, n) for n in SIZES]
                rows += _per_step_collectives(custom, group, degree, rank)
                custom.close()
        dist.barrier()
    if rank == 0:
        Path(out_file).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _runner(custom, group, path: str):  # noqa: ANN001, ANN202
    import torch.distributed as dist

    if path == "nccl":
        return lambda t: dist.all_reduce(t, group=group)
    return lambda t: custom.run(t, path)


def _max_over(value: float, group) -> float:  # noqa: ANN001
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _events_us(run, count: int, group) -> float:  # noqa: ANN001
    """Microseconds per `run()` over `count` back-to-back runs, started together on every rank."""
    import torch.distributed as dist

    dist.barrier(group=group)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(count):
        run()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / count


def _eager_us(fn, t: torch.Tensor, group, iters: int) -> float:  # noqa: ANN001
    for _ in range(3):
        fn(t)
    return _max_over(_events_us(lambda: fn(t), iters, group), group)


def _graph(fn, t: torch.Tensor, reps: int) -> torch.cuda.CUDAGraph:  # noqa: ANN001
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(t)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn(t)
    torch.cuda.synchronize()
    return g


def _graph_us(fn, t: torch.Tensor, group, reps: int = 20, replays: int = 10) -> float:  # noqa: ANN001
    g = _graph(fn, t, reps)
    g.replay()
    us = _events_us(g.replay, replays, group) / reps
    del g
    return _max_over(us, group)


def _check(custom, group, degree: int, rank: int, n_bytes: int) -> str:  # noqa: ANN001
    """'ok', or what differed: fp32 integers exact (eager and graph), bf16 close, same bits on every rank."""
    import torch.distributed as dist

    problems = []
    gen = torch.Generator(device="cuda").manual_seed(1000 * rank + n_bytes % 997)
    x32 = torch.randint(-8, 9, (n_bytes // 4,), generator=gen, device="cuda").float()
    ref32 = x32.clone()
    dist.all_reduce(ref32, group=group)
    xb = torch.randn(n_bytes // 2, generator=gen, device="cuda").bfloat16()
    refb = xb.clone()
    dist.all_reduce(refb, group=group)
    for path in ("one_shot", "two_shot"):
        y = x32.clone()
        custom.run(y, path)
        if not torch.equal(y, ref32):
            problems.append(f"{path} fp32 eager != NCCL")
        static = torch.zeros_like(x32)
        g = _graph(lambda t, p=path: custom.run(t, p), static, 1)
        static.copy_(x32)
        g.replay()
        torch.cuda.synchronize()
        if not torch.equal(static, ref32):
            problems.append(f"{path} fp32 graph != NCCL")
        del g
        yb = xb.clone()
        custom.run(yb, path)
        err = ((yb.float() - refb.float()).abs().max() / refb.float().abs().max().clamp_min(1e-6)).item()
        if err > 2 ** -4:  # a few bf16 ulps at the largest value; wrong data is O(1)
            problems.append(f"{path} bf16 rel err {err:.2e}")
        every = [torch.empty_like(yb) for _ in range(degree)]
        dist.all_gather(every, yb, group=group)
        if not all(torch.equal(every[0], e) for e in every[1:]):
            problems.append(f"{path} bf16 differs between ranks")
    flags = [None] * degree
    dist.all_gather_object(flags, problems, group=group)
    merged = sorted({p for f in flags for p in f})
    return "ok" if not merged else "; ".join(merged)


def _micro_size(custom, group, degree: int, rank: int, n_bytes: int) -> dict:  # noqa: ANN001
    t = torch.randn(n_bytes // 2, device="cuda").bfloat16()
    chosen = custom.policy.path(t) or "nccl"
    row = {"tp": degree, "bytes": n_bytes, "path": chosen, "check": _check(custom, group, degree, rank, n_bytes)}
    iters = 50 if n_bytes <= 1 << 20 else 20
    for path in PATHS:
        fn = _runner(custom, group, path)
        t.normal_()
        row[f"eager_{path}"] = _eager_us(fn, t, group, iters)
        t.normal_()
        row[f"graph_{path}"] = _graph_us(fn, t, group)
    return row


def _per_step_collectives(custom, group, degree: int, rank: int) -> list[dict]:  # noqa: ANN001
    """The decode step's other collectives, NCCL against a candidate built on the custom all-reduce:
    rank 0's sampled ids to every rank (eager, as model_runner does: dist.broadcast vs a float32
    one-shot sum of the ids on rank 0 and zeros elsewhere, exact below 2**24), and the LM head's
    bf16 logits gather of the 8B / 70B vocab shard (in a graph: all_gather_into_tensor vs each rank
    writing its shard into a zeroed [TP, shard] slab that one sum completes: x + 0 is x)."""
    import torch.distributed as dist

    rows = []
    src = dist.get_global_rank(group, 0)
    for n in (1, 256):
        ids = torch.arange(n, device="cuda", dtype=torch.long) * 997 % 128256
        stage = torch.zeros(-(-n // 4) * 4, dtype=torch.float32, device="cuda")

        def via_sum(ids=ids, stage=stage, n=n) -> None:  # noqa: ANN001
            stage.zero_()
            if rank == 0:
                stage[:n].copy_(ids)
            custom.run(stage, "one_shot")
            ids.copy_(stage[:n])

        check = ids.clone() if rank == 0 else torch.zeros_like(ids)
        via_sum(check)
        good = torch.equal(check, ids)
        rows.append({"tp": degree, "what": f"broadcast {n} ids, eager", "check": "ok" if good else "MISMATCH",
                     "nccl_us": _eager_us(lambda t: dist.broadcast(t, src=src, group=group), ids, group, 50),
                     "candidate_us": _eager_us(via_sum, ids, group, 50)})
    for rows_n in (1, 8):
        shard = torch.randn(rows_n, 128256 // degree, device="cuda").bfloat16()
        gathered = torch.empty(degree * shard.numel(), dtype=shard.dtype, device="cuda")
        slab = torch.zeros(degree * shard.numel(), dtype=shard.dtype, device="cuda")
        path = custom.policy.path(slab) or "two_shot"

        def via_sum(_t, shard=shard, slab=slab, path=path) -> None:  # noqa: ANN001
            slab.zero_()
            slab[rank * shard.numel():(rank + 1) * shard.numel()].copy_(shard.view(-1))
            custom.run(slab, path)

        via_sum(None)
        dist.all_gather_into_tensor(gathered, shard.view(-1), group=group)
        torch.cuda.synchronize()
        rows.append({"tp": degree, "what": f"logits gather {rows_n}x{128256 // degree} bf16, graph",
                     "check": "ok" if torch.equal(slab, gathered) else "MISMATCH",
                     "nccl_us": _graph_us(lambda _t: dist.all_gather_into_tensor(gathered, shard.view(-1), group=group),
                                          shard, group),
                     "candidate_us": _graph_us(via_sum, shard, group), "candidate_path": path})
    return rows


def _spawn_ranks(target, world: int, out_file: Path) -> list[dict]:  # noqa: ANN001
    """Run `target(rank, world, init_file, degrees, out_file)` on every GPU (TP=4, then TP=2); rank 0's rows."""
    import tempfile

    import torch.multiprocessing as mp

    degrees = [d for d in (4, 2) if d <= world]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(target, args=(world, os.path.join(tmp, "init"), degrees, str(out_file)), nprocs=world, join=True)
    return json.loads(out_file.read_text())


def part_micro(world: int, out_dir: Path) -> list[dict]:
    return _spawn_ranks(_micro_rank, world, out_dir / "allreduce_micro.json")


def print_micro(rows: list[dict]) -> None:
    print("\n== all-reduce alone, bf16, us per call (max over ranks); 'path' = what parallel.all_reduce takes")
    print(f"{'TP':>2} {'size':>7} {'path':>8} | {'eager nccl':>10} {'1shot':>7} {'2shot':>7} | "
          f"{'graph nccl':>10} {'1shot':>7} {'2shot':>7} | {'graph gain':>10} | check")
    for r in rows:
        if "error" in r:
            print(f"{r['tp']:>2} {r['error']}")
            continue
        if "what" in r:
            continue
        chosen = r[f"graph_{r['path']}"]
        print(f"{r['tp']:>2} {_fmt_size(r['bytes']):>7} {r['path']:>8} | {r['eager_nccl']:>10.1f} "
              f"{r['eager_one_shot']:>7.1f} {r['eager_two_shot']:>7.1f} | {r['graph_nccl']:>10.1f} "
              f"{r['graph_one_shot']:>7.1f} {r['graph_two_shot']:>7.1f} | {r['graph_nccl'] / chosen:>9.2f}x | "
              f"{r['check']}")
    others = [r for r in rows if "what" in r]
    if others:
        print("\n== the decode step's other collectives: NCCL vs a candidate on the custom all-reduce, us per call")
        for r in others:
            print(f"{r['tp']:>2} {r['what']:<36} nccl {r['nccl_us']:>7.1f}  candidate {r['candidate_us']:>7.1f} "
                  f"({r.get('candidate_path', 'one_shot')})  {r['check']}")


# ---- fused: all-reduce + add + RMSNorm -----------------------------------------------------------

FUSED_SHAPES = [(rows, hidden) for hidden in (4096, 8192) for rows in (1, 8, 32)]


def _fused_rank(rank: int, world: int, init_file: str, degrees: list[int], out_file: str) -> None:
    import torch.distributed as dist

    import kernels
    from serving.executor.custom_all_reduce import CustomAllReduce, default_policy

    device = _join(rank, world, init_file)
    rows = []
    for degree in degrees:
        group = dist.new_group(list(range(degree)))
        if rank < degree:
            dist.all_reduce(torch.ones(1, device=device), group=group)
            custom = CustomAllReduce.create(group, device, default_policy(degree))
            if custom is None or not custom.enable_fused_norm(torch.bfloat16):
                rows.append({"tp": degree, "error": "custom all-reduce / fused norm could not be set up (see the log)"})
            else:
                for n_rows, hidden in FUSED_SHAPES:
                    gen = torch.Generator(device="cuda").manual_seed(rank * 7 + n_rows)
                    x = torch.randn(n_rows, hidden, device="cuda", generator=gen).bfloat16()
                    residual = torch.randn(n_rows, hidden, device="cuda").bfloat16()
                    weight = torch.ones(hidden, device="cuda").bfloat16()
                    dist.broadcast(residual, src=dist.get_global_rank(group, 0), group=group)

                    def unfused(t, path, copy=False):  # noqa: ANN001, ANN202
                        y = t.clone() if copy else t  # in place, as the model sums its GEMM's output
                        if path == "nccl":
                            dist.all_reduce(y, group=group)
                        else:
                            custom.run(y, path)
                        return kernels.rms_norm(y, weight, 1e-5, residual)

                    def fused(t):  # noqa: ANN001, ANN202
                        return custom.fused_rms_norm(t, weight, 1e-5, residual, False)

                    if not custom.fused_takes(x):
                        rows.append({"tp": degree, "rows": n_rows, "hidden": hidden, "error": "over the fused slot"})
                        continue
                    want = unfused(x, "one_shot", copy=True)
                    got = fused(x)
                    torch.cuda.synchronize()
                    close = all(torch.allclose(a.float(), b.float(), atol=5e-2, rtol=2e-2) for a, b in zip(got, want))
                    mine = torch.cat([got[0].view(-1), got[1].view(-1)]).float()
                    first = mine.clone()
                    dist.broadcast(first, src=dist.get_global_rank(group, 0), group=group)
                    same = bool(torch.equal(first, mine))
                    row = {"tp": degree, "rows": n_rows, "hidden": hidden,
                           "check": "ok" if close and same else f"MISMATCH close={close} same_bits={same}"}
                    for name, fn in (("nccl", lambda t: unfused(t, "nccl")), ("one_shot", lambda t: unfused(t, "one_shot")),
                                     ("fused", fused)):
                        row[f"graph_{name}"] = _graph_us(fn, x, group)
                        row[f"eager_{name}"] = _eager_us(fn, x, group, 50)
                    rows.append(row)
            if custom is not None:
                custom.close()
        dist.barrier()
    if rank == 0:
        Path(out_file).write_text(json.dumps(rows))
    dist.destroy_process_group()


def part_fused(world: int, out_dir: Path) -> list[dict]:
    return _spawn_ranks(_fused_rank, world, out_dir / "allreduce_fused.json")


def print_fused(rows: list[dict]) -> None:
    print("\n== all-reduce + residual add + RMSNorm, bf16, us per pair (max over ranks)")
    print(f"{'TP':>2} {'rows x hidden':>13} | {'graph nccl+norm':>15} {'1shot+norm':>10} {'fused':>7} | "
          f"{'eager nccl+norm':>15} {'1shot+norm':>10} {'fused':>7} | check")
    for r in rows:
        if "error" in r:
            print(f"{r['tp']:>2} {r.get('rows', '')} x {r.get('hidden', '')} {r['error']}")
            continue
        print(f"{r['tp']:>2} {r['rows']:>5} x {r['hidden']:<5} | {r['graph_nccl']:>15.1f} {r['graph_one_shot']:>10.1f} "
              f"{r['graph_fused']:>7.1f} | {r['eager_nccl']:>15.1f} {r['eager_one_shot']:>10.1f} "
              f"{r['eager_fused']:>7.1f} | {r['check']}")


# ---- decode: bench/parallel.py in a child process ----------------------------------------------

def _parallel_child(out: Path, *options: str) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "parallel.py"), *options, "--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=False)
    return json.loads(out.read_text()) if out.is_file() else {}


def part_decode(args, out_dir: Path) -> dict:  # noqa: ANN001
    """Decode on and off the custom all-reduce; then agreement with it on (one 48-token budget:
    prompt chunks share mixed steps with decodes, so both graph families carry its sums)."""
    results = {}
    if args.decode_parts:
        results.update(_parallel_child(out_dir / "allreduce_decode.json", "--parts", args.decode_parts,
                                       "--tp8b", args.tp8b, "--tp70b", args.tp70b, "--custom-ar", args.custom_ar,
                                       "--no-workload", "--model-root", args.model_root))
    if args.tp_agree:
        results.update(_parallel_child(out_dir / "allreduce_agree.json", "--parts", "agree", "--tp-agree",
                                       args.tp_agree, "--agree-budgets", "48", "--custom-ar", "on",
                                       "--model-root", args.model_root))
    return results


def print_decode(results: dict) -> None:
    print("\n== batch-1 decode, random bf16 weights: ms/token and share of the TP-GPU floor")
    print(f"{'shape':>6} {'TP':>2} {'all-reduce':>10} | {'ms/token':>8} {'floor ms':>8} {'of floor':>8} | load s")
    for part, shape in (("tp8b", "8B"), ("tp70b", "70B")):
        for key, r in results.get(part, {}).items():
            if not key.startswith("tp"):
                continue
            tp, _, mode = key[2:].partition("_")
            print(f"{shape:>6} {tp:>2} {mode or '-':>10} | {r['decode_ms']:>8.2f} {r['decode_floor_ms']:>8.2f} "
                  f"{100 * r['decode_of_floor']:>7.1f}% | {r['load_s']:.0f}")
    if "agree" in results:
        print("\n== fp32 greedy agreement with TP=1 (identical sequences)")
        for key, value in results["agree"].items():
            print(f"  {key}: {value}")


def part_profile(args, out_dir: Path) -> list[dict]:  # noqa: ANN001
    out = out_dir / "decode_profile.json"
    cmd = [sys.executable, str(ROOT / "bench" / "decode_profile.py"), "--shape", "llama-3-8b", "--tp", args.profile_tp,
           "--custom-ar", "on", "--model-root", args.model_root, "--out-dir", str(out_dir), "--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    try:  # a stuck profiler must not eat the rest of the call (decode follows)
        subprocess.run(cmd, check=False, timeout=args.profile_timeout_s)
    except subprocess.TimeoutExpired:
        print(f"decode profile: no result within {args.profile_timeout_s} s, killed", flush=True)
    return json.loads(out.read_text()) if out.is_file() else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="micro,fused,profile,decode")
    ap.add_argument("--world", type=int, default=0, help="GPUs for the micro part (default: all, at most 4)")
    ap.add_argument("--decode-parts", default="tp8b,tp70b", help="bench/parallel.py parts run on and off")
    ap.add_argument("--tp8b", default="1,2,4")
    ap.add_argument("--tp70b", default="4")
    ap.add_argument("--custom-ar", default="on,unfused,off", help="bench/parallel.py's modes for the decode part")
    ap.add_argument("--tp-agree", default="2,4", help="degrees checked against TP=1 in fp32 ('' skips)")
    ap.add_argument("--profile-tp", default="1,4", help="degrees of the decode-step profile (8B shape)")
    ap.add_argument("--profile-timeout-s", type=int, default=240)
    ap.add_argument("--model-root", default="/tmp/open-lmi-bench-models")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "/tmp/allreduce_bench"))
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    world = args.world or min(4, torch.cuda.device_count())
    print(f"device: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}; torch {torch.__version__}; "
          f"TORCH_SYMM_MEM_DISABLE_MULTICAST={os.environ.get('TORCH_SYMM_MEM_DISABLE_MULTICAST')} "
          f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}", flush=True)
    micro, fused, profiles, decode = [], [], [], {}
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        if part == "micro":
            micro = part_micro(world, out_dir)
            print_micro(micro)
        elif part == "fused":
            fused = part_fused(world, out_dir)
            print_fused(fused)
        elif part == "profile":
            profiles = part_profile(args, out_dir)
        elif part == "decode":
            decode = part_decode(args, out_dir)
        else:
            raise SystemExit(f"unknown part {part!r}")
        print(f"== {part}: {time.perf_counter() - t0:.0f} s", flush=True)
    if micro:
        print_micro(micro)
    if fused:
        print_fused(fused)
    for result in profiles:
        print_profile(result)
    if decode:
        print_decode(decode)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
