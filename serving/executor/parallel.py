"""Tensor parallelism (Megatron-style): this process's rank, the collectives, and how shapes split.

One process per GPU, all ranks in one group (the default process group unless one is given).
Each rank holds a slice of every large weight: attention heads, MLP columns and vocab rows
(`serving/executor/models/linear.py`, `embedding.py`). Activations meet in two collectives per layer (sum after
o_proj and after down_proj) plus one after the embedding and a gather of the logits.

Single process is the default and costs nothing: until `init_tensor_parallel` runs,
`tp_world_size()` is 1, `tp_shard()` is `TPShard(0, 1)` and every collective below returns its
input without calling torch.distributed. The collectives have no host synchronisation and no
branching on tensor values, so they can be captured in CUDA graphs, and run on CPU with gloo for
tests. `all_reduce` takes the custom all-reduce (symmetric memory, `custom_all_reduce.py`: one-shot
or two-shot over peer-to-peer buffers, microseconds at decode sizes) where `init_tensor_parallel`
could set it up and the message's size and dtype suit it, the process group's (NCCL, gloo) else.

How shapes split over W = `world_size` ranks (`validate_tensor_parallel` rejects the rest):
- KV heads, when W <= num_kv_heads: contiguous runs, as even as they go (rank r holds
  [r*K//W, (r+1)*K//W)); each rank holds the query heads of its KV groups (so the degree need
  not divide the heads: ranks may hold different head counts, and KV caches of different widths);
- when W > num_kv_heads (W a multiple of it): each rank holds ONE KV head, replicated: rank r
  holds head r * num_kv_heads // W, and H/W query heads, the ones that read it;
- MLP: `intermediate_size // W` columns of gate/up, the same rows of down_proj;
- vocab: `ceil(vocab / W)` rows per rank (the last rank's tail is zero padding); logits are
  gathered to `W * ceil(vocab / W)` columns and cut back to `vocab`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import kernels
from serving.executor.custom_all_reduce import CustomAllReduce

if TYPE_CHECKING:
    from serving.checkpoint.model_args import ModelArgs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPShard:
    """Which slice of the model this process holds: `rank` of `world_size` tensor-parallel ranks."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"bad tensor-parallel shard: rank {self.rank} of world size {self.world_size}")

    def split(self, size: int) -> tuple[int, int]:
        """(start, length) of this rank's even share of a dimension of `size`."""
        if size % self.world_size:
            raise ValueError(f"dimension {size} does not split evenly over {self.world_size} ranks")
        n = size // self.world_size
        return self.rank * n, n


_shard = TPShard()
_group: dist.ProcessGroup | None = None  # None: the default process group
_custom: CustomAllReduce | None = None  # the small-message all-reduce, where it could be set up
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # older torch


def init_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str = "env://",
    backend: str | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    custom_all_reduce: bool = True,
) -> TPShard:
    """Join the tensor-parallel group as `rank` of `world_size`; returns this process's shard.

    Initialises the default process group (unless one exists already, e.g. under torchrun) with
    `backend`: default "nccl" when CUDA is available, else "gloo". NCCL runs on `device`,
    default the current CUDA device: set it first (`torch.cuda.set_device`), one GPU per rank.
    `group` makes the collectives use a sub-group instead of the default group. One warm-up
    all-reduce runs eagerly, so the communicator exists before any CUDA-graph capture.
    With NCCL the custom all-reduce is set up too (a collective; off when `custom_all_reduce` is
    False or OPEN_LMI_DISABLE_CUSTOM_ALL_REDUCE=1; any failure falls back to NCCL, logged once).
    `world_size == 1` initialises nothing.
    """
    global _shard, _group, _custom
    shard = TPShard(rank, world_size)
    _close_custom()
    if world_size == 1:
        _shard, _group = shard, None
        return shard
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        extra = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **extra)
    if dist.get_world_size(group) != world_size or dist.get_rank(group) != rank:
        raise ValueError(f"process group has rank {dist.get_rank(group)} of {dist.get_world_size(group)}, "
                         f"asked for rank {rank} of {world_size}")
    _shard, _group = shard, group
    all_reduce(torch.ones(1, device=device))
    _custom = CustomAllReduce.create(group, device, enabled=custom_all_reduce)
    logger.info("tensor parallel: rank %d of %d (%s on %s)", rank, world_size, backend, device)
    return shard


