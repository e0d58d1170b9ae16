"""CUDA graphs of runner V2's forward pass, one per batch descriptor, as vLLM's V2 runner.

On a CUDA device (Triton kernels, enforce_eager off) the runner captures the model's forward
for every bucket at startup. A step whose shape fits a bucket is padded to it in static input
buffers and replayed; larger steps run eagerly. A padded batch is an ordinary valid batch:

- it holds `num_tokens` tokens and as many requests, the real ones first, in their order;
- padding tokens have input id 0, position 0 and slot -1, so the KV cache never sees them;
- padding request j owns one padding token while any is left, else none (there are never
  more padding tokens than padding requests: a real request has at least one token). With
  one, its query_len and seq_len are 1 and its block-table row is zeros: it attends to slot 0
  of the null block, which no request writes. Without, both are 0;
- max_query_len (1 for decode buckets, num_tokens for mixed ones) and max_seq_len
  (max_model_len) are bounds fixed per bucket, since a graph bakes in the host's integers.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.kernels.attention import AttentionMetadata
from pdserve.runners.inputs import StepInputs

logger = logging.getLogger(__name__)

# Mixed steps (a prefill chunk among decodes) are captured up to this many tokens; longer
# prefills are dominated by compute, where launch overhead does not matter.
MAX_MIXED_CAPTURE_TOKENS = 256


@dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int  # as many requests: each padding request may own a padding token
    uniform_decode: bool  # every request has one query token

    @property
    def max_query_len(self) -> int:
        return 1 if self.uniform_decode else self.num_tokens


def capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_size, and max_size itself."""
    sizes = [s for s in (1, 2, 4) if s < max_size] + list(range(8, max_size, 8))
    return sizes + [max_size]


def batch_descriptors(max_num_seqs: int, max_num_batched_tokens: int) -> list[BatchDescriptor]:
    """Decode buckets up to max_num_seqs, mixed buckets up to MAX_MIXED_CAPTURE_TOKENS."""
    decode = capture_sizes(min(max_num_seqs, max_num_batched_tokens))
    mixed = capture_sizes(min(MAX_MIXED_CAPTURE_TOKENS, max_num_batched_tokens))
    return [BatchDescriptor(n, True) for n in decode] + [
        BatchDescriptor(n, False)
        for n in mixed
        if n > 1  # a mixed step has two tokens or more
    ]


def select_descriptor(
    descriptors: list[BatchDescriptor], num_tokens: int, max_query_len: int
) -> BatchDescriptor | None:
    """The smallest bucket of the step's kind holding num_tokens; None when none does."""
    uniform = max_query_len == 1
    fitting = sorted(d.num_tokens for d in descriptors if d.uniform_decode == uniform)
    i = bisect.bisect_left(fitting, num_tokens)
    return BatchDescriptor(fitting[i], uniform) if i < len(fitting) else None


