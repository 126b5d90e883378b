"""A tiny in-test stand-in for EngineLoop (Flask test_client unit tests only).

Character-level tokenizer (id = code point); each request emits "abc..." one char per step from
a thread. A prompt containing "FAIL" errors after two tokens; "SLOW" sleeps between tokens.
LoRA: `add_lora` checks only that the path exists; a request on an adapter emits "ABC..." instead.
"""

from __future__ import annotations

import queue
import threading
import time

from serving.lora_request import LoRARequest, UnknownAdapterError
from serving.engine.scheduler import context_overflow_message
from serving.outputs import StreamDelta


class FakeTokenizer:
    all_special_ids = [0]
    chat_template = "fake"

    def __len__(self) -> int:
        return 0x110000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i or not skip_special_tokens)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, chat_template=None):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeStream:
    def __init__(self, loop: "FakeEngineLoop", rid: str) -> None:
        self.loop, self.rid, self.q, self.closed = loop, rid, queue.Queue(), False

    def get(self, timeout: float | None = None) -> StreamDelta:
        return self.q.get(timeout=timeout)

    def get_nowait(self) -> StreamDelta | None:
        try:
            return self.q.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with self.loop.lock:
                self.loop.active.discard(self.rid)
                self.loop.closed.append(self.rid)


class FakeEngineLoop:
    def __init__(self, state: str = "ready", delay: float = 0.0) -> None:
        self.state, self.error, self.delay = state, None, delay
        self.tokenizer = FakeTokenizer()
        self.max_model_len = 64
        self.lock = threading.Lock()
        self.active: set[str] = set()
        self.closed: list[str] = []
        self.params: list = []
        self.loras: dict[str, LoRARequest] = {}
        self.lora_names: list[str | None] = []  # the adapter of each request, in order

    def add_lora(self, request: LoRARequest) -> None:
        import os

        if not os.path.isdir(request.lora_path):
            raise ValueError(f"{request.lora_path} is not a directory")
        if request.lora_name in self.loras:
            raise ValueError(f"adapter {request.lora_name!r} is already registered")
        self.loras[request.lora_name] = request

    def remove_lora(self, name: str) -> bool:
        return self.loras.pop(name, None) is not None

    def list_loras(self) -> list[str]:
        return sorted(self.loras)

    def stats(self) -> dict:
        return {"num_requests_waiting": 0, "num_requests_running": len(self.active), "num_kv_blocks": 100,
                "num_free_kv_blocks": 100 - len(self.active)}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params, lora_name=None) -> FakeStream:
        if self.state != "ready":
            raise RuntimeError("not ready")
        if lora_name is not None and lora_name not in self.loras:
            raise UnknownAdapterError(lora_name, self.loras)
        # The check LLMEngine.validate makes (through the scheduler), with its message.
        total = len(prompt_token_ids) + (params.max_tokens or 0)
        if total > self.max_model_len:
            raise ValueError(context_overflow_message(self.max_model_len, len(prompt_token_ids), params.max_tokens))
        stream = FakeStream(self, request_id)
        self.params.append(params)
        self.lora_names.append(lora_name)
        with self.lock:
            self.active.add(request_id)
        prompt = "".join(chr(i) for i in prompt_token_ids if i)
        first = ord("A") if lora_name else ord("a")
        threading.Thread(target=self._run, args=(stream, prompt, params, first), daemon=True).start()
        return stream

    def _run(self, stream: FakeStream, prompt: str, params, first: int = ord("a")) -> None:
        n_out = params.max_tokens or self.max_model_len - len(prompt)  # None: up to the context limit
        for s in range(params.n):
            for i in range(n_out):
                if stream.closed:
                    return
                if "SLOW" in prompt or self.delay:
                    time.sleep(self.delay or 0.05)
                tid = first + i % 26
                if "FAIL" in prompt and i == 2:
                    stream.q.put(StreamDelta(stream.rid, s, (), "", finish_reason="error", error="boom"))
                    return
                last = i == n_out - 1
                stream.q.put(StreamDelta(stream.rid, s, (tid,), chr(tid), logprobs=(-0.5,), token_texts=(chr(tid),),
                                         finish_reason="length" if last else None,
                                         num_prompt_tokens=len(prompt), num_output_tokens=i + 1))
