"""An engine gives back what it holds: `LLM.shutdown()`, `with LLM(...)`, `del llm`, EngineLoop /
ReplicaSet `close()`, and the worker processes of a 2-rank (gloo) engine.

What is checked: the engine's threads and worker processes are gone, the model's parameters are
freed (weak references to the module and to a parameter die), use after shutdown raises a clear
error, a second engine in the same process generates the same tokens, and a start that fails
(LLM or EngineLoop) stops what it had started while its error is still held. The cyclic collector
is off in these tests, so anything only a `gc.collect()` would free shows up as a failure.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator

import pytest
from processes import alive

from serving.engine.engine_loop import EngineLoop
from serving.engine.request_stream import EngineDeadError
from serving.engine.replicas import ReplicaSet
from serving.engine_config import EngineConfig
from serving.llm import LLM
from serving.sampling_params import SamplingParams

OPTIONS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=256, kv_cache_memory_gb=0.01, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


@pytest.fixture(autouse=True)
def no_collector() -> Iterator[None]:
    """Only reference counting frees objects during a test (what `del llm` relies on)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def model_dir(tiny_models) -> str:  # noqa: F811
    return str(tiny_models("llama"))


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                                                 use_tqdm=False)]


def _model_refs(engine) -> tuple[weakref.ref, weakref.ref]:  # noqa: ANN001 - LLMEngine on one device
    model = engine.executor.runner.model
    return weakref.ref(model), weakref.ref(next(model.parameters()))


