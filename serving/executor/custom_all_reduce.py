"""A small-message all-reduce over symmetric memory: tensor parallelism's sums in microseconds.

NCCL's all-reduce of one decode token's hidden state (8-16 KB) costs ~19 us inside a CUDA graph on
H100s, and a decode step carries two per layer. PyTorch's symmetric-memory ops
(`torch.ops.symm_mem`, CUDA backend) do the same sum with plain peer-to-peer loads and stores
between GPUs that can reach each other's memory (NVLink, or PCIe peer access), no NVLink multicast:

- one-shot (`one_shot_all_reduce_copy_out`): each rank copies its input into its own slice of a
  buffer every rank has mapped, the ranks meet at a barrier, then every rank reads all ranks'
  slices and sums them. One kernel; reads world_size x the message per rank: small messages.
- two-shot (`two_shot_all_reduce_out`): each rank sums one 1/world_size chunk of everyone's
  buffer and the ranks then gather the chunks: a reduce-scatter plus an all-gather, for larger ones.

Both kernels sum the ranks' values in rank order 0, 1, ..., W-1 on whichever rank does the sum, so
every rank gets bitwise the same result, run after run (deterministic), and both start and end with
a barrier over the ranks' signal pads, so one buffer serves back-to-back calls. No host work
beyond the launch and no allocation: they are captured in CUDA graphs like NCCL's.

`AllReducePolicy` says which path a message takes (by size, dtype and alignment: the same answer
on every rank, else ranks would wait on different collectives); `CustomAllReduce.create` sets up
one persistent buffer per process group (a collective), checks that it works, and returns None
with a logged reason where it cannot (no CUDA, gloo, ranks on several hosts, no peer access, an
old torch, a failed rendezvous), so callers fall back to the process group's all-reduce.
NVLink multicast stays off (`TORCH_SYMM_MEM_DISABLE_MULTICAST=1` unless set): only the
peer-to-peer kernels run.

Where the model follows an all-reduce with the residual add and RMSNorm (Llama-style layers),
`enable_fused_norm` (a collective, once the model's dtype is known) sets up a second buffer for
`kernels/all_reduce_norm.py`: one launch that exchanges the partial rows without a barrier and
norms them; `fused_rms_norm` runs it for messages up to `OPEN_LMI_FUSED_NORM_MAX_KB`. A row-parallel GEMV
whose output that call sums may push its rows into the kernel's buffers itself (`push_target`,
`note_pushed`; `OPEN_LMI_PUSH_PARTIALS=0` turns it off): the exchange then starts from the GEMV's
epilogue, tile by tile.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

ONE_SHOT, TWO_SHOT = "one_shot", "two_shot"
# Forces the process group's all-reduce everywhere (debugging, the agreement test); vLLM's name.
DISABLE_ENV = "OPEN_LMI_DISABLE_CUSTOM_ALL_REDUCE"
# Threshold overrides in KiB (tuning from bench/allreduce.py without a code change).
ONE_SHOT_ENV, TWO_SHOT_ENV = "OPEN_LMI_ONE_SHOT_MAX_KB", "OPEN_LMI_TWO_SHOT_MAX_KB"
# The fused all-reduce + residual add + RMSNorm's largest message per rank, KiB (0: off).
FUSED_NORM_ENV = "OPEN_LMI_FUSED_NORM_MAX_KB"
# "0" stops row-parallel GEMVs from pushing their rows to the fused kernel themselves (`push_target`)
PUSH_ENV = "OPEN_LMI_PUSH_PARTIALS"
# Its default: decode batches up to 32 rows of a 4096-wide model, 16 of an 8192-wide one. Every rank
# reads W x the message, as in the one-shot kernel.
_FUSED_NORM_MAX = 256 << 10
_DTYPES = (torch.float32, torch.bfloat16)  # what the symm_mem kernels dispatch on
_ALIGN = 16  # bytes: the kernels' widest vector; both ops check offset and size alignment

# Largest message (bytes) per path by world size, from bench/allreduce.py on 4x H100 NVLink (bench/RESULTS.md,
# bf16, in a CUDA graph): one-shot beats two-shot up to 512 KiB at TP=4 (16.4 vs 17.6 us; 22.0
# vs 20.2 at 1 MiB) and up to 1 MiB at TP=2 (16.7 vs 18.0; 23.3 vs 21.2 at 2 MiB); two-shot beats NCCL
# up to 8 MiB at both (57 vs 66 us at TP=4, 44 vs 53 at TP=2; eager within 2 %) and loses eager at
# 16 MiB. One-shot reads W x the message per rank, so its range shrinks as W grows (8: unmeasured).
_ONE_SHOT_MAX = {2: 1 << 20, 4: 512 << 10, 8: 128 << 10}
_TWO_SHOT_MAX = 8 << 20


@dataclass(frozen=True)
class AllReducePolicy:
    """Which all-reduce a message takes: one-shot up to `one_shot_max_bytes`, two-shot up to
    `two_shot_max_bytes` (also the symmetric buffer's size), the process group's above.

    Exists so the choice is one pure function of what every rank sees alike (bytes, dtype, the
    tensor's storage offset), testable without GPUs and printed by the bench.
    """

    one_shot_max_bytes: int
    two_shot_max_bytes: int

    def __post_init__(self) -> None:
        if not 0 <= self.one_shot_max_bytes <= self.two_shot_max_bytes:
            raise ValueError(f"all-reduce thresholds must satisfy 0 <= one-shot ({self.one_shot_max_bytes}) "
                             f"<= two-shot ({self.two_shot_max_bytes}) bytes")

    def path(self, t: torch.Tensor) -> str | None:
        """ONE_SHOT, TWO_SHOT, or None (the process group's all-reduce) for tensor `t`."""
        return self.path_for(t.numel() * t.element_size(), t.dtype, t.storage_offset() * t.element_size(),
                             t.is_contiguous())

    def path_for(self, nbytes: int, dtype: torch.dtype, byte_offset: int = 0, contiguous: bool = True) -> str | None:
        if dtype not in _DTYPES or not contiguous or nbytes == 0 or nbytes % _ALIGN or byte_offset % _ALIGN:
            return None
        if nbytes <= self.one_shot_max_bytes:
            return ONE_SHOT
        if nbytes <= self.two_shot_max_bytes:
            return TWO_SHOT
        return None


def default_policy(world_size: int, env: dict[str, str] | None = None) -> AllReducePolicy:
    """The thresholds for `world_size` ranks, with the `OPEN_LMI_*_MAX_KB` overrides from `env`."""
    env = os.environ if env is None else env
    one = _ONE_SHOT_MAX.get(world_size, min(_ONE_SHOT_MAX.values()))
    two = _TWO_SHOT_MAX
    for name in (ONE_SHOT_ENV, TWO_SHOT_ENV):
        text = env.get(name, "").strip()
        if not text:
            continue
        if not text.isdigit():
            raise ValueError(f"{name} must be a non-negative integer (KiB), got {text!r}")
        if name == ONE_SHOT_ENV:
            one = int(text) << 10
        else:
            two = int(text) << 10
    return AllReducePolicy(one, max(one, two))


def refusal(enabled: bool, backend: str, device: torch.device, world_size: int,
            env: dict[str, str] | None = None) -> str | None:
    """Why this process cannot use the custom all-reduce (None: it may try), from local facts only."""
    env = os.environ if env is None else env
    if not enabled:
        return "disabled by the engine config (disable_custom_all_reduce)"
    if env.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return f"disabled by {DISABLE_ENV}"
    if world_size < 2:
        return "one rank"
    if backend != "nccl" or device.type != "cuda":
        return f"{backend} on {device.type} (the symmetric-memory kernels need CUDA peers)"
    if not _ops_available():
        return "this torch has no symm_mem one-shot/two-shot all-reduce ops"
    return None


def _ops_available() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401 - registers the Python side
    except ImportError:
        return False
    ops = torch.ops.symm_mem
    return all(hasattr(ops, n) for n in ("one_shot_all_reduce_out", "two_shot_all_reduce_"))


class CustomAllReduce:
    """One process group's symmetric buffer and the two kernels that sum through it.

    Build with `create` (a collective over `group`: every rank calls it, with the same policy).
    `run(t, path)` sums `t` over the group in place along `path`: `policy.path(t)` where that is
    not None (`parallel.all_reduce`), either kernel in the bench. `close()` drops the buffer
    (every rank, before the group goes).
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, policy: AllReducePolicy,
                 buffer: torch.Tensor, handle: object) -> None:
        self.group = group
        self.group_name = group.group_name
        self.device = device
        self.policy = policy
        self.world_size = dist.get_world_size(group)
        self._buffer = buffer  # uint8, policy.two_shot_max_bytes, rendezvoused over the group
        self._handle = handle
        ops = torch.ops.symm_mem
        self._one_shot_copy = getattr(ops, "one_shot_all_reduce_copy_out", None)  # newer torch: one kernel
        # The out variant is compiled for 2, 4 and 8 ranks only; the in-place one for any degree.
        self._two_shot_out = getattr(ops, "two_shot_all_reduce_out", None) if self.world_size in (2, 4, 8) else None
        # per dtype enabled (enable_fused_norm): the receive buffer, its handle, the kernel's PeerBuffers
        self._fused: dict[torch.dtype, tuple[torch.Tensor, object, object]] = {}
        self._fused_kernel = None  # kernels.all_reduce_norm.all_reduce_rms_norm, set by enable_fused_norm
        # GEMVs push row-parallel partials into the fused kernel's buffers (`push_target`); the
        # pushed tensor (pointer, shape, dtype) until the fused call that sums it
        self.push_partials = self.push_enabled()
        self._pushed: tuple[int, tuple[int, ...], torch.dtype] | None = None

    @staticmethod
    def push_enabled() -> bool:
        """`OPEN_LMI_PUSH_PARTIALS` (unset: on): whether row-parallel GEMVs may push their rows."""
        return os.environ.get(PUSH_ENV, "1").strip().lower() not in ("0", "false", "no", "off")

    @classmethod
    def create(cls, group: dist.ProcessGroup | None, device: torch.device,
               policy: AllReducePolicy | None = None, enabled: bool = True,
               buffer_bytes: int | None = None) -> CustomAllReduce | None:
        """Set up the custom all-reduce over `group` (None: the default group), or None with the
        reason logged. A collective: every rank of the group calls it and all get the same answer.
        The buffer holds `policy.two_shot_max_bytes` unless `buffer_bytes` asks for more (the bench
        runs either kernel at any size)."""
        group = group if group is not None else dist.group.WORLD
        world_size = dist.get_world_size(group)
        policy = policy or default_policy(world_size)
        reason = refusal(enabled, dist.get_backend(group), torch.device(device), world_size)
        if reason is not None:  # asked for, or nothing to do: not worth a warning
            logger.info("custom all-reduce off: %s; the process group's all-reduce serves every size", reason)
            return None
        reason = _peer_refusal(group, torch.device(device))  # a collective: same answer everywhere
        if reason is not None:
            logger.warning("custom all-reduce off: %s; NCCL serves every size", reason)
            return None
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # never multicast (peer loads only)
        made: CustomAllReduce | None = None
        error = ""
        try:
            made = cls._rendezvous(group, torch.device(device), policy, buffer_bytes)
            made._self_test()
        except Exception as exc:  # noqa: BLE001 - any failure means: fall back, on every rank
            error = f"{type(exc).__name__}: {exc}"
        ok = torch.tensor([0 if error else 1], dtype=torch.int32, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if not int(ok.item()):
            logger.warning("custom all-reduce off: setting it up failed (%s); NCCL serves every size",
                           error or "on another rank")
            if made is not None:
                made.close()
            return None
        logger.info("custom all-reduce on: %d ranks, one-shot <= %d KiB, two-shot <= %d KiB, NCCL above",
                    world_size, policy.one_shot_max_bytes >> 10, policy.two_shot_max_bytes >> 10)
        return made

    @classmethod
    def _rendezvous(cls, group: dist.ProcessGroup, device: torch.device, policy: AllReducePolicy,
                    buffer_bytes: int | None) -> CustomAllReduce:
        import torch.distributed._symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # required by older torch, a no-op later
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(group.group_name)
        nbytes = -(-max(policy.two_shot_max_bytes, buffer_bytes or 0, _ALIGN) // _ALIGN) * _ALIGN
        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buffer, group.group_name)
        return cls(group, device, policy, buffer, handle)

    def _self_test(self) -> None:
        """Both kernels on a known sum, before anything depends on them (integers: exact)."""
        rank = dist.get_rank(self.group)
        expect = float(self.world_size * (self.world_size + 1) // 2)
        for path in (ONE_SHOT, TWO_SHOT):
            t = torch.full((1024,), float(rank + 1), dtype=torch.float32, device=self.device)
            self.run(t, path)
            torch.cuda.synchronize(self.device)
            if not bool((t == expect).all()):
                raise RuntimeError(f"{path} self-test summed to {t[0].item()}, expected {expect}")

    def run(self, t: torch.Tensor, path: str) -> torch.Tensor:
        """Sum `t` over the group in place along `path` (ONE_SHOT or TWO_SHOT); returns `t`."""
        assert self._pushed is None, "a pushed partial must be summed by the fused kernel, not this one"
        nbytes = t.numel() * t.element_size()
        if (nbytes > self._buffer.numel() or nbytes % _ALIGN or t.storage_offset() * t.element_size() % _ALIGN
                or t.dtype not in _DTYPES or not t.is_contiguous()):
            raise ValueError(f"{path} cannot take {t.dtype} {tuple(t.shape)}: a contiguous float32/bfloat16 "
                             f"tensor of a multiple of {_ALIGN} bytes up to {self._buffer.numel()}, "
                             f"{_ALIGN}-byte aligned, is needed")
        flat = t.view(-1)
        staged = self._buffer[:nbytes].view(t.dtype)  # offset 0 of the rendezvoused allocation
        if path == ONE_SHOT:
            if self._one_shot_copy is not None:  # copy-in, barrier, sum: one kernel; flat is read before written
                self._one_shot_copy(staged, flat, "sum", self.group_name, out=flat)
            else:
                staged.copy_(flat)
                torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out=flat)
        elif path == TWO_SHOT:
            staged.copy_(flat)
            if self._two_shot_out is not None:
                self._two_shot_out(staged, "sum", self.group_name, output=flat)
            else:
                torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
                flat.copy_(staged)
        else:
            raise ValueError(f"unknown all-reduce path {path!r}")
        return t

    def enable_fused_norm(self, dtype: torch.dtype, env: dict[str, str] | None = None) -> bool:
        """Set up the fused all-reduce + add + RMSNorm for `dtype` (the model's): a collective, called
        by every rank once, before any CUDA-graph capture. Returns whether it is on (the same on
        every rank); any failure leaves it off with one log line, and `fused_rms_norm` then
        declines every call."""
        from kernels.all_reduce_norm import PeerBuffers, all_reduce_rms_norm, reset_buffer

        self._fused_kernel = all_reduce_rms_norm  # the launcher, imported once (kernels load lazily)
        env = os.environ if env is None else env
        text = env.get(FUSED_NORM_ENV, "").strip()
        if text and not text.isdigit():
            raise ValueError(f"{FUSED_NORM_ENV} must be a non-negative integer (KiB), got {text!r}")
        slot = (int(text) << 10) if text else _FUSED_NORM_MAX
        slot = -(-slot // _ALIGN) * _ALIGN
        if slot == 0 or dtype not in _DTYPES + (torch.float16,):
            logger.info("fused all-reduce + RMSNorm off (%s)", f"{FUSED_NORM_ENV}=0" if slot == 0 else dtype)
            return False
        if dtype in self._fused:
            return True
        error = ""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buffer = symm_mem.empty(PeerBuffers.nbytes(self.world_size, slot), dtype=torch.uint8, device=self.device)
            handle = symm_mem.rendezvous(buffer, self.group_name)
            ptrs = [int(p) for p in handle.buffer_ptrs]
            peers = PeerBuffers(torch.tensor(ptrs, dtype=torch.int64, device=self.device),
                                torch.zeros(3, dtype=torch.int32, device=self.device),
                                dist.get_rank(self.group), self.world_size, slot, dtype,
                                # every program must be resident at once: one per SM at the least
                                min(128, torch.cuda.get_device_properties(self.device).multi_processor_count))
            reset_buffer(buffer, dtype)
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)  # every buffer holds the sentinel before anyone sends
            self._fused[dtype] = (buffer, handle, peers)
            self._fused_self_test(dtype)
        except Exception as exc:  # noqa: BLE001 - any failure means: the unfused path, on every rank
            error = f"{type(exc).__name__}: {exc}"
            self._fused.pop(dtype, None)
        ok = torch.tensor([0 if error else 1], dtype=torch.int32, device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if not int(ok.item()):
            logger.warning("fused all-reduce + RMSNorm off: setting it up failed (%s)", error or "on another rank")
            self._fused.pop(dtype, None)
            return False
        logger.info("fused all-reduce + RMSNorm on: messages up to %d KiB (%s); row-parallel GEMVs push their rows: %s",
                    slot >> 10, dtype, "on" if self.push_partials else f"off ({PUSH_ENV})")
        return True

    def _fused_self_test(self, dtype: torch.dtype) -> None:
        """Known sums through both phases and back (small integers: exact in every dtype)."""
        rank = dist.get_rank(self.group)
        expect = float(self.world_size * (self.world_size + 1) // 2 + 1)
        weight = torch.ones(64, dtype=dtype, device=self.device)
        for rows in (1, 3, 2):
            x = torch.full((rows, 64), float(rank + 1), dtype=dtype, device=self.device)
            normed, res = self.fused_rms_norm(x, weight, 1e-6, torch.ones_like(x), False)
            torch.cuda.synchronize(self.device)
            if not bool((res == expect).all()) or not bool(((normed.float() - 1).abs() < 1e-2).all()):
                raise RuntimeError(f"fused self-test: residual {res[0, 0].item()} (expected {expect}), "
                                   f"normed {normed[0, 0].item()} (expected 1)")

    def fused_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                       unit_offset: bool, prefetch: object = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(normed, new residual) of the group's sum of `x` (+ `residual`) in one launch, or None
        where the fused kernel does not take `x` (off, too large, another dtype, not row-contiguous):
        the same answer on every rank, which then all-reduce and norm separately. `prefetch`: an
        L2 hint for the next weight (`kernels.l2_hint`), warmed while the ranks exchange."""
        pushed = self._pushed is not None
        if pushed:  # the GEMV that made x sent its rows already: this call must be the one they were for
            assert self._pushed == (x.data_ptr(), tuple(x.shape), x.dtype), (self._pushed, x.data_ptr(), x.shape)
            self._pushed = None
        if not self.fused_takes(x):
            assert not pushed, "a pushed partial must be summed by the fused kernel"
            return None
        return self._fused_kernel(x, weight, eps, residual, unit_offset, self._fused[x.dtype][2], prefetch,
                                  pushed=pushed)

    def fused_takes(self, x: torch.Tensor) -> bool:
        """Whether `fused_rms_norm` runs the fused kernel for `x` (the same on every rank)."""
        entry = self._fused.get(x.dtype)
        return entry is not None and x.dim() == 2 and x.stride(1) == 1 and entry[2].fits(x)

    def push_target(self, rows: int, hidden: int, dtype: torch.dtype) -> object | None:
        """The fused kernel's `PeerBuffers` when a row-parallel GEMV may push its [rows, hidden] output
        straight into them (`kernels.all_reduce_norm.push_partial`), for `fused_rms_norm` to sum
        next; None where that call would not run the fused kernel, or pushing is off."""
        entry = self._fused.get(dtype)
        if entry is None or not self.push_partials or self._pushed is not None:
            return None
        peers = entry[2]
        return peers if rows > 0 and peers.fits(torch.empty((rows, hidden), dtype=dtype, device="meta")) else None

    def pushed_pending(self) -> tuple[int, tuple[int, ...], torch.dtype] | None:
        """The pushed partial not yet summed (pointer, shape, dtype), or None."""
        return self._pushed

    def note_pushed(self, x: torch.Tensor) -> None:
        """`x`'s rows were pushed by the GEMV that made it: the next `fused_rms_norm` must be of `x`."""
        assert self._pushed is None, "a pushed partial was never summed"
        self._pushed = (x.data_ptr(), tuple(x.shape), x.dtype)

    def close(self) -> None:
        """Drop the buffers and their handles (the caching pool frees the memory with the group)."""
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._handle = None
        self._fused = {}


def _peer_refusal(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Whether every rank is on this host with peer access to every other rank's GPU (a collective)."""
    me = (socket.gethostname(), device.index if device.index is not None else torch.cuda.current_device(),
          torch.cuda.device_count())
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, me, group=group)
    reasons = []
    if len({host for host, _, _ in everyone}) > 1:
        reasons.append("ranks on several hosts")
    elif len({idx for _, idx, _ in everyone}) == len(everyone) and all(idx < me[2] for _, idx, _ in everyone):
        for _, idx, _ in everyone:  # rank-local device indices of one host (one process per GPU)
            if idx != me[1] and not torch.cuda.can_device_access_peer(me[1], idx):
                reasons.append(f"no peer access from cuda:{me[1]} to cuda:{idx}")
    # ranks that see different devices (per-rank CUDA_VISIBLE_DEVICES) are left to the rendezvous
    verdicts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, "; ".join(reasons), group=group)
    return next((v for v in verdicts if v), None)
