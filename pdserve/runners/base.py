"""What both model runners share: the model, the KV cache, the forward pass and sampling.

Under pipeline parallelism each rank runs its stage's layers: it receives the previous stage's
activations, sends its own on, and the last stage samples; the output rank's tokens then reach
every rank, so that every runner appends the same tokens to its requests.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from pdserve.config import EngineConfig
from pdserve.distributed import parallel_state
from pdserve.kernels.linear import pack_linear_weights
from pdserve.models import loader
from pdserve.models.state_cache import (
    StateCaches,
    StateModelCaches,
    num_state_rows,
    state_views,
)
from pdserve.models.utils import KVCacheGeometry, kv_cache_geometry
from pdserve.outputs import LogprobsLists, ModelRunnerOutput
from pdserve.runners import kv_scales
from pdserve.runners.draft_model import DraftModel
from pdserve.runners.draft_slots import DraftSlots, TokenTable
from pdserve.runners.eagle import EagleProposer
from pdserve.runners.inputs import StepInputs
from pdserve.runners.prompt_logprobs import (
    PromptChunk,
    PromptLogprobsTracker,
    compute_prompt_logprobs,
)
from pdserve.runners.proposer import DraftStep, Proposer
from pdserve.runners.rejection_sampler import DraftRows, emitted_logprobs, rejection_sample
from pdserve.runners.sampler import (
    Sampler,
    SamplingMetadata,
    SamplingRow,
    apply_grammar_bitmask,
)
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.output import GrammarBitmask, SchedulerOutput
from pdserve.utils import cdiv

logger = logging.getLogger(__name__)


class ModelRunnerBase:
    def __init__(
        self, config: EngineConfig, device: torch.device, use_sampling_kernels: bool
    ) -> None:
        """use_sampling_kernels: sample with the dispatching kernels (Triton on CUDA) rather
        than always with the torch reference."""
        self.config = config
        self.model_config = config.model_config
        self.device = device
        self.dtype = self.model_config.torch_dtype
        self.kv_dtype = config.cache_config.kv_dtype(self.dtype)
        self.block_size = config.cache_config.block_size
        self.max_model_len = self.model_config.max_model_len
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.max_num_blocks_per_req = cdiv(self.max_model_len, self.block_size)
        self.eos_token_ids = self.model_config.eos_token_ids
        self.sampler = Sampler(use_kernels=use_sampling_kernels)
        self.prompt_logprobs = PromptLogprobsTracker()
        self.model: torch.nn.Module | None = None
        self.kv_cache_geometry: KVCacheGeometry | None = None
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[torch.Tensor] = []
        # Models with recurrent state (Mamba): per layer, a slot of state per block, in the
        # block's rows after its attention layers' (state_cache.py).
        self.has_state = False
        self.state_caches: StateCaches = []
        # Speculative decoding's model-based drafter: its KV layers follow the target's in
        # each block (runners/proposer.py).
        self.draft = _make_proposer(config, device, self.dtype)
        spec = config.speculative_config
        self.draft_slots = None if spec is None else DraftSlots(spec)

    def load_model(self) -> None:
        mc = self.model_config
        self.model = loader.load_model(
            mc.hf_config,
            mc.source,
            self.dtype,
            self.device,
            keep_quantized=mc.kept_gguf_types(self.device),
        )
        pack_linear_weights(self.model)
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info("Weights: %.1f MiB (quantization %s)", weight_bytes / 2**20, mc.quantization)
        # Read now: runner V2 may later wrap the model in its CUDA graphs.
        self.kv_cache_geometry = kv_cache_geometry(self.model)
        self.has_state = hasattr(self.model, "state_shapes")
        if self.config.cache_config.calculate_kv_scales:
            self._calculate_kv_scales()
        if self.draft is not None:
            self.draft.load(self.model)

    def _calculate_kv_scales(self) -> None:
        token_ids = self.model_config.load_tokenizer().encode(kv_scales.CALIBRATION_TEXT)
        scales = kv_scales.calculate_kv_scales(self.model, token_ids, self.dtype, self.device)
        logger.info(
            "KV scales calculated from %d tokens: k %.3g..%.3g, v %.3g..%.3g",
            len(token_ids),
            *(f(s[i] for s in scales) for i in (0, 1) for f in (min, max)),
        )

    def _kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[num_blocks, this stage's layers, 2 (key, value) or 1 (a latent), block_size, this TP
        rank's KV heads, head_dim], as the model's attention layers hold them; a state model's
        state rows follow its layers (state_cache.py)."""
        geometry = self.kv_cache_geometry
        assert geometry is not None, "load_model() first"
        rows = geometry.num_layers
        if self.draft is not None:
            rows += self.draft.num_layers
        if self.has_state:
            element_size = torch.empty((), dtype=self.dtype).element_size()
            row_bytes = self.block_size * geometry.bytes_per_layer_token(element_size)
            rows += num_state_rows(self.model.state_shapes(), self.dtype, row_bytes)
        return (
            num_blocks,
            rows,
            geometry.kv_parts,
            self.block_size,
            geometry.num_kv_heads,
            geometry.head_dim,
        )

    def get_kv_cache_block_bytes(self) -> int:
        element_size = torch.empty((), dtype=self.kv_dtype).element_size()
        return math.prod(self._kv_cache_shape(1)) * element_size

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One block-major tensor: block b of every layer is contiguous (cheap to transfer)."""
        shape = self._kv_cache_shape(num_blocks)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        num_layers = self.kv_cache_geometry.num_layers
        self.kv_caches = _layer_views(self.kv_cache, 0, num_layers)
        if self.draft is not None:
            self.draft.kv_caches = _layer_views(self.kv_cache, num_layers, self.draft.num_layers)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %s)",
            num_blocks,
            self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
            str(self.kv_dtype).removeprefix("torch."),
        )
        if self.has_state:
            rows = self.kv_cache[:, num_layers:]
            self.state_caches = state_views(rows, self.model.state_shapes(), self.dtype)
            logger.info(
                "State: a slot per block, %d rows after the %d attention layers'",
                rows.shape[1],
                num_layers,
            )

    @torch.inference_mode()
    def forward_and_sample(
        self,
        inputs: StepInputs,
        rows: list[SamplingRow],
        prompt_chunks: list[PromptChunk] | None = None,
        grammar: tuple[GrammarBitmask, list[str]] | None = None,
        drafts: DraftRows | None = None,
    ) -> tuple[list[list[int]], LogprobsLists | None]:
        """Each sampling row's tokens (one, or with `drafts` its accepted drafts and one more:
        runners/rejection_sampler.py) and their logprobs; the prompt logprobs of
        `prompt_chunks` go to `self.prompt_logprobs`. `grammar`: the step's structured-outputs
        bitmask and the request id of each row."""
        hidden = self._forward(inputs)
        if self.draft is not None:
            self.draft.observe(inputs, hidden)
        if prompt_chunks and hidden is not None:
            prompt_rows = compute_prompt_logprobs(
                hidden, prompt_chunks, self.model.compute_logits, self.sampler.topk_logprobs
            )
            for chunk, chunk_rows in zip(prompt_chunks, prompt_rows):
                self.prompt_logprobs.record(chunk, chunk_rows)
        if not rows:
            return [], None
        if drafts is not None:
            assert hidden is not None, "speculation runs on one pipeline stage"
            return self._verify(hidden, rows, grammar, drafts)
        if hidden is None:
            # A stage before the last gets the last stage's tokens; it knows how many.
            sampled = torch.empty(len(rows), dtype=torch.int64, device=self.device)
            logprobs = None
        else:
            sampled, logprobs = self._sample(hidden, inputs, rows, grammar)
        if parallel_state.get_pp_world_size() > 1:
            parallel_state.broadcast_from_output_rank(sampled)
        return [[t] for t in sampled.tolist()], logprobs

    def _forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """The final hidden states; None on a pipeline stage before the last."""
        assert self.model is not None, "load_model() first"
        caches = (
            StateModelCaches(self.kv_caches, self.state_caches)
            if self.has_state
            else self.kv_caches
        )
        args = (inputs.input_ids, inputs.positions, caches, inputs.attn_metadata)
        if parallel_state.get_pp_world_size() == 1:
            return self.model(*args)
        intermediate = None
        if not parallel_state.is_first_stage():
            empty = self.model.make_empty_intermediate_tensors(
                inputs.input_ids.shape[0], self.dtype, self.device
            )
            intermediate = parallel_state.recv_intermediate_tensors(empty)
        output = self.model(*args, intermediate)
        if parallel_state.is_last_stage():
            return output
        parallel_state.send_intermediate_tensors(output)
        return None

    def _sample(
        self,
        hidden: torch.Tensor,
        inputs: StepInputs,
        rows: list[SamplingRow],
        grammar: tuple[GrammarBitmask, list[str]] | None,
    ) -> tuple[torch.Tensor, LogprobsLists | None]:
        logits, md = self._logits_and_metadata(hidden[inputs.logits_indices], rows, grammar)
        out = self.sampler(logits, md)
        logprobs = out.logprobs
        if logprobs is not None:
            logprobs = _own_widths(logprobs, rows)
        return out.sampled_token_ids, logprobs

    def _verify(
        self,
        hidden: torch.Tensor,
        rows: list[SamplingRow],
        grammar: tuple[GrammarBitmask, list[str]] | None,
        drafts: DraftRows,
    ) -> tuple[list[list[int]], LogprobsLists | None]:
        """A step with drafts: every row of `drafts` sampled, the drafts accepted or not."""
        rows = drafts.expand(rows)
        if grammar is not None:
            grammar = (grammar[0], drafts.row_req_ids)
        index = torch.from_numpy(drafts.logits_indices).to(hidden.device)
        logits, md = self._logits_and_metadata(hidden[index], rows, grammar)
        tokens, chosen = rejection_sample(logits, md, drafts)
        if md.max_num_logprobs is None:
            return tokens, None
        ids, values, ranks = self.sampler.topk_logprobs(logits, chosen, md.max_num_logprobs)
        lists = _own_widths(LogprobsLists(ids.tolist(), values.tolist(), ranks.tolist()), rows)
        return tokens, emitted_logprobs(lists, tokens, drafts)

    def _logits_and_metadata(
        self,
        hidden: torch.Tensor,
        rows: list[SamplingRow],
        grammar: tuple[GrammarBitmask, list[str]] | None,
    ) -> tuple[torch.Tensor, SamplingMetadata]:
        logits = self.model.compute_logits(hidden)
        if grammar is not None:
            apply_grammar_bitmask(logits, *grammar)
        md = SamplingMetadata.from_params(
            [r.params for r in rows],
            [r.output_token_ids for r in rows],
            [r.prompt_token_ids for r in rows],
            [self.eos_token_ids] * len(rows),
            self.device,
            logits_processors=[r.logits_processors for r in rows]
            if any(r.logits_processors for r in rows)
            else None,
        )
        return logits, md

    def make_output(
        self,
        req_ids: list[str],
        sampled: dict[str, list[int]],
        logprobs: LogprobsLists | None,
        sampling_req_ids: list[str],
        draft_token_ids: dict[str, list[int]] | None = None,
        num_filled_drafts: dict[str, int] | None = None,
    ) -> ModelRunnerOutput:
        """Rows in batch order; requests still in a chunked prefill get no token. The requests
        that sampled their first token get their prompt logprobs, if they are owed them."""
        if logprobs is not None:
            logprobs = _scatter_logprobs(logprobs, sampling_req_ids, req_ids)
        prompt_logprobs = None
        if self.prompt_logprobs.pending and sampling_req_ids:
            prompt_logprobs = self.prompt_logprobs.pop_sampled(sampling_req_ids)
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            logprobs=logprobs,
            prompt_logprobs_dict=prompt_logprobs,
            draft_token_ids=draft_token_ids,
            num_filled_drafts=num_filled_drafts,
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def place_drafts(
        self, spec: dict[str, list[int]], table: TokenTable, index: dict[str, int]
    ) -> tuple[dict[str, list[int]], dict[str, int] | None]:
        """The step's drafts to verify, each written after its request's known tokens in the
        runner's token `table` (row `index[req_id]`), and how many placeholder slots got one
        (runners/draft_slots.py)."""
        if not spec:
            return {}, None
        assert self.draft_slots is not None
        drafts, filled = self.draft_slots.fill(spec, lambda r: table.known_tokens(index[r]))
        for req_id, own in drafts.items():
            table.write_drafts(index[req_id], own)
        return drafts, filled

    def max_num_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The most tokens a request may reach: its max_tokens, and max_model_len."""
        max_tokens = params.max_tokens or self.max_model_len
        return min(num_prompt_tokens + max_tokens, self.max_model_len)

    def propose_drafts(
        self, step: DraftStep, max_num_tokens: np.ndarray, paused: set[str] | None
    ) -> dict[str, list[int]]:
        """The drafter's guesses for the next step of each request that sampled: as many as
        `max_num_tokens` (each sampling row's) leaves room for after its next token, none for
        the `paused`. Kept for the placeholder slots of the next step (draft_slots.py)."""
        assert self.draft is not None and self.draft_slots is not None
        room = max_num_tokens - step.num_tokens[step.sampling] - 1
        step.num_drafts = np.clip(np.minimum(self.draft.k, room), 0, None)
        if paused:
            ids = step.req_ids
            step.num_drafts[[ids[r] in paused for r in step.sampling.tolist()]] = 0
        guesses = self.draft.propose(step)
        proposals = {step.req_ids[r]: g for r, g in zip(step.sampling.tolist(), guesses) if g}
        self.draft_slots.proposals = proposals
        return proposals


