"""Batched sampling: logits of the sampled rows -> token ids (+ logprobs), per-request params.

Order of processing, per row (vLLM's): logit_bias (added to the named ids' logits) ->
min_tokens masking of stop/EOS ids -> repetition
penalty (HF: divide positive / multiply negative logits of tokens in prompt + output) ->
frequency and presence penalties (OpenAI: over output tokens) -> guided decoding mask
(tokens outside the row's grammar -> -inf; the plan's packed bitmask) -> greedy argmax, or
temperature -> top-k -> top-p -> min_p -> exponential race (argmax p / q, q ~ Exp(1)).
A batch where no row truncates (no top-k/top-p/min_p) samples in one fused Gumbel-max pass
(`kernels.gumbel_sample`: argmax(logits / T + Gumbel noise), the same law), each row keyed by
its own seed, so it skips the softmax and every other full pass over the logits.

Seeded rows draw q from their own `torch.Generator` (one per sequence, advanced once per
token), so a seeded request samples the same tokens alone or in any batch. Returned
logprobs are `log_softmax` of the logits after penalties and temperature (temperature 1 for
greedy rows) but before top-k/top-p/min_p truncation, so the top-k alternatives stay finite.

`sample()` never waits for the device: per-row parameters go up through pinned memory, and
the result (`DeviceSamples`) starts its device->host copy at once; `tokens()` waits for it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

import kernels

from serving.executor.batch_state import WorkerSeq
from serving.executor.plan import SampledToken

_NEG_INF = float("-inf")


def generator_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request with `seed` (index 0 uses the seed itself)."""
    return (seed + index * 1_000_003) % (2**63)


