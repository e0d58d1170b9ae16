"""What the engine launches on a GPU: the numbers behind the Triton launchers' constexpr choices,
and the configurations that kernels/triton/aot.py compiles ahead of time for every GPU target.

A launcher derives each constexpr from the shapes it is given and the numbers here; a
configuration below is such a shape. Integer arguments that vary with the batch (request, row
and split counts) or with max_model_len (the state and block tables' widths) are marked
`do_not_specialize` on their kernels, so that one binary serves every batch of a configuration
(kernels/triton/aot.py checks it) and this list stays finite.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from pdserve.kernels.triton.matmul_configs import (
    GGUF_SHAPE_NAMES,
    MatmulLaunch,
    QuantMatmulLaunch,
    quant_matmuls,
)
from pdserve.utils import cdiv

# Paged attention: a prefill query block holds this many rows (tokens x GQA heads); tl.dot
# needs every dimension to be at least DOT_MIN, so decode blocks and small heads are padded.
ATTENTION_ROWS = 64
DOT_MIN = 16
ATTENTION_NUM_WARPS = 4
ATTENTION_NUM_STAGES = 3
# Split-K: at most this many KV splits per (query block, kv head).
MAX_SPLITS = 32
# Under PDSERVE_BATCH_INVARIANT every query's keys are split at this many tokens, so that its
# reduction order follows its own sequence length alone (triton/attention.py). Long enough that
# a split's partial write is small next to its KV reads; MAX_SPLITS of them (16k tokens) still
# run in parallel.
BATCH_INVARIANT_SPLIT = 512
# V2 input preparation: tokens and block-table entries per loop step.
PREPARE_BLOCK = 128
# Sampling: a program holds BLOCK_B x BLOCK_V = SAMPLING_TILE logits at once.
SAMPLING_TILE = 4096


def attention_block_n(head_size: int) -> int:
    """Keys per attention tile: a [BLOCK_N, head] tile of K and one of V stay in registers."""
    return 64 if head_size <= 128 else 32


def rms_norm_num_warps(block: int) -> int:
    return 8 if block >= 4096 else 4


# The configurations: model shapes in each dtype, block size and TP size, and every sampling
# step the sampler can take for them.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_SIZES = (16, 32)
# Top logprobs a request may ask for: the OpenAI server's limit (entrypoints/openai/protocol.py).
MAX_LOGPROBS = 20
TP_SIZES = (1, 2)
# The fp8 KV cache's formats (--kv-cache-dtype), in every configuration but a latent cache's (the
# engine refuses fp8 there). Triton has e4m3 (its fp8e4nv) from compute capability 8.9 on only.
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_LEAST_CAPABILITY = {torch.float8_e4m3fn: (8, 9)}


def check_fp8_cache_on_cuda(dtype: torch.dtype, capability: tuple[int, int]) -> None:
    """Refuse, by name, an fp8 KV cache of `dtype` on a GPU of compute `capability` (as
    torch.cuda.get_device_capability gives it) for which Triton has no such format."""
    least = _FP8_LEAST_CAPABILITY.get(dtype)
    if least is not None and tuple(capability) < least:
        raise ValueError(
            f"An fp8 KV cache of {dtype} needs a GPU of compute capability {least[0]}.{least[1]} "
            f"or later (Triton has no e4m3 below); this one is {capability[0]}.{capability[1]}. "
            "kv_cache_dtype='fp8_e5m2' runs on it; 'auto' keeps the model's dtype."
        )


@dataclass(frozen=True)
class LatentShape:
    """Multi-head latent attention's projections (DeepSeek-V2/V3): the model's one KV head is a
    latent of kv_lora_rank + qk_rope_head_dim values (models/layers/mla.py)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    intermediate_size: int
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3)
    gated_mlp: bool = True  # gate and up in one projection (Llama); else one fc1 (OPT)
    bias: bool = False  # every projection but the LM head has one (OPT)
    latent: LatentShape | None = None  # MLA: num_kv_heads 1, head_size the latent's
    # Compiled in these only (None: every one of DTYPES and BLOCK_SIZES).
    dtypes: tuple[torch.dtype, ...] | None = None
    block_sizes: tuple[int, ...] | None = None

    def per_rank(self, tp: int) -> tuple[int, int] | None:
        """(query heads, kv heads) of one TP rank, as QKVParallelLinear splits them; None where
        the heads do not divide over tp ranks."""
        if self.num_heads % tp or max(self.num_kv_heads, tp) % min(self.num_kv_heads, tp):
            return None
        return self.num_heads // tp, max(1, self.num_kv_heads // tp)

    def linears(self, dtype: torch.dtype, tp: int) -> list[MatmulLaunch]:
        """The matmuls of one TP rank: q/k/v, o, the MLP's two and the LM head (float32 logits
        of a vocabulary shard). A row-parallel layer adds its bias after the all-reduce when
        tp > 1 (models/layers/linear.py), so its matmul has none then."""
        heads = self.per_rank(tp)
        if heads is None or self.intermediate_size % tp:
            return []
        q, kv = heads
        ffn = self.intermediate_size // tp
        row_bias = self.bias and tp == 1
        shapes = [
            *self._attention_linears(q, kv, row_bias),
            ((2 if self.gated_mlp else 1) * ffn, self.hidden_size, self.bias),
            (self.hidden_size, ffn, row_bias),
        ]
        vocab = cdiv(self.vocab_size, tp)
        return [MatmulLaunch(dtype, n, k, bias, logits=False) for n, k, bias in shapes] + [
            MatmulLaunch(dtype, vocab, self.hidden_size, bias=False, logits=True)
        ]

    def _attention_linears(self, q: int, kv: int, row_bias: bool) -> list[tuple[int, int, bool]]:
        """(out, in, bias) of one rank's attention projections: q/k/v and o; for MLA the q
        projection(s), the latent's, a head's absorbed W_UK^T and W_UV, and o."""
        mla = self.latent
        if mla is None:
            return [
                ((q + 2 * kv) * self.head_size, self.hidden_size, self.bias),
                (self.hidden_size, q * self.head_size, row_bias),
            ]
        q_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank:
            q_proj = [
                (mla.q_lora_rank, self.hidden_size, False),
                (q * q_head, mla.q_lora_rank, False),
            ]
        else:
            q_proj = [(q * q_head, self.hidden_size, False)]
        return q_proj + [
            (self.head_size, self.hidden_size, False),
            (mla.kv_lora_rank, mla.qk_nope_head_dim, False),
            (mla.v_head_dim, mla.kv_lora_rank, False),
            (self.hidden_size, q * mla.v_head_dim, False),
        ]

    def norm_sizes(self) -> list[int]:
        """What RMSNorm normalizes alone (no residual) besides the hidden states: q/k heads
        (Qwen3), MLA's latent and q_lora."""
        sizes = [self.head_size] if self.qk_norm else []
        if self.latent is not None:
            sizes += [self.latent.kv_lora_rank, self.latent.q_lora_rank or 0]
        return [n for n in sizes if n]

    def rope_size(self) -> int:
        return self.head_size if self.latent is None else self.latent.qk_rope_head_dim


