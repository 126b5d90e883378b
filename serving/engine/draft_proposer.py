"""Draft-model proposals: a second, smaller checkpoint with the target's vocabulary proposes k tokens.

It exists for text that prompt lookup cannot guess (answers that do not quote their input): a
small model of the same family (Llama-3.2-1B beside Llama-3.1-8B, say) agrees with the large one
on most easy tokens, and k of its cheap steps cost less than the target steps they save.

The draft runs in the engine's process with its own `ModelRunner` and its own small paged KV
cache (its own `BlockManager`), on the device of the target's rank 0 (built before the target, so
the target's KV cache is sized around it). Under tensor parallelism it still runs on rank 0's
device only: it is small, a replica on every rank would cost each rank its weights and KV cache
for no speed (the draft's steps are bound by reading its own weights, which one device does as
fast as several), and its tokens must reach the engine's scheduler, which lives here, anyway.

Each target sequence has a mirror `Sequence` on the draft side. Before proposing, the mirror
takes the target's tokens and keeps the K/V of their longest common prefix with what the draft
computed (drafts the target rejected are recomputed over); then one draft step computes the new
tokens and proposes the first draft, and k - 1 single-token steps propose the rest. Greedy rows
propose the draft's argmax; sampled rows draw from the draft's distribution q (the target's
temperature and top-k / top-p / min-p applied to the draft's logits) and hand q to verification
(`take_probs`), whose rejection sampling then keeps the target's distribution exactly.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from pathlib import Path

import torch

from serving.engine.block_manager import BlockManager
from serving.engine.plan_builder import build_plan
from serving.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from serving.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from serving.engine_config import EngineConfig
from serving.executor.sampler import _truncate, _truncates, generator_seed
from serving.checkpoint.model_config import ModelArgs, read_json_object

logger = logging.getLogger(__name__)

_DRAFT_SEED_SALT = 0x5EED_D4AF  # a seeded row's draft stream differs from its target stream


def model_vocab_size(model_dir: str | Path) -> int:
    """The vocabulary size a checkpoint's config.json declares."""
    return ModelArgs.from_dict(read_json_object(Path(model_dir) / "config.json")).vocab_size


def check_draft_vocab(draft_dir: str | Path, target_dir: str | Path, tokenizers: tuple[object, object] | None = None
                      ) -> None:
    """ValueError unless the draft shares the target's vocabulary: the same vocab_size, and (when both
    tokenizers are given) the same token -> id map. Token ids pass between the two as they are."""
    dv, tv = model_vocab_size(draft_dir), model_vocab_size(target_dir)
    if dv != tv:
        raise ValueError(f"speculative_config: the draft model {str(draft_dir)!r} has a vocabulary of {dv} ids, the "
                         f"model {tv}: a draft must use the same tokenizer and vocabulary")
    if tokenizers is not None:
        draft_vocab, target_vocab = (t.get_vocab() for t in tokenizers)  # type: ignore[attr-defined]
        if draft_vocab != target_vocab:
            differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()))[:3]
            raise ValueError(f"speculative_config: the draft model's tokenizer maps tokens to other ids than the "
                             f"model's (e.g. {differ}): a draft must use the same tokenizer")


# The draft's KV cache holds as many sequences as may speculate at once (`disable_by_batch_size`,
# at most max_num_seqs) of up to this many tokens each; longer contexts fit fewer at once (the
# least recently proposing sequence's draft K/V is evicted, and recomputed when it proposes again).
# A 1B Llama draft: 8 x 8192 tokens x 32 KiB = 2 GiB.
DRAFT_KV_TOKENS_PER_SEQ = 8192