def destroy_tensor_parallel() -> None:
    """Leave the group (destroys the default process group if one exists); back to single process."""
    global _shard, _group
    _close_custom()
    _shard, _group = TPShard(), None
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_shard() -> TPShard:
    """This process's shard: `TPShard(0, 1)` unless `init_tensor_parallel` ran."""
    return _shard


def tp_rank() -> int:
    return _shard.rank


def tp_world_size() -> int:
    return _shard.world_size


def _close_custom() -> None:
    global _custom
    if _custom is not None:
        _custom.close()
    _custom = None


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the tensor-parallel ranks, in place; returns `t` (untouched on one rank)."""
    if _shard.world_size > 1:
        assert _custom is None or _custom.pushed_pending() is None, "a pushed partial awaits the fused all-reduce"
        path = _custom.policy.path(t) if _custom is not None else None
        if path is not None:
            _custom.run(t, path)
        else:
            dist.all_reduce(t, group=_group)
    return t


def enable_fused_norm(dtype: torch.dtype) -> bool:
    """Turn on the fused all-reduce + residual add + RMSNorm for `dtype` where the custom
    all-reduce is on: a collective (every rank, once the model is built, before graph capture).
    Returns whether it is on; `all_reduce_rms_norm` is right either way."""
    return _shard.world_size > 1 and _custom is not None and _custom.enable_fused_norm(dtype)


def all_reduce_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                        unit_offset: bool = False, prefetch: object = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new residual) of `all_reduce(x)` (+ `residual`; without one the sum is the new
    residual): `kernels.rms_norm`'s arithmetic on the summed rows. One launch where the fused
    kernel takes `x` (`enable_fused_norm`), else the all-reduce then the norm. `x` may be
    overwritten. `prefetch`: an L2 hint for the weight read next (`kernels.l2_hint`), taken by the
    fused kernel only."""
    if _shard.world_size > 1 and _custom is not None:
        fused = _custom.fused_rms_norm(x, weight, eps, residual, unit_offset, prefetch)
        if fused is not None:
            return fused
    x = all_reduce(x)
    if residual is None:
        return kernels.rms_norm(x, weight, eps, None, unit_offset), x
    return kernels.rms_norm(x, weight, eps, residual, unit_offset)


def push_target(rows: int, hidden: int, dtype: torch.dtype) -> object | None:
    """Where a row-parallel GEMV may push its [rows, hidden] partial for the `all_reduce_rms_norm`
    that sums it next (`kernels.all_reduce_norm.PeerBuffers`), or None: then it writes its output
    as usual. A GEMV that pushes says so with `note_pushed(out)`."""
    if _shard.world_size > 1 and _custom is not None:
        return _custom.push_target(rows, hidden, dtype)
    return None


def note_pushed(out: torch.Tensor) -> None:
    """`out`'s rows were pushed (`push_target`): the next `all_reduce_rms_norm` must be of `out`."""
    assert _custom is not None
    _custom.note_pushed(out)


def all_reduce_rms_norm_path(x: torch.Tensor) -> str:
    """Which all-reduce `all_reduce_rms_norm(x, ...)` takes: "fused" (one launch with the norm) or
    `all_reduce_path(x)`'s answer (then a separate norm)."""
    if _shard.world_size > 1 and _custom is not None and _custom.fused_takes(x):
        return "fused"
    return all_reduce_path(x)


def all_reduce_path(t: torch.Tensor) -> str:
    """Which all-reduce `all_reduce(t)` takes: "none" (one rank), "one_shot" / "two_shot" (the
    custom all-reduce) or the process group's backend ("nccl", "gloo")."""
    if _shard.world_size == 1:
        return "none"
    path = _custom.policy.path(t) if _custom is not None else None
    return path if path is not None else str(dist.get_backend(_group))