def _wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_shutdown_frees_the_model_and_refuses_more_work(model_dir):
    threads_before = set(threading.enumerate())
    llm = LLM(model_dir, **OPTIONS)
    assert _tokens(llm)
    model, param = _model_refs(llm.llm_engine)
    engine = weakref.ref(llm.llm_engine)
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert model() is None and param() is None and engine() is None
    assert set(threading.enumerate()) <= threads_before
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(prompt_token_ids=PROMPTS, use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.get_tokenizer()


def test_dropping_the_last_reference_frees_the_engine(model_dir):
    llm = LLM(model_dir, **OPTIONS)
    assert _tokens(llm)
    model, param = _model_refs(llm.llm_engine)
    handle, engine = weakref.ref(llm), weakref.ref(llm.llm_engine)
    del llm
    assert handle() is None and engine() is None and model() is None and param() is None


def test_context_manager_shuts_down_and_a_second_llm_generates_the_same_tokens(model_dir):
    with LLM(model_dir, **OPTIONS) as llm:
        first = _tokens(llm)
        model, _ = _model_refs(llm.llm_engine)
    assert model() is None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(prompt_token_ids=PROMPTS, use_tqdm=False)
    with LLM(model_dir, **OPTIONS) as again:
        assert _tokens(again) == first


def test_an_engine_shut_down_under_a_request_ends_it_and_refuses_steps(model_dir):
    llm = LLM(model_dir, **OPTIONS)
    engine = llm.llm_engine
    engine.add_request("r", None, GREEDY, prompt_token_ids=PROMPTS[0])
    engine.step()
    llm.shutdown()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.add_request("late", None, GREEDY, prompt_token_ids=PROMPTS[0])
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()


@pytest.mark.slow
def test_tensor_parallel_shutdown_ends_the_rank_processes_and_the_watchdog(model_dir):
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    threads_before = set(threading.enumerate())
    llm = LLM(model_dir, tensor_parallel_size=2, **OPTIONS)
    executor = llm.llm_engine.executor
    pids = [p.pid for p in executor._procs]  # noqa: SLF001 - the test checks the process table
    assert len(pids) == 2 and all(alive(p) for p in pids)
    expected = _tokens(llm)
    del executor
    handle = weakref.ref(llm)
    del llm  # the last reference: the ranks leave their process group and exit
    assert handle() is None
    assert not _wait_gone(pids)
    assert set(threading.enumerate()) <= threads_before  # the executor's watchdog is joined
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not (shm_after - shm_before)
    with LLM(model_dir, tensor_parallel_size=2, **OPTIONS) as again:
        assert _tokens(again) == expected


def _loop(model_dir: str) -> EngineLoop:
    return EngineLoop(EngineConfig.from_options(model_dir, **OPTIONS))


def _generate(loop: EngineLoop) -> list[int]:
    stream = loop.add_request("a", PROMPTS[0], GREEDY)
    return [t for delta in stream for t in delta.token_ids]


def test_engine_loop_close_stops_the_thread_and_frees_the_model(model_dir):
    threads_before = set(threading.enumerate())
    loop = _loop(model_dir).start()
    assert loop.wait_ready(120)
    assert len(_generate(loop)) == GREEDY.max_tokens
    executor = loop.engine.executor
    model, param = _model_refs(loop.engine)
    loop.close()
    assert set(threading.enumerate()) <= threads_before
    assert executor.runner is None and model() is None and param() is None
    with pytest.raises(EngineDeadError):
        loop.add_request("b", PROMPTS[0], GREEDY)


def test_replica_set_close_stops_every_copy(model_dir):
    threads_before = set(threading.enumerate())
    replicas = ReplicaSet([_loop(model_dir), _loop(model_dir)]).start()
    assert replicas.wait_ready(120)
    executors = [loop.engine.executor for loop in replicas.loops]
    replicas.close()
    assert set(threading.enumerate()) <= threads_before
    assert all(executor.runner is None for executor in executors)


_FRESH_PROCESS = """
import gc, sys, weakref
gc.disable()
from serving.llm import LLM
from serving.sampling_params import SamplingParams
llm = LLM(sys.argv[1], **{options!r})
llm.generate(prompt_token_ids={prompts!r}, sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
model = weakref.ref(llm.llm_engine.executor.runner.model)
handle = weakref.ref(llm)
del llm
assert handle() is None and model() is None, "the first LLM of a process outlived its last reference"
print("freed")
"""


@pytest.mark.slow
def test_the_first_llm_of_a_process_is_freed_by_del_despite_first_use_imports(model_dir):
    # Imports made for the first time under the constructor leave frames in reference cycles
    # (torch.fx.wrap keeps its own frame); those frames hold the constructor's `self`.
    code = _FRESH_PROCESS.format(options=OPTIONS, prompts=PROMPTS)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    p = subprocess.run([sys.executable, "-c", code, model_dir], env=env, cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and "freed" in p.stdout, p.stderr[-3000:]


_FREEZE_PROCESS = """
import gc, sys
from serving.llm import LLM
assert gc.get_freeze_count() == 0
first = LLM(sys.argv[1], **{options!r})
frozen = gc.get_freeze_count()
assert frozen > 10000, frozen  # imports, model, engine: out of the collector's walks
second = LLM(sys.argv[1], **{options!r})
assert 10000 < gc.get_freeze_count() <= frozen  # the second LLM neither refreezes nor thaws
first.shutdown()
assert 10000 < gc.get_freeze_count() <= frozen  # the second still lives (the first's objects are freed)
del second
assert gc.get_freeze_count() == 0  # the last one gone: the collector walks everything again
gc.freeze()  # a process that froze its own heap keeps it as it is
mine = gc.get_freeze_count()
with LLM(sys.argv[1], **{options!r}):
    pass
assert 10000 < gc.get_freeze_count() <= mine
print("scoped")
"""


@pytest.mark.slow
def test_the_heap_is_frozen_only_while_an_llm_lives(model_dir):
    # A full collection walks every tracked object while the engine waits (idle GPU gaps of 4-5 ms
    # in the 1B reference workload): what the process built up to its first LLM is frozen while one lives.
    code = _FREEZE_PROCESS.format(options=OPTIONS)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", code, model_dir], env={**os.environ, "PYTHONPATH": root}, cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "scoped" in p.stdout, p.stderr[-3000:]


@pytest.mark.slow
def test_a_failed_start_stops_what_it_started_while_its_error_is_still_held(model_dir, tmp_path):
    # The tokenizer loads after the two rank processes have started and loaded the model.
    with pytest.raises(Exception) as failed:
        LLM(model_dir, tensor_parallel_size=2, tokenizer=str(tmp_path / "no-tokenizer"), **OPTIONS)
    assert failed.value.__traceback__ is not None
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_an_engine_loop_that_fails_to_load_keeps_its_error_but_not_the_engine(model_dir, tmp_path):
    config = EngineConfig.from_options(model_dir, tensor_parallel_size=2, tokenizer=str(tmp_path / "no-tokenizer"),
                                       **OPTIONS)
    loop = EngineLoop(config).start()
    with pytest.raises(EngineDeadError):
        loop.wait_ready(120)
    assert loop.error is not None and loop.error.__traceback__ is not None  # /ping reports it
    assert not multiprocessing.active_children()
    loop.close()