# Head sizes 64 and 128 with GQA groups 1, 4 and 8 each, the default model (group 3) and a model
# with q/k norms (group 2).
MODEL_SHAPES = (
    ModelShape("SmolLM2-135M", 576, 9, 3, 64, 49152, 1536),
    ModelShape("OPT-125m", 768, 12, 12, 64, 50272, 3072, gated_mlp=False, bias=True),
    ModelShape("Llama-3.2-1B", 2048, 32, 8, 64, 128256, 8192),
    ModelShape("TinyLlama-1.1B", 2048, 32, 4, 64, 32000, 5632),
    ModelShape("Llama-2-7B", 4096, 32, 32, 128, 32000, 11008),
    ModelShape("Llama-3-8B", 4096, 32, 8, 128, 128256, 14336),
    ModelShape("Llama-3-70B", 8192, 64, 8, 128, 128256, 28672),
    ModelShape("Qwen3-0.6B", 1024, 16, 8, 128, 151936, 3072, qk_norm=True),
    # MLA: 16 heads over one latent KV head of 512 + 64 (DeepSeek-V2-Lite; its dense layers'
    # MLP, the experts run as matmuls of their own sizes). In bf16 and blocks of 16 only: its
    # 576-wide attention tiles take 12 s a binary to compile.
    ModelShape(
        "DeepSeek-V2-Lite",
        2048,
        16,
        1,
        576,
        102400,
        10944,
        latent=LatentShape(None, 512, 128, 64, 128),
        dtypes=(torch.bfloat16,),
        block_sizes=(16,),
    ),
)


@dataclass(frozen=True)
class AttentionLaunch:
    """One paged-attention specialization; the driver launches it unsplit and with every
    split count up to MAX_SPLITS (one combine kernel serves them all), or, batch invariant,
    with its fixed-size splits in one program and in a program each."""

    dtype: torch.dtype
    head_size: int
    group: int
    block_size: int
    prefill: bool  # query blocks of several tokens; else one-token decode blocks
    # PDSERVE_BATCH_INVARIANT: every batch in prefill-sized blocks, split at a fixed size.
    batch_invariant: bool = False
    cache_dtype: torch.dtype | None = None  # one of FP8_CACHE_DTYPES; None: `dtype`


@dataclass(frozen=True)
class KVWriteLaunch:
    dtype: torch.dtype
    num_kv_heads: int
    head_size: int
    block_size: int
    cache_dtype: torch.dtype | None = None  # one of FP8_CACHE_DTYPES; None: `dtype`


@dataclass(frozen=True)
class RotaryLaunch:
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_size: int


@dataclass(frozen=True)
class NormLaunch:
    dtype: torch.dtype
    hidden_size: int
    residual: bool