def draft_engine_config(config: EngineConfig, draft_dir: str | Path, target_dir: str | Path) -> EngineConfig:
    """The draft runner's options: the target's device, dtype and batch limits, one rank, no
    adapters or quantization of its own, the target's context length (or the shorter of the two
    checkpoints' when none is set), and a KV cache sized in blocks, not by free device memory (the
    target's cache is sized after it, around it)."""
    from dataclasses import replace

    length = config.max_model_len or min(
        ModelArgs.from_dict(read_json_object(Path(d) / "config.json")).max_position_embeddings
        for d in (draft_dir, target_dir))
    per_seq = -(-(min(length, DRAFT_KV_TOKENS_PER_SEQ) + 1) // config.block_size) + 1
    return replace(config, model=str(draft_dir), speculative_config=None, tensor_parallel_size=1,
                   enable_lora=False, quantization=None, tokenizer=None, max_model_len=length,
                   num_gpu_blocks_override=draft_seqs(config) * per_seq, distributed_executor_backend="uni")


def draft_seqs(config: EngineConfig) -> int:
    """Sequences the draft keeps K/V for at once: those that may speculate in one step."""
    spec = config.speculative_config
    assert spec is not None
    return min(config.max_num_seqs, spec.disable_by_batch_size)


def build_draft_proposer(config: EngineConfig, target_dir: str | Path, device: str) -> DraftModelProposer:
    """The draft of `config.speculative_config` loaded on `device` (rank 0's), its vocabulary checked."""
    import torch as _torch

    from serving.executor.model_runner import ModelRunner
    from serving.checkpoint.model_files import resolve_model_dir

    spec = config.speculative_config
    assert spec is not None and spec.model is not None, spec
    draft_dir = resolve_model_dir(spec.model, None)
    check_draft_vocab(draft_dir, target_dir)
    runner = ModelRunner(draft_engine_config(config, draft_dir, target_dir), draft_dir, device=_torch.device(device))
    logger.info("draft model %s on %s: %d KV blocks, max_model_len %d", draft_dir, device,
                runner.cache_config.num_blocks, runner.max_model_len)
    return DraftModelProposer(runner, draft_seqs(config), config.seed or 0)


class DraftModelProposer:
    """Proposes with a draft `ModelRunner` (a `Proposer`, serving/engine/speculator.py)."""

    def __init__(self, runner, max_num_seqs: int, seed: int = 0) -> None:  # noqa: ANN001 (ModelRunner)
        info = runner.info()
        self.runner = runner
        self.vocab_size = info.vocab_size
        self.max_model_len = info.cache.max_model_len
        self.blocks = BlockManager(info.cache.num_blocks, info.cache.block_size, False)
        self.max_num_seqs = max_num_seqs
        self._mirrors: OrderedDict[int, Sequence] = OrderedDict()  # target seq id -> draft side, LRU first
        self._forgotten: list[int] = []  # mirrors the draft runner drops with its next plan
        self._steps = itertools.count()
        self._generator = torch.Generator(device=runner.device).manual_seed(seed ^ _DRAFT_SEED_SALT)
        self._generators: dict[int, torch.Generator] = {}
        self._probs: dict[int, torch.Tensor] = {}  # target seq id -> q of its last proposal (sampled rows)

    def may_propose(self, seq: Sequence) -> bool:
        return True  # a draft model always has a guess

    def take_probs(self, seq_id: int) -> torch.Tensor | None:
        """The draft distributions `[k, V]` of the tokens last proposed for a sampled sequence."""
        return self._probs.pop(seq_id, None)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self.propose_many([seq], [k])[0]

    def propose_many(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Drafts for several sequences, their draft steps batched: one forward per draft position
        for all of them (and the catch-up chunks of their accepted tokens in the first)."""
        assert len(seqs) == len(ks) <= self.max_num_seqs, (len(seqs), len(ks))
        for seq in seqs:
            self._probs.pop(seq.seq_id, None)
        try:
            return self._propose_many(seqs, [min(k, self.max_model_len - len(s.token_ids)) for s, k in zip(seqs, ks)])
        except BaseException:
            self._reset()  # a step that failed half-way leaves the runner's mirrors unknown: start over
            raise

    def _reset(self) -> None:
        for mirror in self._mirrors.values():
            self.blocks.free(mirror)
        self._mirrors.clear()
        self._forgotten.clear()
        self._probs.clear()
        self.runner.reset()

    def _propose_many(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        live = [i for i, k in enumerate(ks) if k > 0]
        mirrors = {i: self._sync(seqs[i]) for i in live}
        batch = {id(m) for m in mirrors.values()}  # never evicted for one another
        budget = self.runner.max_num_batched_tokens
        for i in live:
            mirror = mirrors[i]
            while len(mirror.token_ids) - mirror.num_computed_tokens > budget:  # a long catch-up, in chunks
                if self._run([(mirror, budget)], False, batch) is None:
                    ks[i] = 0  # no room in the draft's cache even after evicting the others
                    break
        for _ in range(max(ks, default=0)):
            rows = [i for i in live if len(drafts[i]) < ks[i]]
            if not rows:
                break
            # One draft position for every sequence still drafting; several forwards only when the
            # first position's catch-up chunks exceed the token budget together.
            groups: list[list[int]] = [[]]
            used = 0
            for i in sorted(rows, key=lambda i: len(mirrors[i].token_ids) - mirrors[i].num_computed_tokens):
                n = len(mirrors[i].token_ids) - mirrors[i].num_computed_tokens
                if groups[-1] and used + n > budget:
                    groups.append([])
                    used = 0
                groups[-1].append(i)
                used += n
            for group in groups:
                chunks = [(mirrors[i], len(mirrors[i].token_ids) - mirrors[i].num_computed_tokens) for i in group]
                logits = self._run(chunks, True, batch)
                if logits is None:
                    for i in group:
                        ks[i] = len(drafts[i])  # no room in the draft's cache: it stops here
                    continue
                self._choose(group, logits, seqs, mirrors, drafts, probs)
        for i, q in enumerate(probs):
            if q:
                self._probs[seqs[i].seq_id] = torch.stack(q)
        return drafts

    def _choose(self, group: list[int], logits: torch.Tensor, seqs: list[Sequence], mirrors: dict[int, Sequence],
                drafts: list[list[int]], probs: list[list[torch.Tensor]]) -> None:
        """Each row's next draft: the argmax (greedy rows, one device sync for all), else a draw from q."""
        greedy = logits.argmax(dim=-1).tolist()
        for row, i in enumerate(group):
            params = seqs[i].params
            if params.greedy:
                token = greedy[row]
            else:
                scaled = logits[row : row + 1] / float(params.temperature)
                if _truncates(params):
                    scaled = _truncate(scaled, [params])
                q = torch.softmax(scaled, dim=-1)[0]
                token = int(torch.multinomial(q, 1, generator=self._generator_for(seqs[i])))
                probs[i].append(q)
            mirrors[i].token_ids.append(token)
            drafts[i].append(token)

    def _run(self, chunks: list[tuple[Sequence, int]], sample: bool, batch: set[int]) -> torch.Tensor | None:
        """One draft forward computing `num_new` more tokens of each mirror (single-token chunks
        first, as the runner expects): the logits after each when `sample`, in `chunks` order (the
        caller's order has them first already: sorted by length); None when the cache has no room."""
        if not all(self._grow(mirror, n, batch) for mirror, n in chunks):
            return None
        items = [ScheduledSequence(mirror, n, sample, mirror.num_computed_tokens) for mirror, n in chunks]
        num_decodes = sum(1 for _, n in chunks if n == 1)
        assert all(n == 1 for _, n in chunks[:num_decodes]), "single-token chunks first"
        plan = build_plan(next(self._steps), SchedulerOutput(items, num_decodes, [], 0), self._forgotten)
        self._forgotten = []
        logits = self.runner.draft_logits(plan)
        for mirror, n in chunks:
            mirror.num_computed_tokens += n
        return logits

    def forget(self, seq_id: int) -> None:
        """The target sequence ended: its mirror, blocks and draft-side state go."""
        mirror = self._mirrors.pop(seq_id, None)
        self._generators.pop(seq_id, None)
        self._probs.pop(seq_id, None)
        if mirror is not None:
            self._drop(mirror)

    def _drop(self, mirror: Sequence) -> None:
        self.blocks.free(mirror)
        if mirror.in_worker:
            self._forgotten.append(mirror.seq_id)

    def _sync(self, seq: Sequence) -> Sequence:
        """`seq`'s mirror holding its tokens, K/V kept for their common prefix with what was computed."""
        ids = seq.token_ids
        assert ids[-1] != PLACEHOLDER and not seq.num_drafts, f"seq {seq.seq_id}: proposing with tokens unresolved"
        mirror = self._mirrors.get(seq.seq_id)
        if mirror is None:
            while len(self._mirrors) >= self.max_num_seqs:  # the draft runner holds as many rows as the target
                self._drop(self._mirrors.popitem(last=False)[1])
            mirror = Sequence(seq.seq_id, seq.request_id, list(seq.prompt_token_ids), seq.params, seq.index)
            mirror.status = SequenceStatus.RUNNING
            self._mirrors[seq.seq_id] = mirror
        else:
            self._mirrors.move_to_end(seq.seq_id)
        old = mirror.token_ids
        keep = min(mirror.num_computed_tokens, len(ids))
        if old[:keep] != ids[:keep]:
            keep = next(i for i, (a, b) in enumerate(zip(old, ids)) if a != b)
        mirror.token_ids = list(ids)
        mirror.num_computed_tokens = keep
        mirror.num_synced = min(mirror.num_synced, keep)
        return mirror

    def _grow(self, mirror: Sequence, num_new: int, keep: set[int]) -> bool:
        """Slots for `num_new` more tokens of `mirror`, evicting least recently used mirrors (none of
        `keep`, ids of this batch's mirrors) if need be."""
        bm = self.blocks
        while not (bm.can_append(mirror, num_new) if mirror.block_table else bm.can_allocate(mirror, num_new)):
            victim = next((m for m in self._mirrors.values() if id(m) not in keep and m.block_table), None)
            if victim is None:
                return False
            self._drop(victim)
            victim.num_computed_tokens = victim.num_synced = 0
            victim.in_worker = False
        if mirror.block_table:
            bm.append_slots(mirror, num_new)
        else:
            assert mirror.num_computed_tokens == 0, mirror.num_computed_tokens
            bm.allocate(mirror, num_new)
        return True

    def _generator_for(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self._generator
        g = self._generators.get(seq.seq_id)
        if g is None:
            g = torch.Generator(device=self.runner.device).manual_seed(
                generator_seed(seq.params.seed, seq.index) ^ _DRAFT_SEED_SALT)
            self._generators[seq.seq_id] = g
        return g