class StaticInputs:
    """Input buffers sized for the largest bucket; each bucket reads prefixes of them."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_blocks_per_req: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.max_model_len = max_model_len
        self.input_ids = zeros(max_num_tokens, dtype=torch.int64)
        self.positions = zeros(max_num_tokens, dtype=torch.int64)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = zeros(max_num_tokens + 1, dtype=torch.int32)
        self.seq_lens = zeros(max_num_tokens, dtype=torch.int32)
        self.block_table = zeros(max_num_tokens, max_num_blocks_per_req, dtype=torch.int32)
        self._arange = torch.arange(max_num_tokens + 1, dtype=torch.int32, device=device)
        self._metadata: dict[BatchDescriptor, AttentionMetadata] = {}

    def metadata(self, desc: BatchDescriptor) -> AttentionMetadata:
        """One object per bucket, made once: the graph model recognizes its bucket by it."""
        if desc not in self._metadata:
            n = desc.num_tokens
            self._metadata[desc] = AttentionMetadata(
                num_reqs=n,
                num_actual_tokens=n,
                max_query_len=desc.max_query_len,
                max_seq_len=self.max_model_len,
                query_start_loc=self.query_start_loc[: n + 1],
                seq_lens=self.seq_lens[:n],
                block_table=self.block_table[:n],
                slot_mapping=self.slot_mapping[:n],
            )
        return self._metadata[desc]

    def fill(self, inputs: StepInputs, desc: BatchDescriptor) -> StepInputs:
        """The step padded to the bucket, in the buffers (device copies only, no host sync)."""
        md = inputs.attn_metadata
        num_tokens, num_reqs, padded = md.num_actual_tokens, md.num_reqs, desc.num_tokens
        assert num_tokens <= padded and num_reqs <= padded
        num_pad_tokens = padded - num_tokens
        self.input_ids[:num_tokens].copy_(inputs.input_ids[:num_tokens])
        self.input_ids[num_tokens:padded].zero_()
        self.positions[:num_tokens].copy_(inputs.positions[:num_tokens])
        self.positions[num_tokens:padded].zero_()
        self.slot_mapping[:num_tokens].copy_(md.slot_mapping[:num_tokens])
        self.slot_mapping[num_tokens:padded].fill_(-1)
        self.query_start_loc[: num_reqs + 1].copy_(md.query_start_loc[: num_reqs + 1])
        # Padding request j ends at num_tokens + min(j + 1, num_pad_tokens).
        pad_ends = self._arange[1 : padded - num_reqs + 1].clamp(max=num_pad_tokens) + num_tokens
        self.query_start_loc[num_reqs + 1 : padded + 1].copy_(pad_ends)
        self.seq_lens[:num_reqs].copy_(md.seq_lens[:num_reqs])
        self.seq_lens[num_reqs:padded].copy_(self._arange[: padded - num_reqs] < num_pad_tokens)
        width = md.block_table.shape[1]
        self.block_table[:num_reqs, :width].copy_(md.block_table[:num_reqs])
        self.block_table[:num_reqs, width:].zero_()
        self.block_table[num_reqs:padded].zero_()
        return StepInputs(
            self.input_ids[:padded],
            self.positions[:padded],
            self.metadata(desc),
            inputs.logits_indices,
        )


def empty_step_inputs(device: torch.device) -> StepInputs:
    """A step of no requests: filled into a bucket, it is all padding (capture's input)."""
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    md = AttentionMetadata(
        num_reqs=0,
        num_actual_tokens=0,
        max_query_len=0,
        max_seq_len=0,
        query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
        seq_lens=empty.int(),
        block_table=torch.zeros(0, 0, dtype=torch.int32, device=device),
        slot_mapping=empty,
    )
    return StepInputs(empty, empty, md, empty)


class CudaGraphModel(nn.Module):
    """The model, replaying a captured graph when called with a bucket's static inputs."""

    def __init__(
        self, model: nn.Module, static: StaticInputs, descriptors: list[BatchDescriptor]
    ) -> None:
        super().__init__()
        self.model = model
        self.static = static
        self.descriptors = descriptors
        # id of the bucket's metadata (kept alive by `static`) -> (graph, its output buffer).
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def pad(self, inputs: StepInputs) -> StepInputs:
        """The step padded into the static buffers of its bucket, or as it is without one."""
        md = inputs.attn_metadata
        desc = select_descriptor(self.descriptors, md.num_actual_tokens, md.max_query_len)
        return inputs if desc is None else self.static.fill(inputs, desc)

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        device = self.static.input_ids.device
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller graphs then reuse the memory the pool already holds.
        for desc in sorted(self.descriptors, key=lambda d: d.num_tokens, reverse=True):
            inputs = self.static.fill(empty_step_inputs(device), desc)
            args = (inputs.input_ids, inputs.positions, kv_caches, inputs.attn_metadata)
            # Warm-up outside the graph: Triton compiles and autotunes on first use.
            self.model(*args)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    output = self.model(*args)
            except RuntimeError as e:
                raise RuntimeError(
                    f"CUDA graph capture failed for {desc}; enforce_eager=True runs without"
                ) from e
            self._graphs[id(inputs.attn_metadata)] = (graph, output)
        torch.cuda.synchronize(device)
        logger.info(
            "Captured %d CUDA graphs (decode up to %d tokens, mixed up to %d) in %.1f s",
            len(self._graphs),
            max((d.num_tokens for d in self.descriptors if d.uniform_decode), default=0),
            max((d.num_tokens for d in self.descriptors if not d.uniform_decode), default=0),
            time.perf_counter() - start,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        entry = self._graphs.get(id(attn_metadata))
        if entry is None:
            return self.model(input_ids, positions, kv_caches, attn_metadata)
        assert input_ids.data_ptr() == self.static.input_ids.data_ptr(), "inputs from pad()"
        graph, output = entry
        graph.replay()
        return output

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)
