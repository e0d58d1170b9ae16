"""Ahead-of-time compilation of every Triton kernel for GPU targets, on a machine without a GPU.

Each configuration of `launch_configs.launches()` runs through its real launcher, with CPU
tensors of the engine's dtypes and layouts, under a driver that stands in for a GPU of the
target architecture: Triton binds and specializes the arguments exactly as it would on that
GPU, and a jit_cache_hook compiles each kernel the launcher starts (through PTX to a cubin, with
the ptxas of the Triton wheel) instead of launching it. The binaries land in Triton's cache
(PDSERVE_CACHE_DIR/triton unless --cache-dir), keyed by the kernel's source, its
specialization, the target and the compiler, so a rerun compiles only what changed.

    python -m pdserve.kernels.triton.aot [--arch 80 90] [--jobs 2] [--quick] [--fp8-cache]
        [--cache-dir DIR] [--json REPORT]

--quick compiles the default suite's share (launch_configs.QUICK_*): every kernel and variant
for two model shapes in bf16, an eighth of the configurations. --fp8-cache compiles only the
configurations with an fp8 KV cache, each for the targets that have its format
(launch_configs.runs_on).

TRITON_INTERPRET must be unset: the interpreter accepts kernels the compiler rejects.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import itertools
import json
import multiprocessing
import pkgutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

import pdserve.kernels
from pdserve import envs
from pdserve.kernels.attention import AttentionMetadata
from pdserve.kernels.input_prep import prepare_inputs_triton
from pdserve.kernels.kv_cache import write_kv_cache_triton
from pdserve.kernels.norm import fused_add_rms_norm_triton, rms_norm_triton
from pdserve.kernels.quant_linear import BLOCK, GGUFRows, block_bytes
from pdserve.kernels.rotary import rotary_embedding_triton
from pdserve.kernels.sampling import SamplingInputs
from pdserve.kernels.triton import launch_configs as lc
from pdserve.kernels.triton.attention import paged_attention_triton
from pdserve.kernels.triton.matmul import matmul_triton
from pdserve.kernels.triton.quant_matmul import quant_matmul_triton
from pdserve.kernels.triton.sampling import sample_tokens_triton, topk_logprobs_triton

ARCHS = (80, 90)
# Every configuration runs with each (batch size, max_model_len): the JIT specializes integer
# arguments on their value (== 1, multiple of 16), and must come out with one binary for all.
VARIANTS = ((1, 4096), (16, 1000))


@dataclass(frozen=True)
class Compiled:
    """One kernel compiled for one target, as a launch of one configuration specialized it."""

    kernel: str
    arch: int
    launch: str
    constexprs: str  # the values of the kernel's declared constexprs
    specialization: str  # the JIT's key: every argument's type and attributes, the options
    error: str | None  # the compiler's message; None when PTX and a cubin came out


class _TargetDriver:
    """What a launch asks Triton's driver, answered for a GPU of one architecture."""

    def __init__(self, arch: int) -> None:
        self.arch = arch

    def get_current_device(self) -> int:
        return self.arch

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)


# (kernel, arch, specialization) -> the compiler's message, per process.
_compiled: dict[tuple[str, int, str], str | None] = {}


def _compile(fn: JITFunction, compile: dict[str, Any], arch: int) -> str | None:
    src = ASTSource(fn, compile["signature"], compile["constants"], compile["configs"][0])
    # The options as the JIT parsed them for this target (what JITFunction.preload reads).
    options = json.loads(compile["specialization_data"])["options"]
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    try:
        binary = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as e:  # the compiler's errors share no base class
        return f"{type(e).__name__}: {e}"
    missing = [kind for kind in ("ptx", "cubin") if not binary.asm.get(kind)]
    return f"no {' and no '.join(missing)} came out" if missing else None


