"""Test helper: greedy generation through one model shard's paged-attention path, and a TP worker.

`greedy_logits(model_dir, prompts, decode_steps)` builds the model for this process's tensor-
parallel shard (single process unless `init_tensor_parallel` ran), loads the checkpoint, and
drives it without the runner or scheduler, building `AttentionMetadata` itself: all prompts
but the last prefilled together in chunks, then decode steps where the first also prefills
the last prompt whole (a mixed decode + prefill step). KV blocks are handed out shuffled, so
block tables are scattered. Returns the logits of every computed row per prompt and the
greedy tokens. `tp_worker` is the `torch.multiprocessing.spawn` entry that runs it on one rank
of a gloo group and saves what it got.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serving.executor import parallel
from serving.executor.attention_metadata import AttentionMetadata, forward_context
from serving.executor.models import build_model
from serving.executor.weights import load_weights
from serving.checkpoint.model_config import ModelArgs
from serving.checkpoint.quantization import resolve_quantization


@dataclass
class _Seq:
    tokens: list[int]
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


def _meta(work: list[tuple[_Seq, int]], block_size: int, free: list[int]) -> tuple[torch.Tensor, ...]:
    """input_ids, positions and metadata of one step; `work` lists decodes (1 token) first."""
    ids, pos, slots, lens = [], [], [], []
    for seq, n in work:
        while len(seq.blocks) * block_size < seq.computed + n:
            seq.blocks.append(free.pop())
        span = range(seq.computed, seq.computed + n)
        ids += seq.tokens[seq.computed : seq.computed + n]
        pos += span
        slots += [seq.blocks[p // block_size] * block_size + p % block_size for p in span]
        lens.append(seq.computed + n)
    width = max(len(s.blocks) for s, _ in work)
    num_decodes = sum(1 for _, n in work if n == 1)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0] + [n for _, n in work]).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s, _ in work], dtype=torch.int32),
        num_decodes=num_decodes, num_decode_tokens=num_decodes,
        max_query_len=max(n for _, n in work), max_seq_len=max(lens),
    )
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), meta


@torch.inference_mode()
def greedy_logits(
    model_dir: str | Path, prompts: list[list[int]], decode_steps: int, block_size: int = 4, chunk: int = 8
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Per prompt: logits [computed rows, vocab] float32, and prompt + greedy tokens."""
    args = ModelArgs.from_dir(model_dir)
    quant = resolve_quantization(model_dir, json.loads((Path(model_dir) / "config.json").read_text()), None)
    model = build_model(args, torch.float32, torch.device("cpu"), quant=quant)
    load_weights(model, model_dir)
    num_blocks = sum(len(p) + decode_steps + block_size for p in prompts) // block_size + 1
    kv = torch.zeros(2, args.num_hidden_layers, num_blocks, block_size, model.num_kv_heads_per_rank, args.head_dim)
    for i, layer in enumerate(model.attention_layers):
        layer.bind_kv_cache(kv[0, i], kv[1, i])
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    seqs = [_Seq(list(p)) for p in prompts]

    def step(work: list[tuple[_Seq, int]]) -> None:
        work = sorted(work, key=lambda w: w[1] != 1)  # one-token rows are decodes: they go first
        ids, pos, meta = _meta(work, block_size, free)
        with forward_context(meta):
            logits = model.compute_logits(model(ids, pos))
        row = 0
        for seq, n in work:
            seq.logits.append(logits[row : row + n])
            seq.computed += n
            row += n

    while any(s.computed < len(s.tokens) for s in seqs[:-1]):
        step([(s, min(chunk, len(s.tokens) - s.computed)) for s in seqs[:-1] if s.computed < len(s.tokens)])
    last = seqs[-1]
    for i in range(decode_steps):
        for s in seqs if i else seqs[:-1]:
            s.tokens.append(int(s.logits[-1][-1].argmax()))
        step([(s, 1) for s in seqs[:-1]] + [(last, len(last.tokens) if i == 0 else 1)])
    return [torch.cat(s.logits) for s in seqs], [s.tokens for s in seqs]


def tp_worker(rank: int, world_size: int, init_file: str, model_dir: str, prompts: list[list[int]],
              decode_steps: int, out_dir: str) -> None:
    """One rank: join a gloo group through `init_file`, run `greedy_logits`, save `rank{r}.pt`."""
    torch.set_num_threads(1)  # ranks share the machine's cores
    parallel.init_tensor_parallel(rank, world_size, f"file://{init_file}", "gloo")
    try:
        logits, tokens = greedy_logits(model_dir, prompts, decode_steps)
        torch.save({"logits": logits, "tokens": tokens}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        parallel.destroy_tensor_parallel()


def tp_worker_many(rank: int, world_size: int, init_file: str, model_dirs: list[str], prompts: list[list[int]],
                   decode_steps: int, out_dir: str) -> None:
    """`tp_worker` over several checkpoints in one process group: saves `rank{r}_{i}.pt` per model i."""
    torch.set_num_threads(1)
    parallel.init_tensor_parallel(rank, world_size, f"file://{init_file}", "gloo")
    try:
        for i, model_dir in enumerate(model_dirs):
            logits, tokens = greedy_logits(model_dir, prompts, decode_steps)
            torch.save({"logits": logits, "tokens": tokens}, Path(out_dir) / f"rank{rank}_{i}.pt")
    finally:
        parallel.destroy_tensor_parallel()
