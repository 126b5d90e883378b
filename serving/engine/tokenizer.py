"""Tokenizer loading and streaming detokenization with stop strings.

`load_tokenizer` opens the HF tokenizer of a model dir (or hub id), never running repository code.
`IncrementalDetokenizer`
turns a sample's new token ids into text deltas: it decodes a small sliding window of ids
(`prefix_offset` / `read_offset`, as TGI and vLLM do) so word-initial spaces come out right,
waits while the text ends in U+FFFD (an incomplete UTF-8 sequence split across tokens), checks
stop strings, and holds back the last `max(len(stop)) - 1` characters so a partly matched stop
string is never sent. The deltas it hands out concatenate to exactly `output_text`.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

from serving.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("serving.engine.tokenizer")

# How many prompt tokens of context precede the first output token in the decode window
# (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_INITIAL_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class RemoteCodeRefused(RuntimeError):
    """The tokenizer exists only as model repository code, which this server never executes."""


def load_tokenizer(path: str, revision: str | None = None, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The HF (fast) tokenizer stored with a model dir or hub id; repository code is never executed.

    `trust_remote_code` is accepted (vLLM / LMI option) but changes nothing: transformers always
    gets False. A `tokenizer_config.json` whose `auto_map` names repository code is loaded with
    the built-in class transformers finds for it (with a warning that the code was ignored), or
    refused with `RemoteCodeRefused` when there is none.

    Loaded once per process for the same files, under a lock: model copies start on parallel
    threads, transformers' lazy module is not safe to import from several threads at once (on 4
    GPUs, 3 of 4 copies failed with "cannot import name 'AutoTokenizer'"), and every copy of one
    model has the same tokenizer.
    """
    key = (str(path), revision, _files_stamp(path))
    with _LOAD_LOCK:
        tokenizer = _LOADED.get(key)
        if tokenizer is None:
            tokenizer = _LOADED[key] = _load_tokenizer(str(path), revision, trust_remote_code)
        return tokenizer


_LOAD_LOCK = threading.Lock()
_LOADED: dict[tuple, PreTrainedTokenizerBase] = {}


def _files_stamp(path: str) -> tuple:
    """What changes when a local tokenizer's files do (names, sizes, times); () for a hub id."""
    try:
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path) if e.is_file()))
    except OSError:
        return ()


def _load_tokenizer(path: str, revision: str | None, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=False)
    except ValueError as exc:
        code = _tokenizer_code(path, revision)
        if code is None or "trust_remote_code" not in str(exc):
            raise
        raise RemoteCodeRefused(
            f"the tokenizer of {path} exists only as model repository code ({code}, from the auto_map of its "
            f"tokenizer_config.json): this server never executes repository code, whatever "
            f"option.trust_remote_code says; use a tokenizer with a built-in transformers class "
            f"(option.tokenizer)") from None
    code = _tokenizer_code(path, revision)
    if code is not None:
        logger.warning("%s: tokenizer_config.json maps AutoTokenizer to repository code (%s); it is NOT executed "
                       "(whatever option.trust_remote_code says): the built-in %s is used",
                       path, code, type(tokenizer).__name__)
    elif trust_remote_code:
        logger.info("trust_remote_code=true: %s needs no repository code; none is executed", path)
    return tokenizer


def _tokenizer_code(path: str, revision: str | None) -> str | None:
    """The repository classes the `auto_map` of a tokenizer_config.json names, if any."""
    from transformers.models.auto.tokenization_auto import get_tokenizer_config

    auto_map = get_tokenizer_config(path, revision=revision).get("auto_map")
    if isinstance(auto_map, dict):
        auto_map = auto_map.get("AutoTokenizer")
    refs = [ref for ref in auto_map or () if isinstance(ref, str)] if isinstance(auto_map, (list, tuple)) else []
    return ", ".join(refs) or None


def eos_token_ids(tokenizer: PreTrainedTokenizerBase | None, generation_eos: int | list[int] | None) -> list[int]:
    """EOS ids from generation_config/config (may be a list) plus the tokenizer's eos token."""
    ids: list[int] = []
    if isinstance(generation_eos, int):
        ids.append(generation_eos)
    elif generation_eos:
        ids.extend(int(t) for t in generation_eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return ids


class IncrementalDetokenizer:
    """Streaming text of one sample: decode new ids, find stop strings, release safe text.

    Use `append(new_ids)` after each step (returns the stop string that matched, if any),
    then `take_delta(finished)` for the text that may be sent now.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        # The decode window: ids[prefix_offset:read_offset] is already emitted context.
        self._ids: list[int] = list(prompt_token_ids[-_INITIAL_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.output_text = ""  # all text so far (truncated at a stop string when one matches)
        self._num_sent = 0  # characters of output_text already handed out
        self._num_output_tokens = 0
        self.stop_str: str | None = None
        self.token_texts: list[str] = []  # per token of the last append(): its own text piece
        self._max_stop_len = max((len(s) for s in params.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_one(self, token_id: int) -> str:
        """Append one id to the window; return the newly complete text ('' while waiting)."""
        self._ids.append(token_id)
        new_text = self._decode(self._ids[self.prefix_offset :])
        # NOTE: a trailing U+FFFD means the last token ended inside a multi-byte UTF-8 char
        # (byte-level BPE, or SentencePiece byte-fallback <0xE4>): wait for the next token.
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        # NOTE: new_text normally starts with _prefix_text; if a tokenizer quirk re-decodes the
        # window differently, taking the length difference still keeps sent text append-only.
        delta = new_text[len(self._prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        # Drop the ids left of the window now and then so the list stays short.
        if self.prefix_offset > 64:
            self._ids = self._ids[self.prefix_offset :]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        self._prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        return delta

    def append(self, new_token_ids: list[int]) -> str | None:
        """Decode the sample's newest tokens; returns the matched stop string, if any."""
        if self.stop_str is not None:
            return self.stop_str
        self.token_texts = []
        for token_id in new_token_ids:
            self._num_output_tokens += 1
            piece = self._decode_one(token_id)
            self.token_texts.append(piece)
            if not piece:
                continue
            start = max(0, len(self.output_text) - self._max_stop_len + 1)
            self.output_text += piece
            if self.params.stop and self._num_output_tokens >= self.params.min_tokens:
                if self._check_stop(start):
                    return self.stop_str
        return None

    def _check_stop(self, start: int) -> bool:
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            i = self.output_text.find(stop, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return False
        i, stop = best
        end = i + len(stop) if self.params.include_stop_str_in_output else i
        # NOTE: never below what was already sent; the hold-back guarantees end >= _num_sent.
        assert end >= self._num_sent, "stop string was partly sent"
        self.output_text = self.output_text[:end]
        self.stop_str = stop
        return True

    def flush(self) -> None:
        """At the end of a sample, add text still waiting for more bytes (as U+FFFD)."""
        if self.stop_str is not None:
            return
        rest = self._decode(self._ids[self.prefix_offset :])
        if len(rest) > len(self._prefix_text):
            self.output_text += rest[len(self._prefix_text) :]
        self.prefix_offset = self.read_offset = len(self._ids)
        self._prefix_text = ""

    def take_delta(self, finished: bool) -> str:
        """Text that may be sent now; when `finished`, everything not sent yet."""
        if finished:
            self.flush()
            end = len(self.output_text)
        else:
            hold = self._max_stop_len - 1 if self._max_stop_len else 0
            end = max(self._num_sent, len(self.output_text) - hold)
        delta = self.output_text[self._num_sent : end]
        self._num_sent = end
        return delta
