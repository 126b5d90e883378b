"""Speculative verification: the target's logits at a sequence's last token and its k draft
tokens -> the accepted drafts plus one token of the target's own, exactly.

It exists so speculation changes speed, never output. Greedy rows accept a draft while it is the
target's argmax, then take the argmax: token-identical to plain greedy decoding. Sampled rows use
standard rejection sampling: draft d, drawn from q, at a position whose target distribution is p is
accepted with probability min(1, p(d) / q(d)); on rejection the token is drawn from the residual
max(0, p - q) normalised; after k accepted drafts a bonus token is drawn from the last row's p.
Every emitted token is then distributed as the target's (Leviathan et al. 2023, Chen et al. 2023).
q is the draft model's distribution when one proposed (`draft_probs`), else the point mass 1[d]
(prompt lookup): acceptance with probability p(d), residual p with d removed. p is the plain sampler's distribution:
temperature, then top-k / top-p / min-p; logprobs are taken as the plain sampler does (after
temperature, before truncation; temperature 1 for greedy rows).
"""

from __future__ import annotations

import torch

from serving.executor.plan import SampledToken
from serving.executor.sampler import _truncate, _truncates


def verify_drafts(
    logits: torch.Tensor,  # [k + 1, V]: rows at the last known token and at each draft
    drafts: list[int],  # k draft tokens
    params,  # noqa: ANN001  (SamplingParams)
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,  # [k, V']: q of each draft (V' <= V), or None: point masses
) -> list[SampledToken]:
    """The tokens this verify step yields (1 to k + 1), each with its logprobs when asked for."""
    k = len(drafts)
    assert logits.shape[0] == k + 1, (logits.shape, k)
    logits = logits.float()
    if params.greedy:
        target = logits.argmax(dim=-1).tolist()
        a = 0
        while a < k and drafts[a] == target[a]:
            a += 1
        ids = [*drafts[:a], target[a]]
    else:
        ids = _rejection_sample(logits, drafts, params, generator, draft_probs)
    return _with_logprobs(logits, ids, params)


def _rejection_sample(logits: torch.Tensor, drafts: list[int], params, generator: torch.Generator,  # noqa: ANN001
                      draft_probs: torch.Tensor | None) -> list[int]:
    k = len(drafts)
    scaled = logits / float(params.temperature)
    if _truncates(params):
        scaled = _truncate(scaled, [params] * (k + 1))
    probs = torch.softmax(scaled, dim=-1)
    dev = probs.device
    at = (torch.arange(k, device=dev), torch.tensor(drafts, dtype=torch.long, device=dev))
    q = None
    if draft_probs is not None:
        assert draft_probs.shape[0] == k and draft_probs.shape[1] <= probs.shape[1], (draft_probs.shape, probs.shape)
        q = torch.zeros((k, probs.shape[1]), dtype=probs.dtype, device=dev)
        q[:, : draft_probs.shape[1]] = draft_probs.to(device=dev, dtype=probs.dtype)
        ratio = (probs[at] / q[at]).tolist()  # q(d) > 0: d was drawn from q
    else:
        ratio = probs[at].tolist()  # p(d) / 1
    u = torch.rand(k, generator=generator, device=dev).tolist() if k else []
    for j in range(k):
        if u[j] < ratio[j]:
            continue
        if q is None:
            residual = probs[j].clone()
            residual[drafts[j]] = 0.0  # max(0, p - 1[d]), up to normalisation (multinomial normalises)
        else:
            residual = (probs[j] - q[j]).clamp_(min=0.0)
            if not float(residual.sum()) > 0.0:  # p == q to rounding: a rejection had ~0 chance
                residual = probs[j]
        return [*drafts[:j], int(torch.multinomial(residual, 1, generator=generator))]
    return [*drafts, int(torch.multinomial(probs[k], 1, generator=generator))]


def _with_logprobs(logits: torch.Tensor, ids: list[int], params) -> list[SampledToken]:  # noqa: ANN001
    out = [SampledToken(t) for t in ids]
    if params.logprobs is None:
        return out
    rows = logits[: len(ids)]
    if not params.greedy:
        rows = rows / float(params.temperature)
    lp = torch.log_softmax(rows, dim=-1)
    chosen = lp.gather(1, torch.tensor(ids, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    top = lp.topk(params.logprobs, dim=-1) if params.logprobs > 0 else None
    for r, token in enumerate(out):
        token.logprob = chosen[r]
        token.top_logprobs = {} if top is None else dict(zip(top.indices[r].tolist(), top.values[r].tolist()))
    return out
