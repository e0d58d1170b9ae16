"""`pdserve launch`: prefill instances, decode instances and the proxy as child processes.

Ports are assigned here (HTTP and side channel per instance). The launcher waits until every
child answers /health, prints the endpoint, and stops them all on Ctrl-C or SIGTERM, or when any
child dies first: a deployment with a dead part is not left half-running. Each child runs in its
own session (so stopping is our job, in order) and gets SIGTERM if the launcher itself is killed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve import envs
from pdserve.entrypoints.proxy_routing import add_routing_args, routing_flags
from pdserve.executor.cpu_cores import create_board
from pdserve.utils import get_open_port

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_STOP_GRACE_S = 20.0


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    url: str


class Launcher:
    def __init__(self, host: str) -> None:
        self.host = host
        self.children: list[Child] = []

    def spawn(
        self, name: str, args: list[str], port: int, env: dict[str, str] | None = None
    ) -> Child:
        cmd = [
            sys.executable,
            "-m",
            "pdserve.entrypoints.cli",
            *args,
            "--host",
            self.host,
            "--port",
            str(port),
        ]
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        child = Child(name, proc, f"http://{self.host}:{port}")
        self.children.append(child)
        logger.info("started %s (pid %d): %s", name, proc.pid, " ".join(cmd))
        return child

    def wait_healthy(self, children: list[Child], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(children)
        while pending:
            for child in list(pending):
                if child.proc.poll() is not None:
                    raise RuntimeError(
                        f"{child.name} exited with code {child.proc.returncode} during start-up"
                    )
                try:
                    if httpx.get(f"{child.url}/health", timeout=2).status_code == 200:
                        pending.remove(child)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"not healthy after {timeout_s:.0f} s: {', '.join(c.name for c in pending)}"
                )
            time.sleep(0.25)

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self) -> None:
        """SIGTERM every child (proxy first, as it was started last), then SIGKILL stragglers."""
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for child in self.children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0f s; killing it", child.name, _STOP_GRACE_S)
        for child in self.children:
            # The child's session holds its engine and workers too.
            try:
                os.killpg(child.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.proc.wait()


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill instances")
    parser.add_argument("--decode", type=int, default=1, help="number of decode instances")
    parser.add_argument("--model", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the proxy's port")
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--transport", choices=["nixl", "ucx"], default="nixl")
    parser.add_argument(
        "--kv-mode",
        choices=["pull", "push"],
        default="pull",
        help="pull: NixlConnector, the decode instance reads the KV; push: NixlPushConnector, "
        "the prefill instance writes it as it computes (the proxy sends both hops at once)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument(
        "--strict-pd", action="store_true", help="passed to the proxy: no local prefill path"
    )
    add_routing_args(parser)  # passed to the proxy too


def _kv_config(role: str, transport: str, kv_mode: str) -> str:
    return json.dumps(
        {
            "kv_connector": "NixlPushConnector" if kv_mode == "push" else "NixlConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"transport": transport},
        }
    )


def _kv_events_config() -> str:
    """Each instance publishes its KV cache events (the proxy routes by them) on its own ports."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{get_open_port()}",
            "replay_endpoint": f"tcp://*:{get_open_port()}",
        }
    )


def run_launch(args: argparse.Namespace, instance_args: list[str]) -> int:
    """`instance_args`: flags passed on to every `pdserve serve` (e.g. --dtype float32)."""
    if args.prefill < 1 or args.decode < 1:
        raise ValueError("--prefill and --decode must each be at least 1")
    launcher = Launcher(args.host)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    model = ["--model", args.model] if args.model else []
    # Instances on one host share its cores: each worker gets its share of torch threads, and
    # borrows the shares of idle workers on the core board, unless PDSERVE_CPU_THREADS fixes them.
    num_workers = args.prefill * args.prefill_tp + args.decode * args.decode_tp
    threads = str(envs.cpu_threads() or max(1, (os.cpu_count() or 1) // num_workers))
    board = None if envs.cpu_threads() else Path(f"/dev/shm/pdserve-cores-{os.getpid()}")
    slot = 0
    try:
        if board is not None:
            create_board(board, num_workers)
        instances = {"prefill": [], "decode": []}
        for role, count, tp in (
            ("prefill", args.prefill, args.prefill_tp),
            ("decode", args.decode, args.decode_tp),
        ):
            for i in range(count):
                kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
                serve = [
                    "serve",
                    *model,
                    "--kv-transfer-config",
                    _kv_config(kv_role, args.transport, args.kv_mode),
                    "--tensor-parallel-size",
                    str(tp),
                    *instance_args,
                ]
                if "--kv-events-config" not in instance_args:
                    serve += ["--kv-events-config", _kv_events_config()]
                if tp > 1:
                    serve += ["--distributed-executor-backend", "mp"]
                env = {
                    "PDSERVE_SIDE_CHANNEL_HOST": args.host,
                    "PDSERVE_SIDE_CHANNEL_PORT": str(get_open_port()),
                    "PDSERVE_CPU_THREADS": threads,
                }
                if board is not None:
                    env["PDSERVE_CORE_BOARD"] = f"{board}:{slot}"
                    slot += tp
                instances[role].append(launcher.spawn(f"{role}-{i}", serve, get_open_port(), env))
        launcher.wait_healthy(instances["prefill"] + instances["decode"], args.startup_timeout)
        if board is not None:  # every instance has mapped it: nothing is left behind if we die
            board.unlink()
        address = lambda c: c.url.removeprefix("http://")  # noqa: E731
        proxy = launcher.spawn(
            "proxy",
            [
                "proxy",
                "--prefill",
                *map(address, instances["prefill"]),
                "--decode",
                *map(address, instances["decode"]),
                *(["--strict-pd"] if args.strict_pd else []),
                "--kv-mode",
                args.kv_mode,
                *model,
                *routing_flags(args),
            ],
            args.port,
        )
        launcher.wait_healthy([proxy], 60)
        print(
            f"pdserve launch: serving {proxy.url}/v1 ({args.prefill} prefill, {args.decode} decode "
            "instances); Ctrl-C stops everything.",
            flush=True,
        )
        while (dead := launcher.first_exited()) is None:
            time.sleep(0.5)
        logger.error(
            "%s exited with code %s; stopping the deployment.", dead.name, dead.proc.returncode
        )
        print(
            f"pdserve launch: {dead.name} exited (code {dead.proc.returncode}); stopping.",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"pdserve launch: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        launcher.stop()
        if board is not None:
            board.unlink(missing_ok=True)
