"""LLMEngine: one step of the rolling batch at a time (single-threaded; EngineLoop drives it).

Wires the Executor (its workers own weights, KV cache, forward, sampling; it gets one
by-value `StepPlan` per step), the Scheduler (what runs) and one IncrementalDetokenizer per
sample (text, stop strings). In: `add_request` (prompt text or
ids + SamplingParams), `abort_request`. Out: `step() -> list[StreamDelta]`, one delta per
sample that got a token or finished, in LMI's finish-reason vocabulary.

With async scheduling (default on CUDA) a step launches step N on the device and only then
reads step N-1's tokens, detokenizes them and applies stops, so that host work overlaps the
GPU; a sample that stops at step N-1 has computed one extra token, which is dropped. A step
whose samples read their own history (repetition/frequency/presence penalties) first waits
for the previous one. Guided-decoding rows (`serving/engine/structured_output.py`) need the token in flight
for their next-token masks: on a single in-process device the step is launched without them and
the engine fills them after reading the previous step's tokens, while the forward runs
(`Executor.sample_deferred`); on executors without that (worker processes), such a step waits
for the previous one, as penalties do.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref

from serving.engine.block_manager import BlockManager
from serving.engine.draft_proposer import DraftModelProposer, build_draft_proposer
from serving.engine.structured_output import GuidedDecoder
from serving.engine.lora_slots import LoRARegistry
from serving.engine.request_state import RequestState
from serving.engine.scheduler import Scheduler
from serving.engine.plan_builder import build_plan
from serving.engine.scheduler_output import SchedulerOutput
from serving.engine.sequence import FinishReason, Sequence, SequenceStatus
from serving.engine.speculator import Speculator
from serving.engine.token_intervals import TokenIntervals
from serving.engine.warmup import warm_up
from serving.engine_config import EngineConfig
from serving.executor.executor import Executor, InProcessExecutor, WorkerFailedError
from serving.executor.factory import make_executor, visible_device_count
from serving.executor.plan import StepOutput, StepPlan
from serving.lora_request import LoRARequest, UnknownAdapterError
from serving.checkpoint.model_files import resolve_model_dir
from serving.outputs import StreamDelta
from serving.sampling_params import SamplingParams
from serving.speculative_config import SpeculativeConfig
from serving.engine.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger("serving.engine.llm_engine")


class LLMEngine:
    """Adds requests, runs steps, hands back per-sample deltas. Not thread-safe by design.

    Args:
        config: the engine options.
        executor: a ready executor (tests inject one); built from `config` when None, on
            `devices` (default: the first `tensor_parallel_size` GPUs, or the CPU), in worker
            processes when `multiprocess` (model replicas) or tensor_parallel_size > 1.
        tokenizer: an HF tokenizer to use instead of loading the model's.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | None = None,
        tokenizer: object = None,
        devices: tuple[str, ...] | None = None,
        multiprocess: bool | None = None,
    ) -> None:
        spec = config.speculative_config
        draft: DraftModelProposer | None = None
        if executor is None:
            model_dir = resolve_model_dir(config.model, config.revision)
            if isinstance(spec, SpeculativeConfig) and spec.method == "draft_model":
                # On rank 0's device, before the target: the target's KV cache is sized around it.
                devices = devices or config.rank_devices(visible_device_count(config))
                draft = build_draft_proposer(config, model_dir, devices[0])
            executor = make_executor(config, str(model_dir), devices, multiprocess)
        self.config = config
        self.executor = executor
        info = executor.info
        if isinstance(spec, SpeculativeConfig) and spec.method == "draft_model" and draft is None:
            draft = build_draft_proposer(config, info.model_dir, info.devices[0])
        # Worker processes and device memory go with the engine (offline users `del llm`).
        self._finalizer = weakref.finalize(self, _shut_down, executor, draft)
        if draft is not None and draft.max_model_len < info.cache.max_model_len:
            self._finalizer()
            raise ValueError(f"the draft model holds {draft.max_model_len} tokens, the model {info.cache.max_model_len}: "
                             "set max_model_len (option.max_model_len) to at most the draft's")
        self.info = info
        cache = info.cache
        self.cache_config = cache
        self.max_model_len = cache.max_model_len
        self.tokenizer = tokenizer
        if tokenizer is None and not config.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(config.tokenizer or info.model_dir, config.revision, config.trust_remote_code)
        self.eos_token_ids = list(info.eos_token_ids)
        self.vocab_size = info.vocab_size
        num_blocks = cache.num_blocks
        if config.num_gpu_blocks_override is not None:
            # A runner shared between engines (tests) may hold more blocks than this one uses.
            num_blocks = min(num_blocks, config.num_gpu_blocks_override)
        self.block_manager = BlockManager(num_blocks, cache.block_size, config.enable_prefix_caching)
        self.max_num_batched_tokens = config.token_budget(self.max_model_len)
        self.speculator = Speculator(spec, draft) if isinstance(spec, SpeculativeConfig) else None
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=cache.max_model_len,
            eos_token_ids=self.eos_token_ids,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_loras=config.max_loras if config.enable_lora else None,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_prefill_tokens_while_decoding=config.max_prefill_tokens_while_decoding,
            makespan_target=config.makespan_target(info.device_type),
            step_sizes=info.step_sizes,
            speculator=self.speculator,
        )
        # LoRA adapters: registered by name (any thread), assigned to device slots per step.
        self.lora = LoRARegistry(info.model_dir, config.max_loras, config.max_lora_rank) if config.enable_lora else None
        self._requests: dict[str, RequestState] = {}
        # Guided decoding: built on the first constrained request (loads the tokenizer's vocabulary).
        self._guided: GuidedDecoder | None = None
        self._guided_lock = threading.Lock()
        self._deferred_mask_ids: list[int] | None = None  # the launched step's guided rows, masks to come
        self.num_deferred_mask_steps = 0
        # The launched step whose tokens are not read yet (async scheduling), and whether
        # the next step must wait for them (its samples need their own history).
        self._inflight: tuple[SchedulerOutput, StepOutput] | None = None
        self._inflight_blocks_next = False
        # Requests whose samples may make the next step wait (penalties, guided decoding): when
        # there are none, a step need not look at each scheduled sample to know it.
        self._history_requests: set[str] = set()
        # Requests with work on every token in `_process` (deltas per step, detokenizing,
        # logprobs, grammars); when there are none (offline generate) only samples that end need any.
        self._per_token_requests: set[str] = set()
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else info.device_type == "cuda"
        )
        # Sent with the next plan: sequences the workers can forget entirely / until re-admitted.
        self._finished_ids: list[int] = []
        self._preempted_ids: list[int] = []
        self._seq_ids = itertools.count()
        # Requests whose work is in the step being run (for `recover`), and recent failures.
        self._involved: list[SchedulerOutput] = []
        self._failures: list[float] = []
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        self.token_intervals = TokenIntervals()  # step-to-step output cadence (/metrics)
        logger.info(
            "engine ready: %d KV blocks of %d tokens (%d tokens), max_model_len=%d, max_num_seqs=%d, "
            "max_num_batched_tokens=%d, max_prefill_tokens_while_decoding=%d, long_prefill_token_threshold=%d, "
            "makespan_step_tokens=%d, async_scheduling=%s, devices=%s",
            num_blocks, cache.block_size, num_blocks * cache.block_size, cache.max_model_len,
            config.max_num_seqs, self.max_num_batched_tokens, config.max_prefill_tokens_while_decoding,
            config.long_prefill_token_threshold, self.scheduler.makespan_target,
            self.async_scheduling, ",".join(info.devices),
        )
        if info.device_type == "cuda":
            # Compile, load and size everything serving will touch before anyone calls this ready.
            warm_up(self)
            self.token_intervals = TokenIntervals()  # users' cadence only, not the warm-up's

    # ---- requests ------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        """Prompt text -> ids (special tokens such as BOS added as the tokenizer does)."""
        if self.tokenizer is None:
            raise ValueError("a text prompt needs the tokenizer (skip_tokenizer_init=True): pass prompt_token_ids")
        return list(self.tokenizer.encode(prompt))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request that can never run (thread-safe: reads config only)."""
        if self.vocab_size and any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size] if self.vocab_size else []
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size}) (the vocabulary), got {bad[:8]}")
        bad = [t for t, _ in params.logit_bias or () if not t < self.vocab_size] if self.vocab_size else []
        if bad:
            raise ValueError(f"logit_bias: token ids must be in [0, {self.vocab_size}) (the vocabulary), got {bad[:8]}")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs must be <= max_logprobs={self.config.max_logprobs}, got {params.logprobs}")
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need the tokenizer (skip_tokenizer_init=True)")
        self.scheduler.check_fits(len(prompt_token_ids), params.max_tokens)
        if params.guided_decoding is not None:  # last: the one check that may cost seconds (cached)
            self.guided_decoder().compile(params.guided_decoding)  # ValueError when invalid

    def guided_decoder(self) -> GuidedDecoder:
        """The grammar compiler and matchers (thread-safe to build; `compile` may run off the loop)."""
        if self._guided is None:
            if self.tokenizer is None:
                raise ValueError("guided decoding needs the tokenizer (skip_tokenizer_init=True)")
            with self._guided_lock:
                if self._guided is None:
                    c = self.config
                    self._guided = GuidedDecoder(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                 compile_timeout=c.guided_decoding_compile_timeout,
                                                 max_bytes=c.guided_decoding_max_bytes,
                                                 cache_bytes=c.guided_decoding_cache_mb << 20)
        return self._guided

    # ---- LoRA adapters (thread-safe) ------------------------------------------------------

    def add_lora(self, request: LoRARequest) -> None:
        """Register a PEFT adapter (checked against the base model; ValueError saying why not)."""
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled: start the engine with enable_lora=True "
                             "(option.enable_lora=true)")
        self.lora.add(request)

    def remove_lora(self, name: str) -> bool:
        """Unregister an adapter: new requests on it are refused, running ones finish on it."""
        return self.lora.remove(name) if self.lora is not None else False

    def list_loras(self) -> list[str]:
        return self.lora.names() if self.lora is not None else []

    def resolve_lora(self, lora_name: str | None) -> LoRARequest | None:
        """The registered adapter `lora_name` (None: the base model); UnknownAdapterError if unknown."""
        if lora_name is None:
            return None
        if self.lora is None:
            raise UnknownAdapterError(lora_name, (), "LoRA adapters are not enabled: option.enable_lora=true")
        return self.lora.resolve(lora_name)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        final_only: bool = False,
        lora_name: str | None = None,
        lora_request: LoRARequest | None = None,
        validated: bool = False,
    ) -> list[Sequence]:
        """Queue a request: `n` samples sharing the prompt. Raises ValueError if it cannot run.

        `final_only`: no per-step deltas; each sample's one delta, when it ends, carries all its
        tokens, text and logprobs (what offline `generate` needs, at a fraction of the cost).
        `lora_name`: run on that registered adapter (UnknownAdapterError if none is); or
        `lora_request`: an adapter already resolved (it may have been removed since: it still runs).
        `validated`: `prompt_token_ids` and `params` passed `validate` at admission already (EngineLoop
        admits on the caller's thread), so they are not checked again; the scheduler asserts the limits.
        """
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is None:
            lora_request = self.resolve_lora(lora_name)
        elif self.lora is None:
            raise ValueError("LoRA adapters are not enabled (enable_lora=True / option.enable_lora=true)")
        text: str | None = None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                text, prompt_token_ids = prompt, self.encode(prompt)
            elif prompt is not None:
                prompt_token_ids = list(prompt)
            else:
                raise ValueError("give a prompt or prompt_token_ids")
        else:
            text = prompt if isinstance(prompt, str) else None
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        if not validated:
            self.validate(prompt_token_ids, params)
        seqs = [
            Sequence(next(self._seq_ids), request_id, prompt_token_ids, params, index=i, lora_request=lora_request)
            for i in range(params.n)
        ]
        if params.guided_decoding is not None:
            guided = self.guided_decoder()
            for seq in seqs:
                guided.add(seq.seq_id, params.guided_decoding)
        self.scheduler.add_sequences(seqs)
        if params.needs_token_history or params.guided_decoding is not None:
            self._history_requests.add(request_id)
        detok = self.tokenizer is not None and params.detokenize
        if (not final_only or detok or params.logprobs is not None or params.prompt_logprobs is not None
                or params.guided_decoding is not None):
            self._per_token_requests.add(request_id)
        self._requests[request_id] = RequestState(
            request_id, text, prompt_token_ids, params, seqs,
            [IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) if detok else None for _ in seqs],
            [False] * len(seqs),
            final_only=final_only,
            logprobs=[[] for _ in seqs] if final_only else [],
            top_logprobs=[[] for _ in seqs] if final_only else [],
        )
        return seqs

    def abort_request(self, request_id: str) -> list[StreamDelta]:
        """Stop a request now, freeing its KV blocks; returns the final 'abort' deltas."""
        req = self._requests.get(request_id)
        if req is None:
            return []
        ended = self.scheduler.abort_request(request_id)
        deltas = [req.delta(seq, None) for seq in ended]
        for seq in ended:
            self._release(seq)
        self._drop(request_id)
        return deltas

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[StreamDelta]:
        """Schedule and launch one step; deltas for samples whose tokens came back."""
        deltas: list[StreamDelta] = []
        had_inflight = self._inflight is not None
        # The steps whose requests a failure would involve (`recover` reads their request ids).
        self._involved = [self._inflight[0]] if had_inflight else []
        # The launched step's tokens are read first (no overlap) when its samples need their own
        # history, or when this step is likely to carry a prompt chunk: launching a prompt step
        # can block for much of its length (bench/RESULTS.md: decode intervals of 20-50 ms
        # whenever one was launched before the previous step's tokens were read), and every
        # stream would wait for it on top of the step it is owed. That order is for streams
        # (a server: `max_prefill_tokens_while_decoding` set); offline (0) nobody waits per
        # token, and overlapping the prompt step's host work with the GPU is worth more
        # (5-11 ms of idle GPU before each 16k-token prefill step of the 1B workload).
        # Speculation needs a sequence's last token on the host to propose from (and a verify
        # step's token count is only known once read, `_inflight_blocks_next`): the step waits
        # only when a running decode is likely to propose (`Speculator.wants_tokens_in_flight`);
        # otherwise it runs as plain decoding does, overlapped, and nobody proposes in it.
        if had_inflight and (self._inflight_blocks_next or self._wants_drafts() or (
                self.scheduler.prefill_cap_while_decoding and self.scheduler.prompt_work_ahead())):
            deltas = self._process(*self._take_inflight())
        sched_out = self.scheduler.schedule()
        self._involved.append(sched_out)
        if sched_out.is_empty:
            if self._inflight is not None:
                return deltas + self._process(*self._take_inflight())
            if not had_inflight and self.scheduler.has_unfinished():
                # Admission guarantees a lone sequence fits, so this is a bug: fail loudly
                # (the loop marks the engine dead) rather than spin forever.
                raise RuntimeError(
                    f"scheduler made no progress: {len(self.scheduler.waiting)} waiting, "
                    f"{len(self.scheduler.running)} running, {self.block_manager.num_free_blocks} free blocks"
                )
            return deltas
        runner_out = self.executor.execute(self._plan(sched_out))
        self.num_steps += 1
        self.num_prompt_tokens_computed += sched_out.num_prompt_tokens
        if not self.async_scheduling:
            return deltas + self._process(sched_out, runner_out)
        last = self._take_inflight() if self._inflight is not None else None
        self._inflight = (sched_out, runner_out)
        defer = self.executor.supports_deferred_masks
        self._inflight_blocks_next = sched_out.speculates or bool(self._history_requests) and any(
            item.sample and (item.seq.params.needs_token_history
                             or (not defer and item.seq.params.guided_decoding is not None))
            for item in sched_out.scheduled
        )
        try:
            if last is not None:
                deltas += self._process(*last)
        finally:
            if self._deferred_mask_ids is not None:
                # The previous step's tokens are read and the matchers advanced: this step's masks.
                ids, self._deferred_mask_ids = self._deferred_mask_ids, None
                self.executor.sample_deferred(self._guided.fill(ids))  # type: ignore[union-attr]
        return deltas

    def recover(self, exc: BaseException) -> list[StreamDelta]:
        """After `step()` raised: keep serving, failing only the request that caused it.

        Every running sequence is requeued (its KV is recomputed). When the failed step held
        one request, or one suspect, that request ends with an error record; otherwise every
        request of the step becomes a suspect, and suspects run one at a time until the next
        failure names the culprit. Re-raises when the device itself failed or failures keep
        coming (>= 8 within 60 s): then the engine is dead.
        """
        now = time.monotonic()
        self._failures = [t for t in self._failures if now - t < 60.0] + [now]
        if isinstance(exc, WorkerFailedError) or _device_failed(exc) or len(self._failures) >= 8:
            raise exc
        involved = {item.seq.request_id for out in self._involved for item in out.scheduled} & self._requests.keys()
        self._inflight = None
        self._deferred_mask_ids = None
        self.scheduler.requeue_all()
        self.executor.reset()
        for req in self._requests.values():
            for seq in req.seqs:
                seq.in_worker = False
        self._preempted_ids.clear()
        self._finished_ids.clear()
        suspects = self.scheduler.suspects
        suspects.intersection_update(self._requests)
        culprits = involved if len(involved) == 1 else (involved & suspects if len(involved & suspects) == 1 else set())
        logger.error("a step failed with %s: %s; %s", type(exc).__name__, exc,
                     f"failing request {sorted(culprits)}" if culprits else
                     f"{len(involved)} requests are suspects; they run one at a time")
        if not culprits:
            suspects.update(involved)
            return []
        (request_id,) = culprits
        suspects.discard(request_id)
        return self.fail_request(request_id, f"this request failed inside the engine: {type(exc).__name__}: {exc}")

    def fail_request(self, request_id: str, message: str) -> list[StreamDelta]:
        """End a request now with finish_reason 'error' and `message` (frees its KV blocks)."""
        req = self._requests.get(request_id)
        if req is None:
            return []
        self._drop(request_id)
        ended = self.scheduler.abort_request(request_id)
        deltas = []
        for seq in ended:
            seq.finish_reason = FinishReason.ERROR
            delta = req.delta(seq, None)
            delta.error = message
            deltas.append(delta)
            self._release(seq)
        return deltas

    def _wants_drafts(self) -> bool:
        return self.speculator is not None and self.speculator.wants_tokens_in_flight(self.scheduler.running)

    def _take_inflight(self) -> tuple[SchedulerOutput, StepOutput]:
        assert self._inflight is not None
        last, self._inflight = self._inflight, None
        return last

    def _process(self, sched_out: SchedulerOutput, runner_out: StepOutput) -> list[StreamDelta]:
        """Read one step's tokens (waits for the device), detokenize, apply stops; its deltas."""
        results = self.scheduler.update(sched_out, runner_out)
        deltas: list[StreamDelta] = []
        done: list[str] = []
        suspects = self.scheduler.suspects
        requests = self._requests
        guided = self._guided
        self.num_generated_tokens += len(results)
        if not suspects and not self._per_token_requests:
            finished = SequenceStatus.FINISHED
            for seq, sampled in results:  # nothing to do per token: only the samples that ended
                if seq.status is finished and not sampled.more:
                    req = requests[seq.request_id]
                    deltas.append(req.delta(seq, sampled))
                    self._release(seq)
                    if all(s.is_finished for s in req.seqs):
                        done.append(req.request_id)
            results = []
        cut: set[int] = set()  # samples a stop string ended before the last of their tokens this step
        for seq, sampled in results:
            if seq.seq_id in cut:
                continue
            req = requests[seq.request_id]
            if suspects:
                suspects.discard(seq.request_id)  # it got through a step: cleared
            if guided is not None and not seq.is_finished and seq.seq_id in guided:
                state = guided.accept(seq.seq_id, sampled.token_id)
                if state is not None:  # the constraint is complete (or, never expected, broken)
                    if state == "invalid":
                        logger.warning("seq %d: token %d is outside its grammar", seq.seq_id, sampled.token_id)
                    self.scheduler.finish(seq, FinishReason.STOP)
            det = req.detokenizers[seq.index]
            if det is not None:
                stop = det.append([sampled.token_id])
                if stop is not None and sampled.more:  # (speculation) the tokens after this one go
                    self._cut(seq, sampled.more, stop)
                    cut.add(seq.seq_id)
                    sampled.more = 0
                elif stop is not None:
                    if seq.is_finished:  # it also hit EOS / length this step: the stop string wins
                        seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
                    else:
                        self.scheduler.finish(seq, FinishReason.STOP, stop)
            if req.final_only:
                req.keep(seq.index, sampled)
                if not seq.is_finished or sampled.more:
                    continue
            deltas.append(req.delta(seq, sampled))
            if seq.is_finished and not sampled.more:
                self._release(seq)
                if all(s.is_finished for s in req.seqs):
                    done.append(req.request_id)
        for request_id in done:  # after the loop: samples of one request may finish together
            self._drop(request_id)
        self.token_intervals.output(time.monotonic(), sched_out.num_prompt_tokens > 0)
        if not requests:
            self.token_intervals.idle()
        return deltas

    def _cut(self, seq: Sequence, num_after: int, stop: str) -> None:
        """A stop string ended `seq` at a token that has `num_after` more from the same verify step:
        they are dropped, and it ends with that stop string whatever those tokens said."""
        del seq.token_ids[len(seq.token_ids) - num_after:]
        if seq.is_finished:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
        else:
            self.scheduler.finish(seq, FinishReason.STOP, stop)

    def _drop(self, request_id: str) -> None:
        """The request is over (every sample ended, or aborted/failed): forget it."""
        self._requests.pop(request_id, None)
        self._history_requests.discard(request_id)
        self._per_token_requests.discard(request_id)

    def _release(self, seq: Sequence) -> None:
        """The workers drop the sequence's state (mirror, seeded generator) with the next plan."""
        seq.in_worker = False
        self._finished_ids.append(seq.seq_id)
        if self.speculator is not None:
            self.speculator.forget(seq.seq_id)
        if self._guided is not None:
            self._guided.remove(seq.seq_id)

    def _plan(self, sched_out: SchedulerOutput) -> StepPlan:
        for seq in sched_out.preempted:
            if seq.in_worker:
                seq.in_worker = False
                self._preempted_ids.append(seq.seq_id)
        # With async scheduling the placeholders of this step's samples go in as the plan is built.
        plan = build_plan(self.num_steps, sched_out, self._finished_ids, self._preempted_ids,
                          placeholders=self.async_scheduling)
        self._finished_ids, self._preempted_ids = [], []
        if plan.num_drafts:
            self._attach_draft_probs(plan, sched_out)
        if self.lora is not None:
            plan.lora_slots, plan.lora_loads = self.lora.assign(sched_out)
        guided = self._guided
        if guided is not None and len(guided):
            chunks = [i for i, item in enumerate(sched_out.scheduled) if item.sample and item.seq.seq_id in guided]
            if chunks:
                plan.mask_chunks = chunks
                ids = [sched_out.scheduled[i].seq.seq_id for i in chunks]
                if self._inflight is not None and self.executor.supports_deferred_masks:
                    self._deferred_mask_ids = ids  # filled once the token in flight is read (`step`)
                    self.num_deferred_mask_steps += 1
                else:
                    plan.masks = guided.fill(ids)
        return plan

    def _attach_draft_probs(self, plan: StepPlan, sched_out: SchedulerOutput) -> None:
        """The draft model's distributions of this step's sampled drafts, for rejection sampling
        (on the host when the plan crosses to worker processes)."""
        local = isinstance(self.executor, InProcessExecutor)
        for i in plan.num_drafts:
            q = self.speculator.draft_probs(sched_out.scheduled[i].seq.seq_id)  # type: ignore[union-attr]
            if q is not None:
                q = q[: plan.num_drafts[i]]  # (the scheduler may have kept fewer than were proposed)
                plan.draft_probs[i] = q if local else q.cpu()  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        """Stop the executor's workers and free the devices (idempotent). Open requests are
        aborted; a step after this raises WorkerFailedError ("the executor is shut down")."""
        self._finalizer()
        for request_id in list(self._requests):
            self.abort_request(request_id)
        self._inflight = None  # the last step's device tensors
        self._deferred_mask_ids = None
        if self._guided is not None:
            self._guided.close()  # its compile processes
        self._guided = None  # the grammar matchers and their native threads

    # ---- observability -------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters and gauges for /metrics and logs."""
        bm = self.block_manager
        used = bm.num_blocks - bm.num_free_blocks
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "num_unfinished_requests": len(self._requests),
            "num_kv_blocks": bm.num_blocks,
            "num_free_kv_blocks": bm.num_free_blocks,
            "kv_cache_usage": used / bm.num_blocks,
            "prefix_cache_queries": bm.num_prefix_queries,
            "prefix_cache_hits": bm.num_prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_prompt_tokens": self.num_prompt_tokens_computed,
            "num_generation_tokens": self.num_generated_tokens,
            **(self.speculator.metrics() if self.speculator is not None else {}),
        }


def _shut_down(executor: Executor, draft: DraftModelProposer | None) -> None:
    executor.shutdown()
    if draft is not None:
        draft.runner.close()


def _device_failed(exc: BaseException) -> bool:
    """Whether `exc` leaves the device unusable (a CUDA error poisons the whole context)."""
    import torch

    accel = getattr(torch, "AcceleratorError", None)
    text = str(exc)
    return (accel is not None and isinstance(exc, accel)) or "CUDA error" in text or "device-side assert" in text