# Greedy batches of at most this many rows take the argmax in `kernels.gumbel_sample` (rows split over
# many programs; a greedy row's keys are its logits): torch's argmax over one row of 128,256 bf16 logits is one
# 37 us reduction, most of the GPU time of a batch-1 step outside its graph (bench/RESULTS.md run 45).
_SPLIT_ARGMAX_ROWS = 16


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first column of a tie), [N] int64."""
    if (logits.is_cuda and logits.dim() == 2 and 0 < logits.shape[0] <= _SPLIT_ARGMAX_ROWS
            and logits.stride(1) == 1 and kernels.use_triton(logits)):
        zeros = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
        return kernels.gumbel_sample(logits, zeros, zeros.long())  # inverse temperature 0: argmax, no noise
    return logits.argmax(dim=-1)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without blocking the host (pinned, non-blocking copy)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class DeviceSamples:
    """One step's sampled ids (and logprobs) on the device, on their way to the host.

    It exists so the engine can launch the next step before these ids reach the host: the
    next step reads `token_ids` on the device; `tokens()` waits for the copy and builds the
    host-side `SampledToken`s.
    """

    token_ids: torch.Tensor  # [N] int64, on the device
    logprob_rows: list[int]  # rows that asked for logprobs ...
    logprob_ks: list[int]  # ... and how many top alternatives each wants
    chosen: torch.Tensor | None = None  # [R] logprob of each such row's sampled token
    top_vals: torch.Tensor | None = None  # [R, k_max]
    top_ids: torch.Tensor | None = None  # [R, k_max]
    _host: tuple | None = None
    _ready: torch.cuda.Event | None = None

    def start_copy(self) -> DeviceSamples:
        """Queue the device->host copies (pinned, non-blocking) behind the sampling kernels."""
        parts = (self.token_ids, self.chosen, self.top_vals, self.top_ids)
        if self.token_ids.device.type == "cpu":
            self._host = parts
            return self
        self._host = tuple(None if t is None else t.to("cpu", non_blocking=True) for t in parts)
        self._ready = torch.cuda.Event()
        self._ready.record()
        return self

    def tokens(self) -> list[SampledToken]:
        """Wait for the copy; one SampledToken per row (the host's only sync for this step)."""
        if self._host is None:
            self.start_copy()
        if self._ready is not None:
            self._ready.synchronize()
        ids_t, chosen_t, vals_t, top_t = self._host  # type: ignore[misc]
        out = list(map(SampledToken, ids_t.tolist()))
        if not self.logprob_rows:
            return out
        chosen = chosen_t.tolist()
        vals = vals_t.tolist() if vals_t is not None else None
        top = top_t.tolist() if top_t is not None else None
        for j, (i, k) in enumerate(zip(self.logprob_rows, self.logprob_ks)):
            out[i].logprob = chosen[j]
            out[i].top_logprobs = {} if k == 0 else dict(zip(top[j][:k], vals[j][:k]))  # type: ignore[index]
        return out


class Sampler:
    """Turns `[num_sampled, vocab]` float32 logits into `SampledToken`s for those sequences."""

    def __init__(self, device: torch.device, seed: int = 0, eos_token_ids: Seq[int] = ()) -> None:
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        # Unseeded rows share these: engine-level determinism from EngineConfig.seed.
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._host_rng = random.Random(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # [N, V] float32
        seqs: list[WorkerSeq],
        generators: list[torch.Generator | None],
    ) -> list[SampledToken]:
        """Sample one token per row and wait for the result (see `sample` for the async form)."""
        if logits.shape[0] == 0:
            assert not seqs
            return []
        return self.sample(logits, seqs, generators).tokens()

    def sample(
        self,
        logits: torch.Tensor,  # [N, V] float32, or the model's dtype (upcast here)
        seqs: list[WorkerSeq],
        generators: list[torch.Generator | None],
        masks: tuple[list[int], object] | None = None,
    ) -> DeviceSamples:
        """Sample one token per row on the device; `generators[i]` is row i's own generator when seeded.

        `masks`: (rows, packed int32 `[len(rows), ceil(V/32)]`): guided decoding; in those rows
        only tokens whose bit is set can be drawn, on every sampling path.
        """
        n = logits.shape[0]
        assert n == len(seqs) == len(generators) and n > 0
        params = [s.params for s in seqs]
        # The decode graph's logits come in the model's dtype: widened here (exactly), into a fresh
        # tensor the penalties may then change without another copy.
        owned = logits.dtype != torch.float32
        logits = self._apply_penalties(logits.float(), seqs, owned=owned)
        if masks is not None and masks[0]:
            logits = apply_token_masks(logits, *masks)
        greedy = [p.greedy for p in params]
        token_ids = torch.empty(n, dtype=torch.long, device=logits.device)
        want_logprobs = [p.logprobs is not None for p in params]
        logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) and all(greedy) else None
        if all(greedy):
            token_ids = greedy_tokens(logits)
        elif not any(_truncates(p) for p in params):
            # Temperature only (the common batch): one fused Gumbel-max pass over the logits.
            inv_t = to_device([0.0 if g else 1.0 / p.temperature for p, g in zip(params, greedy)],
                              torch.float32, logits.device)
            token_ids = kernels.gumbel_sample(logits, inv_t, to_device(self._row_seeds(seqs), torch.long, logits.device))
            if any(want_logprobs):
                logprobs = torch.log_softmax(logits * torch.where(inv_t > 0, inv_t, 1.0)[:, None], dim=-1)
        else:
            temps = to_device([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                              torch.float32, logits.device)
            scaled = logits / temps[:, None]
            if any(want_logprobs):
                logprobs = torch.log_softmax(scaled, dim=-1)
            sample_rows = [i for i, g in enumerate(greedy) if not g]
            greedy_rows = [i for i, g in enumerate(greedy) if g]
            if not greedy_rows:
                # Every row samples (the common batch): no row gather/scatter over [N, vocab].
                token_ids = self._exponential_race(_truncate(scaled, params), generators)
            else:
                idx = to_device(greedy_rows, torch.long, logits.device)
                token_ids[idx] = logits[idx].argmax(dim=-1)
                idx = to_device(sample_rows, torch.long, logits.device)
                sub = _truncate(scaled[idx], [params[i] for i in sample_rows])
                token_ids[idx] = self._exponential_race(sub, [generators[i] for i in sample_rows])
        return self._outputs(token_ids, params, logprobs).start_copy()

    def sample_plain(
        self,
        logits: torch.Tensor,  # [N, V] float32, or the model's dtype (read as float32)
        inv_temperature: np.ndarray,  # [N] float32; 0 = greedy row
        masks: tuple[list[int], object] | None = None,
    ) -> DeviceSamples:
        """`sample` for a batch whose rows all sample on the plain path (temperature or greedy,
        unseeded, no penalties, bias, truncation or logprobs: `input_batch.plain_sampling`).

        The same draws as `sample` on such rows, from per-row columns instead of per-row Python.
        """
        if masks is not None and masks[0]:
            logits = apply_token_masks(logits, *masks)
        if not inv_temperature.any():
            token_ids = greedy_tokens(logits)
        else:
            dev = logits.device
            inv_t = torch.from_numpy(inv_temperature)
            if dev.type != "cpu":
                inv_t = inv_t.pin_memory().to(dev, non_blocking=True)
            # Unseeded rows' keys: one draw of the engine's host RNG, plus the row (`_row_seeds`).
            seeds = torch.arange(logits.shape[0], dtype=torch.long, device=dev) + self._host_rng.getrandbits(62)
            token_ids = kernels.gumbel_sample(logits, inv_t, seeds)
        return DeviceSamples(token_ids, [], []).start_copy()

    # --- steps -------------------------------------------------------------------------

    def _row_seeds(self, seqs: list[WorkerSeq]) -> list[int]:
        """Each row's key for this draw: seeded requests from (seed, sample, position) only, so
        the same request samples the same tokens alone or in any batch; others from the engine's
        seeded host RNG."""
        out = []
        base = None
        for row, seq in enumerate(seqs):
            seed = seq.params.seed
            if seed is None:
                if base is None:
                    base = self._host_rng.getrandbits(62)
                out.append(base + row)
            else:
                out.append(_mix64(seed, seq.index, seq.num_tokens))
        return out

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[WorkerSeq], owned: bool = False) -> torch.Tensor:
        """`logits` after bias, min_tokens bans and penalties; the caller's tensor is left as it was
        unless `owned` (a copy made for this call)."""
        params = [s.params for s in seqs]
        min_tok_rows = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        freq_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
        bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
        if not (min_tok_rows or rep_rows or freq_rows or bias_rows):
            return logits
        if not owned:
            logits = logits.clone()
        dev = logits.device
        if bias_rows:  # one scatter-add of every (row, id, bias) of the batch
            vocab = logits.shape[1]
            triples = [(i, t, b) for i in bias_rows for t, b in params[i].logit_bias if 0 <= t < vocab]
            if triples:
                rows_b, ids_b, vals_b = zip(*triples)
                logits.index_put_((to_device(list(rows_b), torch.long, dev), to_device(list(ids_b), torch.long, dev)),
                                  to_device(list(vals_b), logits.dtype, dev), accumulate=True)
        for i in min_tok_rows:
            p = params[i]
            # (ids outside the vocabulary are refused at admission; never index with one here)
            vocab = logits.shape[1]
            banned = [t for t in (*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)) if 0 <= t < vocab]
            if banned:
                logits[i, to_device(banned, torch.long, dev)] = _NEG_INF
        if rep_rows:
            rows = to_device(rep_rows, torch.long, dev)
            seen = _token_mask([seqs[i].token_ids for i in rep_rows], logits.shape[1], dev)  # [R, V]
            pen = to_device([params[i].repetition_penalty for i in rep_rows], logits.dtype, dev)
            sub = logits[rows]
            penalized = torch.where(sub > 0, sub / pen[:, None], sub * pen[:, None])
            logits[rows] = torch.where(seen, penalized, sub)
        if freq_rows:
            rows = to_device(freq_rows, torch.long, dev)
            counts = _token_counts([seqs[i].output_token_ids for i in freq_rows], logits.shape[1], dev)  # [R, V]
            freq = to_device([params[i].frequency_penalty for i in freq_rows], logits.dtype, dev)
            pres = to_device([params[i].presence_penalty for i in freq_rows], logits.dtype, dev)
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
                rows = to_device(shared, torch.long, q.device)
                q[rows] = torch.empty(len(shared), q.shape[1], device=q.device).exponential_(generator=self.generator)
        # exponential_ can return exactly 0 (u == 0 happens ~2^-24 per draw): 0/0 would be NaN
        # and win the argmax, so floor q at the smallest normal float.
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        return (probs / q).argmax(dim=-1)

    def _outputs(self, token_ids: torch.Tensor, params: list, logprobs: torch.Tensor | None) -> DeviceSamples:
        if logprobs is None:
            return DeviceSamples(token_ids, [], [])
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        ks = [params[i].logprobs for i in rows]
        idx = to_device(rows, torch.long, logprobs.device)
        sub = logprobs[idx]
        chosen = sub.gather(1, token_ids[idx][:, None])[:, 0]
        k_max = max(ks)
        top_vals, top_ids = sub.topk(k_max, dim=-1) if k_max > 0 else (None, None)
        return DeviceSamples(token_ids, rows, ks, chosen, top_vals, top_ids)