@dataclass(frozen=True)
class PrepareInputsLaunch:
    block_size: int


@dataclass(frozen=True)
class SamplingLaunch:
    """One sampling step: the flags pick the kernels and their constexprs."""

    dtype: torch.dtype  # of the logits the sampler is given
    vocab_size: int
    all_greedy: bool
    penalties: bool
    top_k: bool
    top_p: bool
    min_p: bool


@dataclass(frozen=True)
class LogprobsLaunch:
    dtype: torch.dtype
    vocab_size: int
    num_logprobs: int


Launch = (
    AttentionLaunch
    | KVWriteLaunch
    | RotaryLaunch
    | NormLaunch
    | MatmulLaunch
    | QuantMatmulLaunch
    | PrepareInputsLaunch
    | SamplingLaunch
    | LogprobsLaunch
)


# The default suite's share (the slow stage compiles everything): every kernel and every variant
# its launcher picks (decode and prefill, each block size and TP size, each sampling step), for
# the default model and a head-size-128 model with q/k norms, in bf16 (fp32's prefill binaries
# take ~9 s each to compile: the slow stage has them).
QUICK_DTYPES = (torch.bfloat16,)
QUICK_SHAPE_NAMES = ("SmolLM2-135M", "Qwen3-0.6B")
# Of which the default model only with an fp8 cache: its variants double the attention binaries.
QUICK_FP8_SHAPE_NAMES = ("SmolLM2-135M",)


def launches(quick: bool = False) -> list[Launch]:
    """Every configuration the engine launches for MODEL_SHAPES in DTYPES, BLOCK_SIZES, TP_SIZES
    and FP8_CACHE_DTYPES, without duplicates; `quick`: only the QUICK_ dtypes and shapes."""
    dtypes = QUICK_DTYPES if quick else DTYPES
    shapes = [s for s in MODEL_SHAPES if not quick or s.name in QUICK_SHAPE_NAMES]
    out: dict[Launch, None] = {}
    for dtype, shape in itertools.product(dtypes, shapes):
        if dtype not in (shape.dtypes or dtypes):
            continue
        block_sizes = shape.block_sizes or BLOCK_SIZES
        for tp in TP_SIZES:
            linears = shape.linears(dtype, tp)
            out.update(dict.fromkeys(linears))
            if shape.name in GGUF_SHAPE_NAMES:
                out.update(dict.fromkeys(quant_matmuls(linears)))
            if (heads := shape.per_rank(tp)) is None:
                continue
            # A rank's group: the model's, but MLA's one latent head serves each rank's heads.
            group = heads[0] // heads[1]
            # An fp8 cache beside 16-bit activations only: float32's prefill binaries are the
            # slowest to compile (about 9 s each), and their fp8 twins would weigh most in a
            # cold slow stage for a pairing nobody serves.
            fp8 = not shape.latent and dtype != torch.float32
            fp8 = fp8 and (not quick or shape.name in QUICK_FP8_SHAPE_NAMES)
            caches = (None, *FP8_CACHE_DTYPES) if fp8 else (None,)
            for block_size, prefill, invariant, cache in itertools.product(
                block_sizes, (False, True), (False, True), caches
            ):
                launch = AttentionLaunch(
                    dtype, shape.head_size, group, block_size, prefill, invariant, cache
                )
                out[launch] = None
            for block_size, cache in itertools.product(block_sizes, caches):
                out[KVWriteLaunch(dtype, heads[1], shape.head_size, block_size, cache)] = None
            out[RotaryLaunch(dtype, *heads, shape.rope_size())] = None
        for residual in (False, True):
            out[NormLaunch(dtype, shape.hidden_size, residual)] = None
        for size in shape.norm_sizes():
            out[NormLaunch(dtype, size, residual=False)] = None
        # Greedy steps sample the model's logits as they are; the others, and any step with
        # penalties, a float32 copy. Logits processors and min_tokens hand over float32 too.
        for greedy, penalties in itertools.product((True, False), repeat=2):
            # top-k, top-p and min-p apply to random rows only.
            truncations = [(False,) * 3] if greedy else itertools.product((False, True), repeat=3)
            for top_k, top_p, min_p in truncations:
                sampling = SamplingLaunch(
                    dtype, shape.vocab_size, greedy, penalties, top_k, top_p, min_p
                )
                out[sampling] = None
        for num_logprobs in range(MAX_LOGPROBS + 1):
            out[LogprobsLaunch(dtype, shape.vocab_size, num_logprobs)] = None
    for block_size in BLOCK_SIZES:
        out[PrepareInputsLaunch(block_size)] = None
    return list(out)


def runs_on(launch: Launch, arch: int) -> bool:
    """Whether a GPU of sm_<arch> launches `launch`: not with an fp8 cache it refuses."""
    cache = getattr(launch, "cache_dtype", None)
    return cache is None or divmod(arch, 10) >= _FP8_LEAST_CAPABILITY.get(cache, (0, 0))