def _make_proposer(
    config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> Proposer | None:
    spec = config.speculative_config
    if spec is None or spec.method == "ngram":
        return None  # the scheduler drafts n-grams itself
    if spec.method == "eagle":
        return EagleProposer(config, device, dtype)
    return DraftModel(config, device, dtype)


def _layer_views(kv_cache: torch.Tensor, start: int, num_layers: int) -> list[torch.Tensor]:
    """Each layer's [blocks, 2, ...] view; a latent part serves as key and value (stride 0)."""
    return [kv_cache[:, i].expand(-1, 2, -1, -1, -1) for i in range(start, start + num_layers)]


def _own_widths(lp: LogprobsLists, rows: list[SamplingRow]) -> LogprobsLists:
    """The sampler returns the batch maximum of top-k columns; each request asked for its own."""
    widths = [(r.params.logprobs or 0) + 1 for r in rows]
    return LogprobsLists(
        [ids[:w] for ids, w in zip(lp.logprob_token_ids, widths)],
        [vals[:w] for vals, w in zip(lp.logprobs, widths)],
        lp.sampled_token_ranks,
    )


def _scatter_logprobs(
    lp: LogprobsLists, sampling_req_ids: list[str], req_ids: list[str]
) -> LogprobsLists:
    """From sampling order to batch order, each request's rows marked by
    `cu_num_generated_tokens` (a request that sampled nothing has none)."""
    cu = lp.cu_num_generated_tokens or list(range(len(sampling_req_ids) + 1))
    spans = {r: (cu[i], cu[i + 1]) for i, r in enumerate(sampling_req_ids)}
    ids, vals, ranks = [], [], []
    new_cu = [0]
    for r in req_ids:
        start, end = spans.get(r, (0, 0))
        ids += lp.logprob_token_ids[start:end]
        vals += lp.logprobs[start:end]
        ranks += lp.sampled_token_ranks[start:end]
        new_cu.append(len(ids))
    return LogprobsLists(ids, vals, ranks, new_cu)