def apply_token_masks(logits: torch.Tensor, rows: list[int], packed: object) -> torch.Tensor:
    """Set to -inf, in place, the logits of tokens whose bit is clear in `packed`, in each of `rows`.

    `packed`: int32 `[len(rows), ceil(V/32)]` (numpy or torch), bit v of row r = token v allowed
    (xgrammar's bitmask layout). On the GPU: one small upload, unpacked with a shift-and-mask over
    the masked rows only; on the CPU xgrammar's kernel (the torch unpack costs ~5x more there).
    Returns `logits` (the caller's tensor is changed: fresh logits, or a graph's output buffer).
    """
    dev = logits.device
    bits = packed if isinstance(packed, torch.Tensor) else torch.from_numpy(packed)
    whole = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
    idx = None if whole else to_device(rows, torch.long, dev)
    sub = logits if whole else logits.index_select(0, idx)
    if dev.type == "cpu" and sub.dtype == torch.float32:
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(sub, bits.contiguous(), vocab_size=logits.shape[1])
    else:
        if dev.type != "cpu":
            bits = bits.pin_memory().to(dev, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=dev)
        allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(bits.shape[0], -1)[:, : logits.shape[1]]
        sub.masked_fill_(~allowed, _NEG_INF)
    if not whole:
        logits.index_copy_(0, idx, sub)
    return logits