def all_gather_last_dim(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `t` along the last dim in rank order: [..., n] -> [..., world_size * n]."""
    world_size = _shard.world_size
    if world_size == 1:
        return t
    flat = t.contiguous().view(-1)  # the flat form works on every backend (gloo rejects stacked shapes)
    out = torch.empty(world_size * flat.numel(), dtype=t.dtype, device=t.device)
    _all_gather_single(out, flat, group=_group)
    return out.view(world_size, *t.shape).movedim(0, -2).reshape(*t.shape[:-1], world_size * t.shape[-1])


# ---- how the model splits --------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionShard:
    """The attention heads one rank holds (global head indices start at the *_start fields)."""

    num_heads: int
    num_kv_heads: int
    q_head_start: int
    kv_head_start: int


def attention_shard(num_heads: int, num_kv_heads: int, shard: TPShard) -> AttentionShard:
    """This rank's query heads and KV heads.

    W = world_size <= num_kv_heads: KV heads are dealt out in contiguous runs as evenly as they go
    (rank r holds [r*K//W, (r+1)*K//W)), and each rank holds the query heads of its KV groups, so a
    degree need not divide the heads (SmolLM2's 9 heads / 3 KV heads split 3+6 over 2 ranks).
    W > num_kv_heads: one replicated KV head per rank, the query heads split evenly.
    """
    world_size, r = shard.world_size, shard.rank
    _check_heads(num_heads, num_kv_heads, world_size)
    if world_size <= num_kv_heads:
        group = num_heads // num_kv_heads
        kv_start, kv_end = r * num_kv_heads // world_size, (r + 1) * num_kv_heads // world_size
        return AttentionShard((kv_end - kv_start) * group, kv_end - kv_start, kv_start * group, kv_start)
    return AttentionShard(num_heads // world_size, 1, r * (num_heads // world_size), r * num_kv_heads // world_size)


def kv_heads_per_rank(args: ModelArgs, world_size: int, rank: int = 0) -> int:
    """KV heads in rank `rank`'s cache: `[.., num_blocks, block_size, kv_heads, head_dim]`."""
    return attention_shard(args.num_attention_heads, args.num_key_value_heads, TPShard(rank, world_size)).num_kv_heads


def vocab_per_rank(vocab_size: int, world_size: int) -> int:
    """Embedding / LM-head rows on each rank: ceil(vocab / world_size), the last rank zero-padded."""
    return -(-vocab_size // world_size)


def validate_tensor_parallel(args: ModelArgs, world_size: int) -> None:
    """Raise ValueError, naming the numbers, unless the model splits over `world_size` ranks."""
    assert world_size >= 1, world_size  # EngineConfig validated the degree
    _check_heads(args.num_attention_heads, args.num_key_value_heads, world_size)
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(args, name) % world_size:
            raise ValueError(f"tensor parallel degree {world_size} does not divide {name} ({getattr(args, name)})")


def _check_heads(num_heads: int, num_kv_heads: int, world_size: int) -> None:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})")
    if world_size > num_kv_heads:
        if world_size % num_kv_heads:
            raise ValueError(f"tensor parallel degree {world_size} is larger than num_key_value_heads "
                             f"({num_kv_heads}) but not a multiple of it, so KV heads cannot be replicated evenly")
        if num_heads % world_size:
            raise ValueError(f"tensor parallel degree {world_size} does not divide num_attention_heads ({num_heads}): "
                             "with replicated KV heads each rank must hold the same number of attention heads")


# ---- what the executor's workers exchange besides activations ---------------------------------

def broadcast_from_driver(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's `t` on every rank, in place (the ids rank 0 sampled); untouched on one rank."""
    if _shard.world_size > 1:
        dist.broadcast(t, src=dist.get_global_rank(_group, 0) if _group is not None else 0, group=_group)
    return t


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest `value` over the ranks (KV blocks: every rank must hold as many)."""
    if _shard.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_group)
    return int(t.item())
