"""Batched sampling: logits of the sampled rows -> token ids (+ logprobs), per-request params.

Order of processing, per row (vLLM's): min_tokens masking of stop/EOS ids -> repetition
penalty (HF: divide positive / multiply negative logits of tokens in prompt + output) ->
frequency and presence penalties (OpenAI: over output tokens) -> greedy argmax, or
temperature -> top-k -> top-p -> min_p -> exponential race (argmax p / q, q ~ Exp(1)).

Seeded rows draw q from their own `torch.Generator` (one per sequence, advanced once per
token), so a seeded request samples the same tokens alone or in any batch. Returned
logprobs are `log_softmax` of the logits after penalties and temperature (temperature 1 for
greedy rows) but before top-k/top-p/min_p truncation, so the top-k alternatives stay finite.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from serving.scheduler_output import SampledToken
from serving.sequence import Sequence

_NEG_INF = float("-inf")


def generator_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request with `seed` (index 0 uses the seed itself)."""
    return (seed + index * 1_000_003) % (2**63)


class Sampler:
    """Turns `[num_sampled, vocab]` float32 logits into `SampledToken`s for those sequences."""

    def __init__(self, device: torch.device, seed: int = 0, eos_token_ids: Seq[int] = ()) -> None:
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        # Unseeded rows share this one: engine-level determinism from EngineConfig.seed.
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # [N, V] float32
        seqs: list[Sequence],
        generators: list[torch.Generator | None],
    ) -> list[SampledToken]:
        """Sample one token per row; `generators[i]` is row i's own generator when seeded."""
        n = logits.shape[0]
        assert n == len(seqs) == len(generators)
        if n == 0:
            return []
        params = [s.params for s in seqs]
        logits = self._apply_penalties(logits, seqs)
        greedy = [p.greedy for p in params]
        token_ids = torch.empty(n, dtype=torch.long, device=logits.device)
        want_logprobs = [p.logprobs is not None for p in params]
        logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) and all(greedy) else None
        if all(greedy):
            token_ids = logits.argmax(dim=-1)
        else:
            temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                 dtype=torch.float32, device=logits.device)
            scaled = logits / temps[:, None]
            if any(want_logprobs):
                logprobs = torch.log_softmax(scaled, dim=-1)
            sample_rows = [i for i, g in enumerate(greedy) if not g]
            greedy_rows = [i for i, g in enumerate(greedy) if g]
            if not greedy_rows:
                # Every row samples (the common batch): no row gather/scatter over [N, vocab].
                token_ids = self._exponential_race(_truncate(scaled, params), generators)
            else:
                idx = torch.tensor(greedy_rows, device=logits.device)
                token_ids[idx] = logits[idx].argmax(dim=-1)
                idx = torch.tensor(sample_rows, device=logits.device)
                sub = _truncate(scaled[idx], [params[i] for i in sample_rows])
                token_ids[idx] = self._exponential_race(sub, [generators[i] for i in sample_rows])
        ids = token_ids.tolist()
        return self._outputs(ids, params, logprobs)

    # --- steps -------------------------------------------------------------------------

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        min_tok_rows = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        freq_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
        if not (min_tok_rows or rep_rows or freq_rows):
            return logits
        logits = logits.clone()
        dev = logits.device
        for i in min_tok_rows:
            p = params[i]
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
            if banned:
                logits[i, torch.tensor(banned, device=dev)] = _NEG_INF
        if rep_rows:
            rows = torch.tensor(rep_rows, device=dev)
            seen = _token_mask([seqs[i].token_ids for i in rep_rows], logits.shape[1], dev)  # [R, V]
            pen = torch.tensor([params[i].repetition_penalty for i in rep_rows], dtype=logits.dtype, device=dev)
            sub = logits[rows]
            penalized = torch.where(sub > 0, sub / pen[:, None], sub * pen[:, None])
            logits[rows] = torch.where(seen, penalized, sub)
        if freq_rows:
            rows = torch.tensor(freq_rows, device=dev)
            counts = _token_counts([seqs[i].output_token_ids for i in freq_rows], logits.shape[1], dev)  # [R, V]
            freq = torch.tensor([params[i].frequency_penalty for i in freq_rows], dtype=logits.dtype, device=dev)
            pres = torch.tensor([params[i].presence_penalty for i in freq_rows], dtype=logits.dtype, device=dev)
            logits[rows] = logits[rows] - freq[:, None] * counts - pres[:, None] * (counts > 0).to(logits.dtype)
        return logits

    def _exponential_race(self, logits: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """argmax(p / q), q ~ Exp(1): an exact sample of softmax(logits), one draw per vocab entry."""
        probs = torch.softmax(logits, dim=-1)  # [R, V]
        q = torch.empty_like(probs)
        shared = [i for i, g in enumerate(generators) if g is None]
        if len(shared) == len(generators):
            q.exponential_(generator=self.generator)
        else:
            for i, g in enumerate(generators):
                if g is not None:
                    q[i].exponential_(generator=g)
            if shared:
                rows = torch.tensor(shared, device=q.device)
                q[rows] = torch.empty(len(shared), q.shape[1], device=q.device).exponential_(generator=self.generator)
        # exponential_ can return exactly 0 (u == 0 happens ~2^-24 per draw): 0/0 would be NaN
        # and win the argmax, so floor q at the smallest normal float.
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        return (probs / q).argmax(dim=-1)

    def _outputs(self, ids: list[int], params: list, logprobs: torch.Tensor | None) -> list[SampledToken]:
        out = [SampledToken(token_id=t) for t in ids]
        if logprobs is None:
            return out
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        idx = torch.tensor(rows, device=logprobs.device)
        chosen = logprobs[idx, torch.tensor([ids[i] for i in rows], device=logprobs.device)].tolist()
        k_max = max(params[i].logprobs for i in rows)
        top_vals, top_ids = (logprobs[idx].topk(k_max, dim=-1) if k_max > 0 else (None, None))
        top_vals = top_vals.tolist() if top_vals is not None else None
        top_ids = top_ids.tolist() if top_ids is not None else None
        for j, i in enumerate(rows):
            out[i].logprob = chosen[j]
            k = params[i].logprobs
            out[i].top_logprobs = {} if k == 0 else dict(zip(top_ids[j][:k], top_vals[j][:k]))
        return out


def _truncate(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Apply top-k, top-p and min_p (per row) by setting excluded logits to -inf."""
    vocab = logits.shape[1]
    dev = logits.device
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [float(p.top_p) for p in params]
    min_p = [float(p.min_p) for p in params]
    if any(p < 1.0 for p in top_p):
        # vLLM's sort-based top-k + top-p: ascending sort, mask the low tail, scatter back.
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
        k = torch.tensor(top_k, device=dev)
        thresh = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < thresh, _NEG_INF)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1.0 - torch.tensor(top_p, device=dev)[:, None]
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
        logits = torch.empty_like(sorted_logits).scatter_(1, sorted_idx, sorted_logits)
    elif any(k < vocab for k in top_k):
        k_max = max(top_k)
        top_vals = logits.topk(k_max, dim=-1).values  # [R, k_max] descending
        thresh = top_vals.gather(1, torch.tensor(top_k, device=dev)[:, None] - 1)
        logits = logits.masked_fill(logits < thresh, _NEG_INF)
    if any(m > 0.0 for m in min_p):
        probs = logits.softmax(dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=dev)[:, None]
        logits = logits.masked_fill(probs < floor, _NEG_INF)
    return logits


def _padded(lists: list[list[int]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(x) for x in lists))
    ids = torch.zeros(len(lists), width, dtype=torch.long)
    valid = torch.zeros(len(lists), width, dtype=torch.bool)
    for r, x in enumerate(lists):
        if x:
            ids[r, : len(x)] = torch.tensor(x, dtype=torch.long)
            valid[r, : len(x)] = True
    return ids.to(dev), valid.to(dev)


def _token_mask(lists: list[list[int]], vocab: int, dev: torch.device) -> torch.Tensor:
    """[R, V] bool: token v occurs in list r."""
    return _token_counts(lists, vocab, dev) > 0


def _token_counts(lists: list[list[int]], vocab: int, dev: torch.device) -> torch.Tensor:
    """[R, V] float32: how often token v occurs in list r."""
    ids, valid = _padded(lists, dev)
    counts = torch.zeros(len(lists), vocab, dtype=torch.float32, device=dev)
    return counts.scatter_add_(1, ids, valid.to(torch.float32))
