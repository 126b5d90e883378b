"""ModelRunner: one worker's device, model shard and weights, its KV cache tensor, sampling.

In: an `EngineConfig` at start; a `StepPlan` per step, applied to the worker's `BatchState`
mirror of the running sequences. Out: a `StepOutput` with one `SampledToken` per chunk that
samples (under tensor parallelism rank 0 samples and broadcasts the ids to the other ranks). At start it resolves the model dir, picks device and
dtype, builds and loads the model, sizes the KV cache (CPU: `kv_cache_memory_gb`; GPU:
`gpu_memory_utilization` after a profiling forward; `num_gpu_blocks_override` wins) and
allocates it once: `[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]`.
`_forward(input_ids, positions, meta)` is the seam a decode CUDA-graph runner wraps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

import kernels
from serving.executor.attention_metadata import AttentionMetadata, forward_context
from serving.executor.cuda_graphs import DecodeGraphRunner
from serving.executor.mixed_graphs import MixedGraphRunner
from serving.executor.lora import LoRAManager
from serving.engine_config import CacheConfig, EngineConfig
from serving.checkpoint.model_files import resolve_model_dir
from serving.executor.models import build_model
from serving.executor import parallel
from serving.checkpoint.model_args import check_supported, eos_token_ids, read_json_object
from serving.checkpoint.model_args import ModelArgs
from serving.executor.sampler import Sampler, generator_seed, to_device
from serving.executor.batch_state import BatchState, WorkerSeq
from serving.executor.plan import ExecutorInfo, SampledToken, StepOutput, StepPlan
from serving.executor.spec_verify import accept_all_drafts, verify_drafts
from serving.executor.step_inputs import StepInputs, prepare_inputs
from serving.executor.teardown import release_module, release_tensor
from serving.executor.weights import init_dummy_weights, load_weights
from serving.executor.models.linear import Linear
from serving.executor.models import weight_prefetch
from serving.executor.quant import check_device, link_fp8_rows
from serving.checkpoint.quantization import resolve_quantization

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Steps with prompt tokens up to this many replay mixed-step graphs; longer ones run eagerly,
# where launch cost is small beside the compute.
MIXED_GRAPH_MAX_TOKENS = 2048
_LOGITS_CHUNK = 256  # rows per lm_head call when prompt logprobs need many rows


class ModelRunner:
    """Runs the model for the scheduler; see the module docstring for what it owns."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str | Path | None = None,
        device: torch.device | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        t0 = time.monotonic()
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.model_dir = Path(model_dir) if model_dir is not None else resolve_model_dir(config.model, config.revision)
        raw = read_json_object(self.model_dir / "config.json")
        check_supported(raw)
        self.model_args = args = ModelArgs.from_dict(raw)
        self.device = device if device is not None else pick_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = _pick_dtype(config.dtype, args.torch_dtype, self.device)
        self.eos_token_ids = eos_token_ids(self.model_dir, args)
        self.block_size = config.block_size
        self.vocab_size = args.vocab_size
        self.num_kv_heads = parallel.kv_heads_per_rank(args, world_size, rank)
        self.max_model_len = _max_model_len(config.max_model_len, args, self._kv_tokens_in_device_memory())
        self.max_num_batched_tokens = config.token_budget(self.max_model_len)
        self.batch = BatchState(config.max_num_seqs, min(1024, -(-self.max_model_len // self.block_size)), self.device)
        self._prev: StepOutput | None = None
        self._deferred: tuple | None = None  # a launched step waiting for its guided masks
        self.quant = resolve_quantization(self.model_dir, raw, config.quantization)
        check_device(self.quant, self.device)
        # RoPE caches hold max_model_len rows (context_len); frequencies still follow the config's maximum.
        self.model = build_model(args, self.dtype, self.device, max(self.max_model_len, args.max_position_embeddings),
                                 quant=self.quant, context_len=self.max_model_len)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, seed=config.seed)
        else:
            load_weights(self.model, self.model_dir)
        # Linked after the first eager forward on CUDA, from the order it ran the layers: under TP, the L2
        # hints (decode steps warm L2 with the weight read after each fused all-reduce + norm,
        # models/weight_prefetch.py); FP8 linears' activation rows written by the ops before them (quant/fp8.py).
        self._link_after_trace = (self.device.type == "cuda"
                                  and kernels.use_triton(torch.empty(0, device=self.device)))
        # Multi-LoRA: wrap the adapted projections, allocate the slots (before the KV cache is sized).
        self.lora = LoRAManager(self.model, config, args, max(self.max_num_batched_tokens, config.max_num_seqs)
                                ) if config.enable_lora else None
        self.sampler = Sampler(self.device, seed=config.seed, eos_token_ids=self.eos_token_ids)
        self._generators: dict[int, torch.Generator] = {}
        self._prompt_logprobs: dict[int, list[float | None]] = {}
        # Benchmark only: verification accepts every draft (`accept_all_drafts`). Set on the runner object
        # by bench/speculative.py to time all-accepted verify steps; nothing in a config reaches it.
        self._accept_all_drafts = False
        self.graph_runner: DecodeGraphRunner | None = None  # set after the KV cache exists
        self.mixed_graphs: MixedGraphRunner | None = None  # steps with prompt tokens, idem
        num_blocks = parallel.min_over_ranks(self._num_kv_blocks(), self.device)  # every rank holds as many
        parallel.enable_fused_norm(self.dtype)  # a collective, before graph capture; off on one rank
        self.kv_cache = self._allocate_kv_cache(num_blocks)
        self.cache_config = CacheConfig(
            block_size=self.block_size, num_blocks=num_blocks, num_layers=args.num_hidden_layers,
            num_kv_heads=self.num_kv_heads, head_dim=args.head_dim,
            dtype=str(self.dtype).removeprefix("torch."), max_model_len=self.max_model_len,
        )
        logger.info(
            "model %s (%s) on %s in %s, weights %s, loaded in %.1f s; KV cache: %d blocks x %d tokens = %d max "
            "concurrent tokens (%.2f GiB)", self.model_dir, args.architecture, self.device, self.cache_config.dtype,
            self.quant.describe() if self.quant else "unquantized", time.monotonic() - t0,
            num_blocks, self.block_size, num_blocks * self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
        )
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graph_runner = self._capture_decode_graphs()
            self.mixed_graphs = self._capture_mixed_graphs()

    def info(self, devices: tuple[str, ...] = ()) -> ExecutorInfo:
        """What the engine needs from this worker's model (the KV block count is already the
        minimum over ranks)."""
        return ExecutorInfo(
            model_dir=str(self.model_dir), cache=self.cache_config, vocab_size=self.vocab_size,
            eos_token_ids=tuple(self.eos_token_ids),
            device_type=self.device.type, devices=devices or (str(self.device),),
            step_sizes=tuple(self.mixed_graphs.buckets) if self.mixed_graphs is not None else (),
        )

    # ---- KV cache ------------------------------------------------------------------------

    def kv_block_bytes(self) -> int:
        a = self.model_args
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * a.num_hidden_layers * self.block_size * self.num_kv_heads * a.head_dim * elem

    def _kv_tokens_in_device_memory(self) -> int:
        """Tokens whose KV would fill the whole device (GPU memory, or the host's RAM on the CPU):
        no sequence can be longer, whatever the config's max_position_embeddings says."""
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return max(1, total // self.kv_block_bytes()) * self.block_size

    def _num_kv_blocks(self) -> int:
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        if self.device.type == "cuda":
            budget = self._profile_free_gpu_bytes()
        else:
            budget = int(self.config.kv_cache_memory_gb * 2**30)
        num_blocks = budget // self.kv_block_bytes()
        if num_blocks < 1:
            raise RuntimeError(f"no memory left for the KV cache (budget {budget / 2**30:.2f} GiB); "
                               "raise gpu_memory_utilization / kv_cache_memory_gb or use a smaller model")
        return int(num_blocks)

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        a = self.model_args
        # Zeroed, not empty: attention reads whole blocks and masks the tail, and 0 * NaN
        # garbage in a never-written slot would still poison the weighted sum.
        kv = torch.zeros(2, a.num_hidden_layers, num_blocks, self.block_size, self.num_kv_heads, a.head_dim,
                         dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.model.attention_layers):
            layer.bind_kv_cache(kv[0, i], kv[1, i])
        return kv

    @torch.inference_mode()
    def _profile_free_gpu_bytes(self) -> int:
        """Bytes left for KV after a forward at max_num_batched_tokens (style.md §11 formula)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.max_num_batched_tokens
        seq_len = min(num_tokens, self.max_model_len)
        num_seqs = (num_tokens + seq_len - 1) // seq_len
        blocks_per_seq = (seq_len + self.block_size - 1) // self.block_size
        tmp = self._allocate_kv_cache(num_seqs * blocks_per_seq)  # scratch cache for the profile run
        lens = [min(seq_len, num_tokens - i * seq_len) for i in range(num_seqs)]
        qsl = torch.tensor([0] + lens, device=self.device).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32, device=self.device)
            .view(num_seqs, blocks_per_seq),
            num_decodes=0, num_decode_tokens=0, max_query_len=seq_len, max_seq_len=seq_len,
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in lens])
        hidden = self._forward(ids, pos, meta)
        rows = min(num_tokens, self.config.max_num_seqs)
        self.model.compute_logits(hidden[:rows]).softmax(-1)
        torch.cuda.synchronize()
        for layer in self.model.attention_layers:
            layer.bind_kv_cache(torch.empty(0), torch.empty(0))
        del tmp, hidden, meta
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        current = torch.cuda.memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        budget = int(total * self.config.gpu_memory_utilization - used - (peak - current))
        logger.info("GPU memory: total %.1f GiB, used %.1f GiB, profile peak %.2f GiB over %.2f GiB -> "
                    "%.2f GiB for KV", total / 2**30, used / 2**30, peak / 2**30, current / 2**30, budget / 2**30)
        return budget

    def _capture_decode_graphs(self) -> DecodeGraphRunner:
        # Graphs call the model directly: the graph runner sets the forward context itself.
        t0 = time.monotonic()
        runner = DecodeGraphRunner(
            self._model_forward, self.config.max_num_seqs,
            (self.max_model_len + self.block_size - 1) // self.block_size, self.model_args.hidden_size,
            self.max_model_len, self.device, compute_logits=self.model.compute_logits, vocab_size=self.vocab_size,
            logits_dtype=self.dtype if self.world_size == 1 else torch.float32,
        )
        runner.capture()
        if runner.logits is not None and runner.logits.dtype != torch.float32:
            # The plain sampler reads these logits in their own dtype, and Triton compiles one
            # sampling kernel per dtype: compile this one now, not in a user's first unseeded
            # sampled step (the engine's warm-up samples seeded rows, read as float32).
            kernels.gumbel_sample(runner.logits[:1], torch.ones(1, device=self.device),
                                  torch.zeros(1, dtype=torch.int64, device=self.device))
        logger.info("decode CUDA graphs captured in %.1f s", time.monotonic() - t0)
        return runner

    def _capture_mixed_graphs(self) -> MixedGraphRunner:
        runner = MixedGraphRunner(
            self._model_forward, min(self.max_num_batched_tokens, MIXED_GRAPH_MAX_TOKENS), self.config.max_num_seqs,
            (self.max_model_len + self.block_size - 1) // self.block_size, self.device)
        runner.capture()
        return runner

    # ---- per step ------------------------------------------------------------------------

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states `[num_tokens, hidden]` for one step (a graph runner may replace this)."""
        return self._run_model(input_ids, positions, meta)[0]

    def _run_model(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states, and the logits of every row when a decode graph computed them too."""
        graphs = self.graph_runner
        if graphs is not None and meta.num_prefills == 0 and graphs.can_run(meta.num_seqs, meta.block_tables.shape[1]):
            hidden = graphs.run(input_ids, positions, meta)
            return hidden, None if graphs.logits is None else graphs.logits[: hidden.shape[0]]
        mixed = self.mixed_graphs
        if mixed is not None and mixed.can_run(input_ids.shape[0], meta.num_seqs, meta.block_tables.shape[1]):
            return mixed.run(input_ids, positions, meta), None
        with forward_context(meta):
            return self._model_forward(input_ids, positions), None

    def _model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model's forward (through the LoRA manager, which reads the staged row slots)."""
        link = self._link_after_trace and not torch.cuda.is_current_stream_capturing()
        with weight_prefetch.tracing() if link else contextlib.nullcontext() as trace:
            hidden = (self.model(input_ids, positions) if self.lora is None
                      else self.lora.forward(self.model, input_ids, positions))
        if link:  # the first eager forward: its run order links the hints and the FP8 rows, once
            self._link_after_trace = False
            if self.world_size > 1:
                linked = weight_prefetch.link_l2_hints(trace, Linear, weight_prefetch.prefetch_bytes(self.world_size))
                logger.info("L2 weight hints: %d all-reduce launches warm the next weight", linked)
            linked = link_fp8_rows(trace, Linear)
            if linked:
                logger.info("FP8 activations: %d norms / SwiGLUs write the rows their FP8 linear reads", linked)
        return hidden

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Launch one step: inputs, forward, logits of sampled rows, sampling; never waits for the GPU.

        Decode rows holding a placeholder take the id this worker's previous step sampled, on
        the device. The returned output resolves to host tokens on first access of `.sampled`
        (prompt logprobs, when asked for, are the one synchronous exception).
        """
        assert self._deferred is None, "the previous step still waits for its guided masks"
        seqs = self.batch.apply(plan)
        for seq_id in plan.finished_seq_ids:
            self.free_sequence(seq_id)
        prev, self._prev = self._prev, None
        if plan.is_empty:
            return StepOutput([])
        if self.lora is not None:  # fill the slots this step needs, then each row's slot
            self.lora.apply_loads(plan.lora_loads)
            self.lora.stage(plan.lora_slots, plan.num_tokens)
        inputs = prepare_inputs(plan, self.batch, self.block_size, self.device, prev, graphs=self.graph_runner)
        hidden, all_logits = self._run_model(inputs.input_ids, inputs.positions, inputs.meta)
        if inputs.prompt_logprob_chunks:
            self._collect_prompt_logprobs(seqs, inputs, hidden)
        sampled_chunks = np.flatnonzero(np.array(plan.sample, dtype=bool))
        num_sampled = sampled_chunks.shape[0]
        if not num_sampled:
            return StepOutput([])
        rows = inputs.batch_rows[sampled_chunks]  # the input-batch row of each sampled entry
        logits = self._sampled_logits(inputs, hidden, all_logits, num_sampled)
        if self.rank != 0:
            # Rank 0 samples; the others take its ids (inputs of their next step's placeholders).
            token_ids = torch.empty(num_sampled, dtype=torch.long, device=self.device)
            parallel.broadcast_from_driver(token_ids)
            self._prev = StepOutput([], token_ids=token_ids, rows=rows)
            return self._prev
        sampled_ids = [plan.seq_ids[i] for i in sampled_chunks.tolist()] if self._prompt_logprobs else []
        prompt_logprobs = {i: self._prompt_logprobs.pop(i) for i in sampled_ids if i in self._prompt_logprobs}
        batch = self.batch.input_batch
        if plan.num_drafts:
            return self._verify_step(plan, seqs, sampled_chunks, rows, logits, sampled_ids, prompt_logprobs)

        def sample(masks: tuple[list[int], object] | None) -> StepOutput:
            try:
                if batch.plain[rows].all():  # the common batch: from the rows' columns
                    samples = self.sampler.sample_plain(logits, batch.inv_temperature[rows], masks=masks)
                else:
                    sampled_seqs = [seqs[i] for i in sampled_chunks.tolist()]
                    samples = self.sampler.sample(logits, sampled_seqs, [self._generator(s) for s in sampled_seqs],
                                                  masks=masks)
            finally:
                if self.world_size > 1:  # the other ranks wait in the broadcast even if sampling failed
                    ids = samples.token_ids if "samples" in locals() else torch.zeros(
                        num_sampled, dtype=torch.long, device=self.device)
                    parallel.broadcast_from_driver(ids)

            def resolve() -> list[SampledToken]:
                out = samples.tokens()
                for i, seq_id in enumerate(sampled_ids) if prompt_logprobs else ():
                    out[i].prompt_logprobs = prompt_logprobs.get(seq_id)
                return out

            self._prev = StepOutput(resolve=resolve, token_ids=samples.token_ids, rows=rows)
            return self._prev

        masks = _mask_rows(plan)
        if masks is not None and masks[1] is None:
            # Deferred guided masks: the engine fills them while this forward runs on the device
            # and hands them to `sample_deferred` before the next step (one rank only).
            assert self.world_size == 1, "deferred guided-decoding masks need a single rank"
            held: list[StepOutput] = []
            out = StepOutput(resolve=lambda: held[0].sampled, rows=rows)
            self._deferred = (sample, masks[0], held, out)
            return out
        return sample(masks)

    def _sampled_logits(self, inputs: StepInputs, hidden: torch.Tensor, all_logits: torch.Tensor | None,
                        num_sampled: int) -> torch.Tensor:
        """The logits of the sampled rows, `[len(inputs.sample_rows), vocab]` (`num_sampled` chunks: one row
        each, k+1 for a chunk verifying k drafts)."""
        if all_logits is None:
            sampled_hidden = hidden[inputs.sample_rows]
            if self.world_size == 1 and self.device.type == "cuda":
                # As in the decode graphs: the matmul's own bf16/fp16 output, which the samplers upcast as
                # they read it (a float32 copy of 256 x 128,256 logits costs ~54 us on an H100).
                # (one row per sampling chunk, k+1 per verifying chunk: `sample_rows` says which)
                return self.model.compute_logits(sampled_hidden, out=torch.empty(
                    (sampled_hidden.shape[0], self.vocab_size), dtype=self.dtype, device=self.device))
            return self.model.compute_logits(sampled_hidden)  # [num_sampled, vocab] float32
        if num_sampled == all_logits.shape[0]:  # the decode graph's logits (one rank: the model's dtype)
            return all_logits  # every row samples (the usual decode step): no gather
        return all_logits[inputs.sample_rows]

    @torch.inference_mode()
    def draft_logits(self, plan: StepPlan, prev: StepOutput | None = None) -> tuple[torch.Tensor, StepOutput]:
        """One step of a draft model (serving/engine/draft_proposer.py): the logits at each sampling
        chunk's last row, `[num_sampled, vocab]` float32, and their argmax as a `StepOutput` (ids on the
        device, never read here: no host sync) whose ids a next draft step's PLACEHOLDER rows take when
        handed back as `prev`. Nothing is sampled; one rank, no adapters."""
        assert self.world_size == 1 and self.lora is None and not plan.num_drafts, "a draft model runs alone"
        self.batch.apply(plan)
        for seq_id in plan.finished_seq_ids:
            self.free_sequence(seq_id)
        num_sampled = sum(plan.sample)
        if plan.is_empty or not num_sampled:
            if not plan.is_empty:  # a chunk that only writes its K/V
                inputs = prepare_inputs(plan, self.batch, self.block_size, self.device, prev)
                self._run_model(inputs.input_ids, inputs.positions, inputs.meta)
            empty = torch.empty((0, self.vocab_size), device=self.device)
            return empty, StepOutput([], token_ids=torch.empty(0, dtype=torch.long, device=self.device),
                                     rows=np.empty(0, dtype=np.int64))
        inputs = prepare_inputs(plan, self.batch, self.block_size, self.device, prev)
        hidden, all_logits = self._run_model(inputs.input_ids, inputs.positions, inputs.meta)
        logits = self._sampled_logits(inputs, hidden, all_logits, num_sampled).float()
        rows = inputs.batch_rows[np.flatnonzero(np.array(plan.sample, dtype=bool))]
        return logits, StepOutput([], token_ids=logits.argmax(dim=-1), rows=rows)

    def _verify_step(self, plan: StepPlan, seqs: list[WorkerSeq], sampled_chunks: np.ndarray, rows: np.ndarray,
                     logits: torch.Tensor, sampled_ids: list[int], prompt_logprobs: dict) -> StepOutput:
        """Sample a step with verifying chunks (`plan.num_drafts`): plain rows as usual, each verifying
        chunk's k+1 rows through `verify_drafts`; waits for the device (the engine reads it at once)."""
        chunks = sampled_chunks.tolist()
        plain: list[tuple[int, int]] = []  # (chunk, logits row)
        groups: list[tuple[int, int, int]] = []  # (chunk, first logits row, drafts)
        r = 0
        for c in chunks:
            k = plan.num_drafts.get(c, 0)
            if k:
                groups.append((c, r, k))
            else:
                plain.append((c, r))
            r += k + 1
        assert r == logits.shape[0], (r, logits.shape)
        out: dict[int, SampledToken] = {}
        try:
            if plain:
                masks = _mask_rows(plan)
                if masks is not None:  # guided rows (never verifying): keyed by their place among `plain`
                    at = {chunks.index(c): j for j, (c, _) in enumerate(plain)}
                    masks = ([at[m] for m in masks[0]], masks[1])
                plain_seqs = [seqs[c] for c, _ in plain]
                idx = torch.tensor([row for _, row in plain], dtype=torch.long, device=logits.device)
                tokens = self.sampler.sample(logits[idx], plain_seqs, [self._generator(s) for s in plain_seqs],
                                             masks=masks).tokens()
                out.update(zip((c for c, _ in plain), tokens))
            for c, r0, k in groups:
                seq = seqs[c]
                start = plan.starts[c] + plan.num_tokens[c] - k
                drafts, generator = seq.token_ids[start : start + k], self._generator(seq) or self.sampler.generator
                if self._accept_all_drafts:
                    tokens = accept_all_drafts(logits[r0 : r0 + k + 1], drafts, seq.params, generator)
                else:
                    tokens = verify_drafts(logits[r0 : r0 + k + 1], drafts, seq.params, generator,
                                           plan.draft_probs.get(c))
                tokens[0].following = tokens[1:]
                out[c] = tokens[0]
        finally:
            ids = torch.tensor([out[c].token_id if c in out else 0 for c in chunks], dtype=torch.long,
                               device=self.device)
            if self.world_size > 1:  # the other ranks wait in the broadcast even if sampling failed
                parallel.broadcast_from_driver(ids)
        sampled = [out[c] for c in chunks]
        for i, seq_id in enumerate(sampled_ids) if prompt_logprobs else ():
            sampled[i].prompt_logprobs = prompt_logprobs.get(seq_id)
        self._prev = StepOutput(sampled, token_ids=ids, rows=rows)
        return self._prev

    @torch.inference_mode()
    def sample_deferred(self, masks: object) -> None:
        """Sample the step launched without its guided masks (`StepPlan.masks` None), with them now."""
        assert self._deferred is not None, "no step waits for its masks"
        sample, rows, held, out = self._deferred
        self._deferred = None
        held.append(sample((rows, masks)))
        out.token_ids = held[0].token_ids

    def _generator(self, seq) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        g = self._generators.get(seq.seq_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(generator_seed(seq.params.seed, seq.index))
            self._generators[seq.seq_id] = g
        return g

    def _collect_prompt_logprobs(self, seqs: list[WorkerSeq], inputs: StepInputs, hidden: torch.Tensor) -> None:
        """Logprob of each next prompt token, from the raw logits (no penalties, temperature 1).

        Kept per sequence across prefill chunks; handed out with its first sampled token.
        Positions served from the prefix cache are never computed and stay None.
        """
        for entry, row0, n, start in inputs.prompt_logprob_chunks:
            seq = seqs[entry]
            buf = self._prompt_logprobs.setdefault(seq.seq_id, [None] * seq.num_prompt_tokens)
            # Row j predicts prompt token start + j + 1; the last prompt row predicts the output.
            count = min(n, seq.num_prompt_tokens - 1 - start)
            for c0 in range(0, max(count, 0), _LOGITS_CHUNK):
                c1 = min(count, c0 + _LOGITS_CHUNK)
                lp = torch.log_softmax(self.model.compute_logits(hidden[row0 + c0 : row0 + c1]), dim=-1)
                targets = to_device(seq.token_ids[start + c0 + 1 : start + c1 + 1], torch.long, lp.device)
                values = lp.gather(1, targets[:, None])[:, 0].tolist()
                buf[start + c0 + 1 : start + c1 + 1] = values

    def reset(self) -> None:
        """Forget all per-sequence state (after a failed step every sequence is recomputed)."""
        self.batch.clear()
        self._prev = None
        self._deferred = None
        self._generators.clear()
        self._prompt_logprobs.clear()

    def free_sequence(self, seq_id: int) -> None:
        """Forget a finished sequence: its mirror and row, seeded generator and partial prompt logprobs."""
        self.batch.forget(seq_id)
        self._generators.pop(seq_id, None)
        self._prompt_logprobs.pop(seq_id, None)

    def close(self) -> None:
        """Give the device memory back: CUDA graphs and their pool, weights, KV cache, batch and
        sampler state, even while something still holds the runner (it cannot run afterwards).

        Also breaks the one reference cycle of a runner: its graphs call back into its forward.
        Safe on a runner whose constructor failed half-way.
        """
        state = vars(self)
        device = state.get("device")
        if device is not None and device.type == "cuda":
            with contextlib.suppress(RuntimeError):  # a failed device: free what can be freed anyway
                torch.cuda.synchronize(device)  # nothing in flight reads what is freed below
        if state.get("graph_runner") is not None:
            self.graph_runner.close()
        if state.get("mixed_graphs") is not None:
            self.mixed_graphs.close()
        if device is not None and device.type == "cuda":
            # cuBLAS keeps a workspace per stream for the process, and the one first used in a graph
            # capture was allocated from the graph's pool, which could then never go back (PyTorch's
            # own CUDA-graph trees clear them too; a private call, hence the guard).
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
        if state.get("model") is not None:
            release_module(self.model)  # weights, and the attention layers' views of the KV cache
        if state.get("kv_cache") is not None:
            release_tensor(self.kv_cache)
        state.clear()  # the batch mirror, sampler, last step's output: whatever else is on the device
        if device is not None and device.type == "cuda":
            # Hand the freed blocks back to the device, not just to this process's caching allocator:
            # an engine built next with worker processes (tensor parallelism, replicas) or any other
            # process sizes its KV cache from the device's free memory, which still counted them.
            torch.cuda.empty_cache()


def _mask_rows(plan: StepPlan) -> tuple[list[int], object] | None:
    """The plan's guided-decoding masks, keyed by sampled row (chunk index -> row among sampling chunks)."""
    if not plan.mask_chunks:
        return None
    row_of_chunk, row = {}, 0
    for chunk, flag in enumerate(plan.sample):
        if flag:
            row_of_chunk[chunk] = row
            row += 1
    return [row_of_chunk[c] for c in plan.mask_chunks], plan.masks


def pick_device(option: str) -> torch.device:
    if option == "cuda" or (option == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was asked for but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pick_dtype(option: str, model_dtype: str | None, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU; on GPU the checkpoint's dtype, with float32 checkpoints run in bf16."""
    if option != "auto":
        return _DTYPES[option]
    if device.type == "cpu":
        return torch.float32
    dtype = _DTYPES.get(str(model_dtype).removeprefix("torch."), torch.bfloat16)
    return torch.bfloat16 if dtype == torch.float32 else dtype


def _max_model_len(option: int | None, args: ModelArgs, memory_tokens: int) -> int:
    """option.max_model_len, else the config's max_position_embeddings, capped at `memory_tokens`
    (the longest sequence whose KV fits the device): a config claiming 10**12 positions must not
    size RoPE tables and block tables for them."""
    limit = args.max_position_embeddings
    if option is not None and option > limit:
        raise ValueError(f"max_model_len {option} exceeds the model's max_position_embeddings {limit}")
    if option is None and limit > memory_tokens:
        logger.warning("max_position_embeddings=%d is more tokens than the KV cache of one sequence could hold in "
                       "this device's memory (%d): serving max_model_len=%d (set option.max_model_len to choose)",
                       limit, memory_tokens, memory_tokens)
        return memory_tokens
    return option or limit