def compile_launch(arch: int, launch: lc.Launch) -> list[Compiled]:
    """Every kernel that `launch` starts, in each variant, compiled for sm_<arch>."""
    seen: dict[tuple[str, str], Compiled] = {}

    def hook(*, key: Any, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        jit: JITFunction = fn.jit_function
        name = f"{fn.module}.{fn.name}"
        declared = {(i,) for i, p in enumerate(jit.params) if p.is_constexpr}
        constexprs = {
            jit.params[k[0]].name: v for k, v in compile["constants"].items() if k in declared
        }
        memo = (name, arch, str(key))
        if memo not in _compiled:
            _compiled[memo] = _compile(jit, compile, arch)
        record = Compiled(name, arch, repr(launch), repr(constexprs), str(key), _compiled[memo])
        seen[(name, record.specialization)] = record
        return True  # compiled here: the JIT neither compiles nor launches it

    # The stand-in stays this process's driver: without a GPU there is no other to go back to.
    triton.runtime.driver.set_active(_TargetDriver(arch))
    triton.knobs.runtime.jit_cache_hook = hook
    try:
        for batch, max_model_len in VARIANTS:
            _LAUNCHERS[type(launch)](launch, batch, max_model_len)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    return list(seen.values())


def _attention(launch: lc.AttentionLaunch, batch: int, max_model_len: int) -> None:
    num_kv_heads = 2
    query_lens = [70 if launch.prefill else 1] + [5 if launch.prefill else 1] * (batch - 1)
    # Batch invariant: long enough for two fixed-size splits, so that they run in parallel.
    context = 100 + (lc.BATCH_INVARIANT_SPLIT if launch.batch_invariant else 0)
    seq_lens = [n + context for n in query_lens]
    query = torch.zeros(
        sum(query_lens), num_kv_heads * launch.group, launch.head_size, dtype=launch.dtype
    )
    # One layer's view of the block-major cache [blocks, layers, 2, block, kv heads, head].
    shape = (2, 2, 2, launch.block_size, num_kv_heads, launch.head_size)
    cache = torch.zeros(shape, dtype=launch.cache_dtype or launch.dtype)
    md = AttentionMetadata(
        num_reqs=batch,
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.zeros(
            batch, triton.cdiv(max_model_len, launch.block_size), dtype=torch.int32
        ),
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
    )
    # Under batch invariance the count only picks one program per split or one for them all.
    splits = (1, 2) if launch.batch_invariant else range(1, lc.MAX_SPLITS + 1)
    for num_splits in splits:
        paged_attention_triton(
            query, cache[:, 1], md, 0.125, num_splits, batch_invariant=launch.batch_invariant
        )


def _kv_write(launch: lc.KVWriteLaunch, batch: int, max_model_len: int) -> None:
    shape = (launch.num_kv_heads, launch.head_size)
    key, value = (
        torch.zeros(batch, *shape, dtype=launch.dtype),
        torch.zeros(batch, *shape, dtype=launch.dtype),
    )
    cache = torch.zeros(
        2, 2, 2, launch.block_size, *shape, dtype=launch.cache_dtype or launch.dtype
    )
    write_kv_cache_triton(key, value, cache[:, 1], torch.zeros(batch, dtype=torch.int64))


def _rotary(launch: lc.RotaryLaunch, batch: int, max_model_len: int) -> None:
    # Query and key are views of the QKV projection's output, as the model splits it.
    heads = (launch.num_heads, launch.num_kv_heads, launch.num_kv_heads)
    qkv = torch.zeros(batch, sum(heads) * launch.head_size, dtype=launch.dtype)
    q, k, _ = (
        t.unflatten(-1, (h, launch.head_size))
        for t, h in zip(qkv.split([h * launch.head_size for h in heads], -1), heads)
    )
    cos_sin = torch.zeros(max_model_len, 2, launch.head_size, dtype=launch.dtype)
    rotary_embedding_triton(torch.zeros(batch, dtype=torch.int64), q, k, cos_sin)


def _norm(launch: lc.NormLaunch, batch: int, max_model_len: int) -> None:
    x = torch.zeros(batch, launch.hidden_size, dtype=launch.dtype)
    weight = torch.zeros(launch.hidden_size, dtype=launch.dtype)
    if launch.residual:
        fused_add_rms_norm_triton(x, x.clone(), weight, 1e-6)
    else:
        rms_norm_triton(x, weight, 1e-6)


def _matmul(launch: lc.MatmulLaunch, batch: int, max_model_len: int) -> None:
    weight = torch.zeros(launch.out_features, launch.in_features, dtype=launch.dtype)
    bias = torch.zeros(launch.out_features, dtype=launch.dtype) if launch.bias else None
    x = torch.zeros(batch, launch.in_features, dtype=launch.dtype)
    matmul_triton(x, weight, bias, torch.float32 if launch.logits else launch.dtype)


def _quant_matmul(launch: lc.QuantMatmulLaunch, batch: int, max_model_len: int) -> None:
    shape = launch.matmul
    n, k = shape.out_features, shape.in_features
    rows = torch.zeros(n, k // BLOCK * block_bytes(launch.qtype), dtype=torch.uint8)
    bias = torch.zeros(n, dtype=shape.dtype) if shape.bias else None
    x = torch.zeros(batch, k, dtype=shape.dtype)
    out_dtype = torch.float32 if shape.logits else shape.dtype
    quant_matmul_triton(x, GGUFRows(rows, launch.qtype, n, k), bias, out_dtype)


def _prepare_inputs(launch: lc.PrepareInputsLaunch, batch: int, max_model_len: int) -> None:
    # Runner V2's state table holds more rows than the batch uses.
    rows = batch + 3
    prepare_inputs_triton(
        torch.arange(batch, dtype=torch.int64),
        torch.arange(batch + 1, dtype=torch.int32),
        batch,
        torch.zeros(rows, max_model_len, dtype=torch.int64),
        torch.zeros(rows, dtype=torch.int64),
        torch.zeros(rows, triton.cdiv(max_model_len, launch.block_size), dtype=torch.int32),
        launch.block_size,
    )


def _sample(launch: lc.SamplingLaunch, batch: int, max_model_len: int) -> None:
    # What the sampler's metadata holds for a batch of rows alike: a greedy row turns top-k,
    # top-p and min-p off, and one penalty sets every penalty tensor.
    def rows(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((batch,), value, dtype=dtype)

    greedy, penalties = launch.all_greedy, launch.penalties
    inputs = SamplingInputs(
        temperature=rows(0.0 if greedy else 0.8),
        all_greedy=greedy,
        all_random=not greedy,
        top_k=rows(5, torch.int64) if launch.top_k and not greedy else None,
        top_p=rows(0.9) if launch.top_p and not greedy else None,
        min_p=rows(0.1) if launch.min_p and not greedy else None,
        seeds=[7] * batch,
        output_positions=[2] * batch,
        output_token_ids=[[1, 2]] * batch,
        prompt_token_ids=[[3]] * batch if penalties else None,
        presence_penalties=rows(0.0) if penalties else None,
        frequency_penalties=rows(0.0) if penalties else None,
        repetition_penalties=rows(1.2) if penalties else None,
    )
    sample_tokens_triton(torch.zeros(batch, launch.vocab_size, dtype=launch.dtype), inputs)


def _logprobs(launch: lc.LogprobsLaunch, batch: int, max_model_len: int) -> None:
    logits = torch.zeros(batch, launch.vocab_size, dtype=launch.dtype)
    topk_logprobs_triton(logits, torch.zeros(batch, dtype=torch.int64), launch.num_logprobs)


_LAUNCHERS: dict[type, Callable[[Any, int, int], None]] = {
    lc.AttentionLaunch: _attention,
    lc.KVWriteLaunch: _kv_write,
    lc.RotaryLaunch: _rotary,
    lc.NormLaunch: _norm,
    lc.MatmulLaunch: _matmul,
    lc.QuantMatmulLaunch: _quant_matmul,
    lc.PrepareInputsLaunch: _prepare_inputs,
    lc.SamplingLaunch: _sample,
    lc.LogprobsLaunch: _logprobs,
}


def kernels() -> list[str]:
    """Every Triton kernel of pdserve/kernels/ (helpers compile inside the kernels calling them)."""
    names = []
    for info in pkgutil.walk_packages(pdserve.kernels.__path__, "pdserve.kernels."):
        module = importlib.import_module(info.name)
        for attr, value in vars(module).items():
            if (
                isinstance(value, JITFunction)
                and attr.endswith("_kernel")
                and value.fn.__module__ == module.__name__  # not one imported to launch it
            ):
                names.append(f"{module.__name__}.{attr}")
    return sorted(names)


def problems(
    binaries: list[Compiled], archs: tuple[int, ...], every_kernel: bool = True
) -> list[str]:
    """Compiler errors, kernels that no configuration starts (`every_kernel`: all were
    compiled), and kernels whose binary depends on more than their configuration (the batch,
    max_model_len)."""
    out = [
        f"{b.kernel} for sm_{b.arch}, {b.launch}, constexprs {b.constexprs}:\n{b.error}"
        for b in binaries
        if b.error is not None
    ]
    for kernel, arch in itertools.product(kernels() if every_kernel else (), archs):
        if not any(b.kernel == kernel and b.arch == arch for b in binaries):
            out.append(f"{kernel} for sm_{arch}: no configuration in launch_configs.py starts it")
    variants: dict[tuple[str, int, str, str], set[str]] = {}
    for b in binaries:
        variants.setdefault((b.kernel, b.arch, b.launch, b.constexprs), set()).add(b.specialization)
    for (kernel, arch, launch, constexprs), keys in variants.items():
        if len(keys) > 1:
            out.append(
                f"{kernel} for sm_{arch}, {launch}, constexprs {constexprs}: {len(keys)} binaries"
                f" for the (batch, max_model_len) variants {VARIANTS}:\n" + "\n".join(sorted(keys))
            )
    return out


def compile_all(
    archs: tuple[int, ...] = ARCHS, jobs: int = 1, quick: bool = False, fp8_cache: bool = False
) -> list[Compiled]:
    launches = [
        launch
        for launch in lc.launches(quick)
        if not fp8_cache or getattr(launch, "cache_dtype", None) is not None
    ]
    tasks = [
        (arch, launch)
        for arch, launch in itertools.product(archs, launches)
        if lc.runs_on(launch, arch)
    ]
    if jobs == 1:
        results = [compile_launch(arch, launch) for arch, launch in tasks]
    else:
        # Spawned, not forked: a fork would inherit the parent's driver and hook state.
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
            results = list(pool.map(compile_launch, *zip(*tasks), chunksize=4))
    return [b for binaries in results for b in binaries]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS))
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="the default suite's share")
    parser.add_argument("--fp8-cache", action="store_true", help="fp8 KV cache variants only")
    parser.add_argument("--cache-dir", default=str(envs.cache_dir() / "triton"))
    parser.add_argument("--json", help="write every binary and every problem to this file")
    args = parser.parse_args(argv)
    if triton.knobs.runtime.interpret:
        print("TRITON_INTERPRET is set: unset it, the interpreter compiles nothing.")
        return 2
    # Also sets TRITON_CACHE_DIR, which the spawned workers inherit.
    triton.knobs.cache.dir = args.cache_dir
    archs = tuple(args.arch)
    binaries = compile_all(archs, args.jobs, args.quick, args.fp8_cache)
    found = problems(binaries, archs, every_kernel=not args.fp8_cache)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"binaries": [asdict(b) for b in binaries], "problems": found}, f)
    for problem in found:
        print(f"FAILED {problem}")
    print(
        f"{len({(b.kernel, b.arch, b.specialization) for b in binaries})} binaries of "
        f"{len({b.kernel for b in binaries})} kernels for {len({b.launch for b in binaries})} "
        f"configurations x {', '.join(f'sm_{a}' for a in archs)}: {len(found)} problems"
    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
