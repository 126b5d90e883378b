"""The engine -> executor hand-off for one step (`StepPlan`), and the executor's answer.

It exists so a step can cross a process boundary cheaply: everything here is plain data
(columns of ints, frozen `SamplingParams`), picklable, with no reference to the engine's live
objects. Workers keep a mirror of each running sequence (`serving/executor/batch_state.py`)
and the plan carries only what changed since the last step, as vLLM v1's `SchedulerOutput`
does: the sequences the workers have not seen (whole), and for the others the new block ids
and the token ids the engine resolved since it last sent them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from serving.engine_config import CacheConfig
from serving.sampling_params import SamplingParams

PLACEHOLDER = -1
"""Stands in for a token still being sampled on the device (async scheduling).

The engine counts it like any token (the next step computes it); a worker takes its id from
its previous step's device tensor; the engine later writes the real id and sends it on."""


@dataclass(slots=True)
class NewSeq:
    """A sequence the workers do not hold: first admission, or re-admission after preemption.

    `token_ids` are every id known so far (prompt, then resolved outputs); `block_ids` its whole
    block table at this step.
    """

    seq_id: int
    index: int  # which sample of its request (seeded generators)
    num_prompt_tokens: int
    token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]


@dataclass(slots=True)
class StepPlan:
    """One step for every worker: what to forget, what is new, which tokens to compute.

    Chunk i computes positions `[starts[i], starts[i] + num_tokens[i])` of sequence
    `seq_ids[i]`; `sample[i]`: the chunk reaches the last known token, so a token is drawn for
    the position after it. Decodes (one token each) come first (`num_decodes` of them). The
    per-chunk fields are columns of plain ints (a 256-row decode plan pickles in ~0.1 ms, where
    one object per chunk cost ~0.7 ms); the rarer per-chunk extras are sparse maps by chunk
    index: `new_blocks[i]` extends the worker's block table, `syncs[i] = (from, ids)` replaces
    the worker's ids from index `from` on with the engine's (which may end with a PLACEHOLDER).

    `masks` (guided decoding) hold the allowed next tokens of the sampling chunks listed in
    `mask_chunks`; rank 0 applies them to those rows' logits before sampling.

    Workers apply it in this order: drop `finished_seq_ids` (ended or aborted since the last
    plan: all their state goes) and `preempted_seq_ids` (their seeded generators stay, for when
    they come back as new sequences), add `new_seqs`, then run the chunks.
    """

    step_id: int
    seq_ids: list[int]
    starts: list[int]
    num_tokens: list[int]
    sample: list[bool]
    num_decodes: int
    new_blocks: dict[int, list[int]] = field(default_factory=dict)
    syncs: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    new_seqs: list[NewSeq] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)
    # Guided decoding: the sampling chunks (indices) whose next token is constrained, and
    # their allowed tokens, packed: row r of the int32 `[len(mask_chunks), ceil(V/32)]` array
    # has bit v set when token v may be sampled (numpy, so it pickles as one buffer).
    mask_chunks: list[int] = field(default_factory=list)
    masks: Any = None
    # Multi-LoRA: the adapter slot of each chunk (-1: base model; None: no chunk uses an adapter),
    # and the slots to fill before running it: slot -> (name, int id, PEFT dir), or None to free.
    lora_slots: list[int] | None = None
    lora_loads: dict[int, tuple[str, int, str] | None] = field(default_factory=dict)
    # Speculative decoding: chunk index -> how many of its last tokens are drafts to verify. Such a
    # chunk samples from every draft position too (rank 0 accepts or rejects each, exactly).
    num_drafts: dict[int, int] = field(default_factory=dict)
    # ... and, for a sampled row's drafts drawn from a draft model, the distributions they were drawn
    # from (chunk index -> `[k, V]` tensor): rejection sampling needs them (absent: point masses).
    draft_probs: dict[int, Any] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seq_ids


@dataclass(slots=True)
class SampledToken:
    """The executor's result for one sampled sequence."""

    token_id: int
    logprob: float | None = None  # chosen token's logprob (when params.logprobs is not None)
    top_logprobs: dict[int, float] | None = None  # top-k id -> logprob
    prompt_logprobs: list[float | None] | None = None  # first step only, with prompt_logprobs
    # Speculative decoding: the tokens after this one from the same verify step (accepted drafts,
    # then the target's own token), each with its logprobs; None for a plain step.
    following: list[SampledToken] | None = None
    # (engine side) how many tokens of the same sample follow this one in this step's results
    more: int = 0


class StepOutput:
    """Sampled tokens, aligned with the chunks of the plan that sample, in order.

    It exists so the engine can launch step N+1 before step N's tokens reach the host: a GPU
    worker returns it with `resolve` (waits for the device->host copy on first access of
    `sampled`) and keeps `token_ids` (the ids still on the device; element i was sampled for
    the sequence in the worker's input-batch row `rows[i]`) to fill the next step's placeholders.
    """

    __slots__ = ("_sampled", "_resolve", "token_ids", "rows")

    def __init__(
        self,
        sampled: list[SampledToken] | None = None,
        *,
        resolve: Callable[[], list[SampledToken]] | None = None,
        token_ids: Any = None,
        rows: Any = None,
    ) -> None:
        assert (sampled is None) != (resolve is None), "give the tokens, or a way to resolve them"
        self._sampled = sampled
        self._resolve = resolve
        self.token_ids = token_ids
        self.rows = rows  # numpy int64 [num_sampled], or None

    @property
    def sampled(self) -> list[SampledToken]:
        if self._sampled is None:
            self._sampled = self._resolve()  # type: ignore[misc]
            self._resolve = None
        return self._sampled


@dataclass(frozen=True)
class ExecutorInfo:
    """What the engine learns from the loaded model, once, from the executor.

    The one source of these values: the KV geometry (blocks are the minimum over ranks and
    replicas' own), the vocabulary, EOS ids (config.json + generation_config.json), and where the
    model and tokenizer files are. (The token budget is the engine's `config.token_budget`.)
    """

    model_dir: str
    cache: CacheConfig
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device_type: str  # "cuda" | "cpu"
    devices: tuple[str, ...] = ()  # one per rank, e.g. ("cuda:0", "cuda:1")
    # Token counts a step with prompt tokens runs at (its graphs' buckets; empty: any count). The
    # scheduler fills a step's padding up to the next one with prompt tokens.
    step_sizes: tuple[int, ...] = ()