def _mix64(*values: int) -> int:
    """A well-spread 63-bit key from a few integers (splitmix64 finalizer over a running sum)."""
    h = 0
    for v in values:
        h = (h + (v & 0xFFFFFFFFFFFFFFFF) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def _truncates(p) -> bool:  # noqa: ANN001
    """Whether top-k, top-p or min-p cut this row's distribution (the fused path does not)."""
    return 0 < p.top_k or p.top_p < 1.0 or p.min_p > 0.0


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
        k = to_device(top_k, torch.long, dev)
        thresh = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < thresh, _NEG_INF)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1.0 - to_device(top_p, torch.float32, dev)[:, None]
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
        logits = torch.empty_like(sorted_logits).scatter_(1, sorted_idx, sorted_logits)
    elif any(k < vocab for k in top_k):
        k_max = max(top_k)
        top_vals = logits.topk(k_max, dim=-1).values  # [R, k_max] descending
        thresh = top_vals.gather(1, to_device(top_k, torch.long, dev)[:, None] - 1)
        logits = logits.masked_fill(logits < thresh, _NEG_INF)
    if any(m > 0.0 for m in min_p):
        probs = logits.softmax(dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * to_device(min_p, torch.float32, dev)[:, None]
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
    if dev.type == "cpu":
        return ids, valid
    return ids.pin_memory().to(dev, non_blocking=True), valid.pin_memory().to(dev, non_blocking=True)


def _token_mask(lists: list[list[int]], vocab: int, dev: torch.device) -> torch.Tensor:
    """[R, V] bool: token v occurs in list r."""
    return _token_counts(lists, vocab, dev) > 0


def _token_counts(lists: list[list[int]], vocab: int, dev: torch.device) -> torch.Tensor:
    """[R, V] float32: how often token v occurs in list r."""
    ids, valid = _padded(lists, dev)
    counts = torch.zeros(len(lists), vocab, dtype=torch.float32, device=dev)
    return counts.scatter_add_(1, ids, valid.to(torch.float32))
