"""The offline API as vLLM users write it: `LLM(model=..., **options).generate(prompts, params)` and
`.chat(conversations, params)`.

Builds an `EngineConfig` from vLLM option names, runs an `LLMEngine` to completion over all
prompts (they share the rolling batch), and returns vLLM-shaped `RequestOutput`s in input order,
with a tqdm "Processed prompts" bar that shows token throughput.

Lifetime: `shutdown()` (or leaving `with LLM(...) as llm:`, or dropping the last reference)
stops the engine and gives back what it holds: GPU memory (weights, KV cache, CUDA graphs and
their pool), worker processes and threads; a second `LLM` can then be built in the same process.
"""

from __future__ import annotations

import gc
import itertools
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Sequence as Seq

from serving.engine.llm_engine import LLMEngine
from serving.engine_config import EngineConfig
from serving.lora_request import LoRARequest
from serving.outputs import CompletionOutput, Logprob, RequestOutput, StreamDelta
from serving.sampling_params import SamplingParams

# LMI finish reasons (engine) -> vLLM/OpenAI names (offline API).
_VLLM_FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop", "abort": "abort", "error": "error"}

PromptInput = str | dict | list[int]


class LLM:
    """An engine for offline batched generation (vLLM's `LLM`).

    Args:
        model: HF model dir or hub id; None for the embedded default model.
        **options: vLLM option names (`dtype`, `max_model_len`, `max_num_seqs`,
            `max_num_batched_tokens`, `block_size`, `enable_prefix_caching`, `seed`,
            `skip_tokenizer_init`, `load_format`, `enable_lora`, `max_loras`, `max_lora_rank`,
            `max_cpu_loras`, ...); unknown names raise TypeError.
    """

    def __init__(self, model: str | None = None, **options: object) -> None:
        try:
            engine = LLMEngine(EngineConfig.from_options(model, **options))
        except BaseException as exc:
            # The traceback's frames hold a half-built engine (the model on the GPU, the worker
            # processes) for as long as the exception is kept, and a notebook keeps the last one:
            # their locals go now, so that a retry with other options finds the memory free.
            traceback.clear_frames(exc.__traceback__)
            raise
        self._attach(engine, freeze_heap=True)
        _collect_cycles_holding_this_call()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (tests share one ModelRunner between engines); the LLM owns it
        from now on: its shutdown, or its collection, shuts the engine down."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: LLMEngine, freeze_heap: bool = False) -> None:
        self._engine: LLMEngine | None = engine
        self._request_ids = itertools.count()
        if freeze_heap:
            _heap_freeze.acquire()
        # The engine goes with the last reference to this object (`del llm`): the callback holds
        # the engine, never `self`, so it does not keep this object alive.
        self._finalizer = weakref.finalize(self, _close, engine, freeze_heap)

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's attribute); RuntimeError once this LLM is shut down."""
        if self._engine is None:
            raise RuntimeError("this LLM is shut down: build a new LLM to generate")
        return self._engine

    def shutdown(self) -> None:
        """Stop the engine and give back its GPU memory, worker processes and threads (idempotent).

        Afterwards `torch.cuda.memory_allocated()` is back where it was before this LLM was built,
        and the freed blocks are handed back to the device (`torch.cuda.empty_cache()`), so an
        engine built next with worker processes can use them; every other call raises.
        """
        self._finalizer()
        self._engine = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block (vLLM's `LLM.reset_prefix_cache`): later prompts are
        computed again. Blocks still held by running sequences are left alone; False when the
        engine has requests in flight (nothing is reset then), True otherwise."""
        engine = self.llm_engine
        if engine.has_unfinished_requests():
            return False
        engine.block_manager.reset_prefix_cache()
        return True

    def get_tokenizer(self):  # noqa: ANN201 - HF tokenizer
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput] | None = None,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results in input order.

        `prompts` may be a string, a list of strings, or `{"prompt_token_ids": [...]}` /
        `{"prompt": "..."}` dicts; `prompt_token_ids` (a list of id lists) is the older form.
        `lora_request`: one adapter for every prompt, or one (or None: the base model) per prompt;
        an adapter not registered yet is registered on first use, as vLLM does.
        """
        inputs = _normalize_inputs(prompts, prompt_token_ids)
        loras = self._lora_requests(lora_request, len(inputs))
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params_list = [sampling_params or SamplingParams()] * len(inputs)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(inputs):
                raise ValueError(f"got {len(params_list)} sampling params for {len(inputs)} prompts")
        engine = self.llm_engine
        order: list[str] = []
        results: dict[str, RequestOutput] = {}
        wanted: dict[str, SamplingParams] = {}
        try:
            for (text, ids), params, lora in zip(inputs, params_list, loras):
                rid = str(next(self._request_ids))
                run_params = params
                if params.best_of is not None and params.best_of > params.n:
                    # Sample best_of, keep the n with the highest cumulative logprob.
                    run_params = params.replace(n=params.best_of, logprobs=params.logprobs or 0)
                seqs = engine.add_request(rid, text, run_params, prompt_token_ids=ids, final_only=True,
                                          lora_request=lora)
                order.append(rid)
                wanted[rid] = params
                results[rid] = RequestOutput(
                    request_id=rid, prompt=text, prompt_token_ids=list(seqs[0].prompt_token_ids),
                    outputs=[CompletionOutput(i, "", [], None, None) for i in range(run_params.n)], finished=False,
                )
            self._run(results, use_tqdm)
        finally:
            for rid in order:  # on error/KeyboardInterrupt, free what is still running
                if not results[rid].finished:
                    engine.abort_request(rid)
        return [self._finalize(results[rid], wanted[rid]) for rid in order]

    def _lora_requests(self, lora_request: LoRARequest | Seq[LoRARequest | None] | None,
                       num_prompts: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each registered with the engine if it is not yet."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * num_prompts
        elif not isinstance(lora_request, (list, tuple)):
            raise ValueError(f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}")
        else:
            loras = list(lora_request)
            if len(loras) != num_prompts:
                raise ValueError(f"got {len(loras)} lora requests for {num_prompts} prompts")
        engine = self.llm_engine
        for lora in dict.fromkeys(r for r in loras if r is not None):
            if not isinstance(lora, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
            known = engine.lora.get(lora.lora_name) if engine.lora is not None else None
            if known is None:
                engine.add_lora(lora)  # ValueError when LoRA is off or the adapter does not fit
            elif known != lora:
                raise ValueError(f"adapter name {lora.lora_name!r} is registered as {known}; "
                                 f"got {lora} (remove it first to change its id or path)")
        return loras

    def chat(
        self,
        messages: list[dict] | Seq[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """vLLM's offline chat: render each conversation with the chat template, then `generate`.

        `messages` is one conversation (a list of `{"role", "content"}` dicts) or a list of them (one
        output each, in order). The template is the tokenizer's unless `chat_template` (a Jinja
        string) is given; `tools` and `chat_template_kwargs` are passed to it. The rendered text is
        tokenized without adding special tokens (the template writes them), as the server's chat
        routes do. Content given as OpenAI text parts is joined into one string (`"auto"` /
        `"string"`) or passed on as parts (`"openai"`). `lora_request` as in `generate` (one adapter,
        or one per conversation). Multi-modal inputs are refused.
        """
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: multi-modal inputs are not supported")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be True")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format must be auto, string or openai, "
                             f"got {chat_template_content_format!r}")
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs the tokenizer (skip_tokenizer_init=True)")
        one = isinstance(messages, Seq) and bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else list(messages)
        prompts: list[dict] = []
        for c, conversation in enumerate(conversations):
            conv = [_chat_message(m, chat_template_content_format, f"messages[{c}][{i}]")
                    for i, m in enumerate(conversation)]
            if not conv:
                raise ValueError(f"conversation {c} has no messages")
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, tools=tools,
                                           chat_template=chat_template, **(chat_template_kwargs or {}))
            prompts.append({"prompt": text, "prompt_token_ids": list(tok.encode(text, add_special_tokens=False))})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        engine = self.llm_engine
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(results), desc="Processed prompts", dynamic_ncols=True)
        start = time.perf_counter()
        num_in = num_out = 0
        remaining = {rid for rid, r in results.items() if not r.finished}
        while remaining:
            for delta in engine.step():
                out = results.get(delta.request_id)
                if out is None:
                    continue
                if delta.prompt_token_ids is not None and delta.index == 0:
                    num_in += delta.num_prompt_tokens
                    out.num_cached_tokens = delta.num_cached_tokens
                num_out += len(delta.token_ids)
                self._apply(out, delta)
                if delta.finish_reason is not None and all(c.finish_reason is not None for c in out.outputs):
                    out.finished = True
                    remaining.discard(delta.request_id)
                    if pbar is not None:
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        pbar.set_postfix_str(
                            f"est. speed input: {num_in / elapsed:.2f} toks/s, output: {num_out / elapsed:.2f} toks/s",
                            refresh=False,
                        )
                        pbar.update(1)
            if remaining and not engine.has_unfinished_requests():
                raise RuntimeError(f"engine finished but {len(remaining)} requests have no final output")
        if pbar is not None:
            pbar.close()
        _collect_cycles_holding_this_call()

    def _apply(self, out: RequestOutput, delta: StreamDelta) -> None:
        comp = out.outputs[delta.index]
        comp.text += delta.text
        comp.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            tok = self.llm_engine.tokenizer
            if comp.logprobs is None:
                comp.logprobs, comp.cumulative_logprob = [], 0.0
            for k, token_id in enumerate(delta.token_ids):
                top = delta.top_logprobs[k] if k < len(delta.top_logprobs) else {}
                ranked = sorted(top.items(), key=lambda kv: -kv[1])
                entry: dict[int, Logprob] = {}
                ranks = {t: r + 1 for r, (t, _) in enumerate(ranked)}
                entry[token_id] = Logprob(delta.logprobs[k], ranks.get(token_id), _decode(tok, token_id))
                for t, lp in ranked:
                    if t not in entry:
                        entry[t] = Logprob(lp, ranks[t], _decode(tok, t))
                comp.logprobs.append(entry)
                comp.cumulative_logprob += delta.logprobs[k]
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = [None if lp is None else {} for lp in delta.prompt_logprobs]
            for i, lp in enumerate(delta.prompt_logprobs):
                if lp is not None and i < len(out.prompt_token_ids):
                    out.prompt_logprobs[i] = {out.prompt_token_ids[i]: Logprob(lp)}
        if delta.finish_reason is not None:
            comp.finish_reason = _VLLM_FINISH.get(delta.finish_reason, delta.finish_reason)
            comp.stop_reason = delta.extra.get("stop_reason")

    @staticmethod
    def _finalize(out: RequestOutput, params: SamplingParams) -> RequestOutput:
        if len(out.outputs) > params.n:  # best_of: keep the n most likely samples
            best = sorted(out.outputs, key=lambda c: -(c.cumulative_logprob or 0.0))[: params.n]
            for i, c in enumerate(best):
                c.index = i
                if params.logprobs is None:
                    c.logprobs = None
            out.outputs = best
        return out


def _caller_frame_refs() -> int:
    frame = sys._getframe(1)
    return sys.getrefcount(frame)


def _running_frame_refs() -> int:
    return _caller_frame_refs()


# References to the frame of a running function when nothing else holds it, as the loop below
# counts them (the interpreter's, its local and getrefcount's argument: 3 on CPython 3.11),
# measured once rather than assumed, since interpreters count borrowed references differently.
_RUNNING_FRAME_REFS = _running_frame_refs()


class _HeapFreeze:
    """Keeps what the process had built when its first `LLM` was ready (imports, model, engine:
    several hundred thousand objects) out of the cyclic collector's walks while any `LLM` lives.

    A generation-2 collection walks every tracked object while the engine waits: on the 1B shape's
    reference workload they showed as idle gaps of 4-5 ms between GPU steps of ~3.5 ms
    (bench/RESULTS.md); the server and worker processes freeze theirs for the same reason
    (serving/server/wsgi.py). Frozen objects are still freed by reference counting; the freeze is
    undone when the last LLM shuts down, so cycles among them are collected again after that. A
    process that froze its heap itself (`gc.get_freeze_count()` > 0 at the first LLM) is left as it is.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._ours = False

    def acquire(self) -> None:
        """Count one more live LLM (freezing the heap for the first); `release` when it shuts down."""
        with self._lock:
            if self._holders == 0 and gc.get_freeze_count() == 0:
                gc.collect()  # garbage cycles are not frozen with the rest
                gc.freeze()
                self._ours = True
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            assert self._holders >= 0
            if self._holders == 0 and self._ours:
                gc.unfreeze()
                self._ours = False


_heap_freeze = _HeapFreeze()


def _close(engine: LLMEngine, heap_frozen: bool) -> None:
    """An LLM's finalizer (run once: `shutdown()` or the last reference dropped)."""
    try:
        engine.shutdown()
    finally:
        if heap_frozen:
            _heap_freeze.release()


def _collect_cycles_holding_this_call() -> None:
    """Run the cyclic collector when a reference cycle holds the frames of the running LLM call.

    Work done under an `LLM` method can leave one of its frames in a reference cycle (first-use
    imports in torch and transformers: `torch.fx.wrap` keeps its own frame in a local; Triton
    compiling a kernel). A finished frame holds its callers' frames (`f_back`) and their locals,
    `self` among them, so `del llm` would free nothing until the collector happens to run. Such
    a holder shows as an extra reference to a frame of this module still running; only then is
    the collection (~0.3 s) paid, which in practice is in the first calls of a process.
    """
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        if sys.getrefcount(frame) > _RUNNING_FRAME_REFS:
            del frame  # our own reference must not survive the collection
            gc.collect()
            return
        frame = frame.f_back


def _chat_message(message: object, content_format: str, where: str) -> dict:
    """One chat message for the template: a dict copy, its text parts joined unless kept ("openai")."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"{where} must be a dict with a string role, got {message!r:.80}")
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ValueError(f"{where}.content: only text parts are supported")
        if content_format != "openai":
            out["content"] = "".join(p["text"] for p in content)
    elif content is None:
        out["content"] = ""
    return out


def _decode(tokenizer, token_id: int) -> str | None:  # noqa: ANN001
    return tokenizer.decode([token_id]) if tokenizer is not None else None


def _normalize_inputs(
    prompts: PromptInput | Seq[PromptInput] | None, prompt_token_ids: list[int] | list[list[int]] | None
) -> list[tuple[str | None, list[int] | None]]:
    """-> [(text or None, ids or None)] per prompt."""
    out: list[tuple[str | None, list[int] | None]] = []
    if prompts is not None:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):  # type: ignore[index]
            prompts = [prompts]  # type: ignore[list-item]
        for p in prompts:  # type: ignore[union-attr]
            if isinstance(p, str):
                out.append((p, None))
            elif isinstance(p, dict):
                ids = p.get("prompt_token_ids")
                out.append((p.get("prompt"), list(ids) if ids is not None else None))
            else:
                out.append((None, [int(t) for t in p]))
    if prompt_token_ids is not None:
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            prompt_token_ids = [prompt_token_ids]  # type: ignore[list-item]
        if out and len(out) != len(prompt_token_ids):
            raise ValueError("prompts and prompt_token_ids must have the same length")
        if out:
            out = [(text, list(ids)) for (text, _), ids in zip(out, prompt_token_ids)]  # type: ignore[arg-type]
        else:
            out = [(None, list(ids)) for ids in prompt_token_ids]  # type: ignore[arg-type]
    if not out:
        raise ValueError("give prompts or prompt_token_ids")
    for text, ids in out:
        if text is None and ids is None:
            raise ValueError("each prompt needs text or prompt_token_ids")
    return out
