"""Online serving: streamed requests against an OpenAI-compatible server (`vllm bench serve`'s metrics).

Usage: python benchmarks/serving.py [bench serve flags, see pdserve/entrypoints/bench_serve.py]
       python benchmarks/serving.py --launch [flags] -- --model M --dtype float32

With --launch the script starts `pdserve serve` on --base-url's port (server flags after `--`),
waits for /health, benchmarks it and stops it. Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.entrypoints.bench_serve import add_bench_serve_args, run_bench_serve  # noqa: E402

HEALTH_TIMEOUT_S = 900
STOP_GRACE_S = 10


def launch_server(
    port: int,
    server_args: list[str],
    command: str = "serve",
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen:
    """`pdserve <command>` (serve, or launch for a split deployment behind its proxy), with `env`
    added to this process's environment; `cwd` a pdserve checkout to run instead of this one
    (`python -m` imports from its working directory first, and so do the processes it starts)."""
    cmd = [
        sys.executable,
        "-m",
        "pdserve.entrypoints.cli",
        command,
        "--port",
        str(port),
        *server_args,
    ]
    # Its own process group, so that stop_server reaches the workers the server starts too.
    return subprocess.Popen(cmd, env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, base_url: str) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet
        time.sleep(0.5)
    raise TimeoutError(f"{base_url}/health not 200 within {HEALTH_TIMEOUT_S} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    # Whatever is left of the group (a hung server, or workers it did not reap) is killed.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main() -> None:
    # argparse would take the server's flags after `--` as positionals, so they are split off first.
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    bench_argv, server_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_bench_serve_args(parser)
    parser.add_argument(
        "--launch", action="store_true", help="start `pdserve serve` on --base-url's port"
    )
    args = parser.parse_args(bench_argv)
    if server_args and not args.launch:
        parser.error("server flags after `--` need --launch")

    proc = None
    try:
        if args.launch:
            proc = launch_server(urlsplit(args.base_url).port or 80, server_args)
            wait_healthy(proc, args.base_url)
        result = run_bench_serve(args)
    finally:
        if proc is not None:
            stop_server(proc)
    print(json.dumps({"benchmark": "serving", **result}))


if __name__ == "__main__":
    main()
