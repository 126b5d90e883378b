"""Speculative decoding options (vLLM's `speculative_config`), parsed once into a frozen value.

It exists so the offline `LLM(speculative_config={...})`, the container's
`OPTION_SPECULATIVE_CONFIG` (JSON) and LMI's `option.speculative_draft_model` /
`option.speculative_length` all end as one checked object on `EngineConfig`, and a bad key or
value is refused at start with the name that is wrong.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

METHODS = ("ngram", "draft_model")
# Past this many running sequences a step is bound by compute, not by reading the weights, so
# the k extra positions per sequence cost about what they are worth (see README, "Speculative
# decoding", for how to measure the crossover on a GPU).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """One speculation method for every request the engine runs.

    method: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the
        sequence's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`), or
        "draft_model" (a smaller checkpoint with the same vocabulary, `model`, proposes k tokens;
        the default when `model` is given).
    model: the draft checkpoint (a local directory or a Hub id), for "draft_model" only.
    num_speculative_tokens: k, the most tokens proposed (and verified in one forward) per step.
    disable_by_batch_size: speculate only while at most this many sequences run (vLLM's name).
    acceptance_floor / acceptance_window: a sequence whose proposals were accepted at a rate
        below the floor over its last `acceptance_window` proposed tokens stops proposing for
        its next `acceptance_window` tokens, then tries again; each poor window in a row doubles
        that pause (up to 32x), a good one resets it (ours; 0 turns the floor off). A paused
        sequence decodes exactly as without speculation, async scheduling included.
    """

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    acceptance_floor: float = 0.1
    acceptance_window: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {'|'.join(METHODS)}, got {self.method!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model.strip()):
            raise ValueError("speculative_config: method draft_model needs \"model\" (the draft checkpoint)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"speculative_config: \"model\" ({self.model!r}) is for method draft_model, not ngram")
        for name, lo in (("num_speculative_tokens", 1), ("prompt_lookup_max", 1), ("prompt_lookup_min", 1),
                         ("disable_by_batch_size", 1), ("acceptance_window", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"speculative_config.{name} must be an integer >= {lo}, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if not 0.0 <= float(self.acceptance_floor) <= 1.0:
            raise ValueError(f"speculative_config.acceptance_floor must be in [0, 1], got {self.acceptance_floor!r}")

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, a dict of vLLM names, a JSON object string, or None/"" (off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config must be a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be an object of vLLM names, got {type(value).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(names)}")
        if "model" in value and "method" not in value:
            value = {**value, "method": "draft_model"}  # vLLM: a draft model when one is named
        return cls(**value)

    @classmethod
    def from_lmi(cls, draft_model: str | None, length: int | None, config: SpeculativeConfig | None
                 ) -> SpeculativeConfig | None:
        """`config` with LMI's `option.speculative_draft_model` / `option.speculative_length` applied
        (the draft model and k); ValueError when they contradict `option.speculative_config`."""
        if draft_model is None:
            if length is None:
                return config
            if config is None:
                raise ValueError("option.speculative_length sizes draft-model speculation: set "
                                 "option.speculative_draft_model too (or num_speculative_tokens in "
                                 "option.speculative_config)")
            return cls(**{**config.as_dict(), "num_speculative_tokens": length})
        if config is not None and config.method != "draft_model":
            raise ValueError(f"option.speculative_draft_model and option.speculative_config (method "
                             f"{config.method}) name two speculation methods: set one")
        if config is not None and config.model != draft_model:
            raise ValueError(f"option.speculative_draft_model={draft_model!r} and option.speculative_config's "
                             f"model {config.model!r} differ: set one")
        base = config.as_dict() if config is not None else {}
        if length is not None:
            base["num_speculative_tokens"] = length
        return cls(**{**base, "method": "draft_model", "model": draft_model})

    def as_dict(self) -> dict:
        return asdict(self)
