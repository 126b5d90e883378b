"""Which all-reduce tensor parallelism takes (CPU): the size / dtype / alignment policy, the reasons
the custom (symmetric-memory) all-reduce is not set up, the switches that force the process
group's, and gloo ranks summing through `parallel.all_reduce` exactly as before.

The kernels themselves need two CUDA GPUs: tests/serving/executor/test_gpu_all_reduce.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from all_reduce_worker import all_reduce_worker

from serving.server.settings.serving_config import load_config
from serving.engine_config import EngineConfig
from serving.executor import parallel
from serving.executor.custom_all_reduce import (
    DISABLE_ENV,
    ONE_SHOT,
    ONE_SHOT_ENV,
    PUSH_ENV,
    TWO_SHOT,
    TWO_SHOT_ENV,
    AllReducePolicy,
    CustomAllReduce,
    default_policy,
    refusal,
)

CUDA = torch.device("cuda", 0)  # a device object only: refusal() reads its type, nothing runs on it


def test_policy_picks_by_size():
    p = AllReducePolicy(one_shot_max_bytes=256 << 10, two_shot_max_bytes=8 << 20)
    bf16 = torch.bfloat16
    assert p.path_for(16, bf16) == ONE_SHOT
    assert p.path_for(16 << 10, bf16) == ONE_SHOT  # one decode token of a 8192-wide model
    assert p.path_for(256 << 10, bf16) == ONE_SHOT
    assert p.path_for((256 << 10) + 16, bf16) == TWO_SHOT
    assert p.path_for(8 << 20, torch.float32) == TWO_SHOT
    assert p.path_for((8 << 20) + 16, bf16) is None  # large: the process group's (NCCL)


@pytest.mark.parametrize("nbytes, dtype, offset, contiguous", [
    (4096, torch.float16, 0, True),      # the kernels dispatch float32 and bfloat16 only
    (4096, torch.int64, 0, True),
    (4104, torch.bfloat16, 0, True),     # size not a multiple of 16 bytes
    (4096, torch.bfloat16, 8, True),     # storage offset not 16-byte aligned
    (4096, torch.bfloat16, 0, False),
    (0, torch.bfloat16, 0, True),
])
def test_policy_leaves_what_the_kernels_cannot_take_to_the_process_group(nbytes, dtype, offset, contiguous):
    assert AllReducePolicy(1 << 20, 8 << 20).path_for(nbytes, dtype, offset, contiguous) is None


def test_policy_reads_a_tensor_as_every_rank_sees_it():
    p = AllReducePolicy(1 << 10, 1 << 20)
    base = torch.zeros(4096, dtype=torch.bfloat16)
    assert p.path(base[:512]) == ONE_SHOT
    assert p.path(base[8:520]) == ONE_SHOT  # offset 16 bytes: aligned
    assert p.path(base[4:516]) is None  # offset 8 bytes
    assert p.path(base[:1024]) == TWO_SHOT
    assert p.path(base.view(64, 64).t()) is None  # not contiguous


def test_policy_thresholds_must_be_ordered():
    with pytest.raises(ValueError, match="one-shot"):
        AllReducePolicy(2 << 20, 1 << 20)


def test_default_policy_shrinks_one_shot_with_the_degree_and_takes_overrides():
    one = [default_policy(w, env={}).one_shot_max_bytes for w in (2, 4, 8)]
    assert one[0] > one[1] > one[2] > 0
    assert default_policy(3, env={}).one_shot_max_bytes == one[2]  # an untabled degree: the smallest
    p = default_policy(4, env={ONE_SHOT_ENV: "64", TWO_SHOT_ENV: "2048"})
    assert (p.one_shot_max_bytes, p.two_shot_max_bytes) == (64 << 10, 2 << 20)
    assert default_policy(4, env={ONE_SHOT_ENV: "0", TWO_SHOT_ENV: "0"}).path_for(16, torch.float32) is None
    with pytest.raises(ValueError, match=ONE_SHOT_ENV):
        default_policy(2, env={ONE_SHOT_ENV: "1M"})


def test_refusal_names_each_reason():
    assert refusal(True, "nccl", CUDA, 2, env={}) is None
    assert "engine config" in refusal(False, "nccl", CUDA, 2, env={})
    for value in ("1", "true", "ON"):
        assert DISABLE_ENV in refusal(True, "nccl", CUDA, 4, env={DISABLE_ENV: value})
    assert refusal(True, "nccl", CUDA, 4, env={DISABLE_ENV: "0"}) is None
    assert refusal(True, "nccl", CUDA, 1, env={}) == "one rank"
    assert "gloo" in refusal(True, "gloo", torch.device("cpu"), 2, env={})


def test_the_engine_option_and_the_lmi_key():
    assert EngineConfig().disable_custom_all_reduce is False
    assert EngineConfig.from_options(None, disable_custom_all_reduce=True).disable_custom_all_reduce is True
    with pytest.raises(ValueError, match="disable_custom_all_reduce"):
        EngineConfig(disable_custom_all_reduce="yes")
    assert load_config({"OPTION_DISABLE_CUSTOM_ALL_REDUCE": "true"}, []).engine.disable_custom_all_reduce is True
    assert load_config({}, []).engine.disable_custom_all_reduce is False


def test_one_process_takes_no_all_reduce():
    assert parallel.all_reduce_path(torch.ones(4)) == "none"


def test_gloo_ranks_sum_through_the_process_group(tmp_path):
    cases = [(16, "float32"), (4096, "float32"), (1000, "float32"), (4096, "bfloat16")]
    mp.spawn(all_reduce_worker, args=(2, str(tmp_path / "store"), "gloo", True, cases, str(tmp_path)), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["custom_on"] is False
        assert got["paths"] == ["gloo"] * len(cases)
        for mine, oracle in zip(got["got"], got["oracle"]):
            assert torch.equal(mine, oracle)


def _fused_only(monkeypatch, push: str | None) -> CustomAllReduce:  # noqa: ANN001
    # The fused kernel's bookkeeping without a process group: bf16 buffers of 16 KiB a slot, 4 programs at once;
    # the kernel replaced by a recorder of what it was asked.
    from kernels.all_reduce_norm import PeerBuffers

    if push is None:
        monkeypatch.delenv(PUSH_ENV, raising=False)
    else:
        monkeypatch.setenv(PUSH_ENV, push)
    made = CustomAllReduce.__new__(CustomAllReduce)
    made.world_size, made.policy = 2, default_policy(2)
    made._buffer = torch.empty(1024, dtype=torch.uint8)  # noqa: SLF001
    made.push_partials = CustomAllReduce.push_enabled()
    made._pushed = None  # noqa: SLF001
    peers = PeerBuffers(torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32), 0, 2, 16 << 10,
                        torch.bfloat16, 4)
    made._fused = {torch.bfloat16: (torch.empty(0), None, peers)}  # noqa: SLF001
    made.calls = []
    made._fused_kernel = lambda x, *args, pushed: made.calls.append((x, pushed)) or (x, x)  # noqa: SLF001
    return made


def test_a_pushed_partial_must_be_the_next_fused_call(monkeypatch):
    made = _fused_only(monkeypatch, None)  # pushing is on unless switched off
    peers = made._fused[torch.bfloat16][2]  # noqa: SLF001
    assert made.push_target(2, 4096, torch.bfloat16) is peers
    assert made.push_target(0, 4096, torch.bfloat16) is None
    assert made.push_target(3, 4096, torch.bfloat16) is None  # 24 KiB: over the slot
    assert made.push_target(5, 64, torch.bfloat16) is None  # more rows than programs at once
    assert made.push_target(1, 64, torch.float32) is None  # no fused buffers of that dtype
    out, other = torch.zeros(2, 4096, dtype=torch.bfloat16), torch.zeros(2, 4096, dtype=torch.bfloat16)
    made.note_pushed(out)
    assert made.pushed_pending() is not None
    assert made.push_target(2, 4096, torch.bfloat16) is None  # one pushed partial at a time
    with pytest.raises(AssertionError):
        made.run(torch.zeros(8), ONE_SHOT)  # only the fused kernel may sum it
    with pytest.raises(AssertionError):
        made.fused_rms_norm(other, torch.ones(4096, dtype=torch.bfloat16), 1e-6, None, False)
    made._pushed = None  # noqa: SLF001
    made.note_pushed(out)
    made.fused_rms_norm(out, torch.ones(4096, dtype=torch.bfloat16), 1e-6, None, False)
    made.fused_rms_norm(other, torch.ones(4096, dtype=torch.bfloat16), 1e-6, None, False)
    assert [(x is out, pushed) for x, pushed in made.calls] == [(True, True), (False, False)]
    assert made.pushed_pending() is None


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_pushing_is_switched_off_by_its_env(monkeypatch, value):
    assert _fused_only(monkeypatch, value).push_target(1, 4096, torch.bfloat16) is None
    assert _fused_only(monkeypatch, "1").push_target(1, 4096, torch.bfloat16) is not None
