"""`pdserve launch`: prefill instances, decode instances and the proxy.

Instances run as child processes here, or placed on a Ray cluster with `--ray` (launch_ray.py);
the proxy always runs here. Ports are assigned where each part runs (HTTP and side channel per
instance). The launcher waits until every part answers /health, prints the endpoint, and stops
them all on Ctrl-C or SIGTERM, or when any part dies first: a deployment with a dead part is not
left half-running. The one exception is an instance lost with its Ray node, which the proxy's
health checks mark down while its role has survivors (docs/serving.md, "On a Ray cluster"). Each
child runs in its own session (so stopping is our job, in order) and gets SIGTERM if the launcher
itself is killed.
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
from typing import TYPE_CHECKING, Protocol

import httpx

from pdserve import envs
from pdserve.core_board import create_board
from pdserve.proxy.routing import add_routing_args, routing_flags
from pdserve.utils import get_open_port

if TYPE_CHECKING:
    from pdserve.entrypoints.launch_ray import RayInstances

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 20.0
SERVE_CMD = [sys.executable, "-m", "pdserve.entrypoints.cli"]
PROXY = "proxy"  # the proxy's name among the children


def die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Part(Protocol):
    """A running part of the deployment, wherever it runs."""

    name: str
    url: str

    def exit_status(self) -> str | None:
        """None while it runs; else how it ended ("exited with code 1")."""

    @property
    def lost(self) -> bool:
        """Whether it ended with its node rather than by itself."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    lost = False

    def exit_status(self) -> str | None:
        code = self.proc.poll()
        return None if code is None else f"exited with code {code}"


class Launcher:
    """The child processes started here."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.children: list[Child] = []

    def spawn(
        self, name: str, args: list[str], port: int, env: dict[str, str] | None = None
    ) -> Child:
        cmd = [*SERVE_CMD, *args, "--host", self.host, "--port", str(port)]
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        child = Child(name, proc, f"http://{self.host}:{port}")
        self.children.append(child)
        logger.info("started %s (pid %d): %s", name, proc.pid, " ".join(cmd))
        return child

    def stop(self) -> None:
        """SIGTERM the proxy, then, once it is gone, the instances: a proxy still checking them
        would report each draining instance down. SIGKILL whatever is left after
        STOP_GRACE_S."""
        deadline = time.monotonic() + STOP_GRACE_S
        proxies = [c for c in self.children if c.name == PROXY]
        for group in (proxies, [c for c in self.children if c.name != PROXY]):
            for child in group:
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            for child in group:
                try:
                    child.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning(
                        "%s did not stop in %.0f s; killing it", child.name, STOP_GRACE_S
                    )
        for child in self.children:
            # The child's session holds its engine and workers too.
            try:
                os.killpg(child.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.proc.wait()


def wait_healthy(parts: list[Part], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(parts)
    while pending:
        for part in list(pending):
            if (status := part.exit_status()) is not None:
                raise RuntimeError(f"{part.name} {status} during start-up")
            try:
                if httpx.get(f"{part.url}/health", timeout=2).status_code == 200:
                    pending.remove(part)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(
                f"not healthy after {timeout_s:.0f} s: {', '.join(p.name for p in pending)}"
            )
        time.sleep(0.25)


def watch(proxy: Part, instances: dict[str, list[Part]]) -> int:
    """Until a part ends (1 then), dropping instances lost with their node while their role
    has others."""
    while True:
        for role, parts in instances.items():
            for part in list(parts):
                if (status := part.exit_status()) is None:
                    continue
                if part.lost and len(parts) > 1:
                    parts.remove(part)
                    print(
                        f"pdserve launch: {part.name} {status}; the proxy marks it down, "
                        f"{len(parts)} {role} instance(s) serve on.",
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
                return _stopping(part.name, status)
        if (status := proxy.exit_status()) is not None:
            return _stopping(proxy.name, status)
        time.sleep(0.5)


def _stopping(name: str, status: str) -> int:
    logger.error("%s %s; stopping the deployment.", name, status)
    print(f"pdserve launch: {name} {status}; stopping.", file=sys.stderr, flush=True)
    return 1


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill instances")
    parser.add_argument("--decode", type=int, default=1, help="number of decode instances")
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--host", default="127.0.0.1", help="the proxy's address, and local instances'"
    )
    parser.add_argument("--port", type=int, default=8000, help="the proxy's port")
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--transport", choices=["nixl", "ucx"], default="nixl")
    parser.add_argument(
        "--ucx-tls",
        default=None,
        help="UCX transports for the ucx transport (e.g. self,tcp between nodes); "
        "kv_connector_extra_config.ucx_tls",
    )
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
    parser.add_argument(
        "--ray",
        action="store_true",
        help="place the instances on a Ray cluster (pip install 'pdserve[ray]'): "
        "one placement group per instance, its ranks on one node",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="the cluster to join (host:port); default: RAY_ADDRESS, the cluster `ray start` "
        "runs on this node, else a local Ray started for the deployment",
    )
    parser.add_argument(
        "--ray-cpus-per-rank",
        type=int,
        default=1,
        help="logical CPUs each rank reserves (and its torch threads on CPU)",
    )
    add_routing_args(parser)  # passed to the proxy too


def kv_events_config() -> str:
    """Each instance publishes its KV cache events (the proxy routes by them) on its own ports,
    free on the host it runs on."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{get_open_port()}",
            "replay_endpoint": f"tcp://*:{get_open_port()}",
        }
    )


def serve_args(args: argparse.Namespace, role: str, tp: int, instance_args: list[str]) -> list[str]:
    """`pdserve serve`'s flags for one instance, less its addresses and KV event ports."""
    extra: dict[str, str] = {"transport": args.transport}
    if args.ucx_tls:
        extra["ucx_tls"] = args.ucx_tls
    kv_config = {
        "kv_connector": "NixlPushConnector" if args.kv_mode == "push" else "NixlConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": extra,
    }
    serve = [
        "serve",
        *(["--model", args.model] if args.model else []),
        "--kv-transfer-config",
        json.dumps(kv_config),
        "--tensor-parallel-size",
        str(tp),
        *instance_args,
    ]
    if tp > 1:
        serve += ["--distributed-executor-backend", "mp"]
    return serve


def proxy_args(args: argparse.Namespace, instances: dict[str, list[Part]]) -> list[str]:
    address = lambda p: p.url.removeprefix("http://")  # noqa: E731
    return [
        "proxy",
        "--prefill",
        *map(address, instances["prefill"]),
        "--decode",
        *map(address, instances["decode"]),
        *(["--strict-pd"] if args.strict_pd else []),
        "--kv-mode",
        args.kv_mode,
        *(["--model", args.model] if args.model else []),
        *routing_flags(args),
    ]


def roles(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(role, number of instances, TP size of each)."""
    return [("prefill", args.prefill, args.prefill_tp), ("decode", args.decode, args.decode_tp)]


class LocalInstances:
    """The instances as children of this process, sharing its cores."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.board: Path | None = None

    def start(self, args: argparse.Namespace, instance_args: list[str]) -> dict[str, list[Part]]:
        # Each worker gets its share of torch threads, and borrows the shares of idle workers on
        # the core board, unless PDSERVE_CPU_THREADS fixes them.
        num_workers = args.prefill * args.prefill_tp + args.decode * args.decode_tp
        threads = str(envs.cpu_threads() or max(1, (os.cpu_count() or 1) // num_workers))
        if not envs.cpu_threads():
            self.board = Path(f"/dev/shm/pdserve-cores-{os.getpid()}")
            create_board(self.board, num_workers)
        slot = 0
        instances: dict[str, list[Part]] = {}
        for role, count, tp in roles(args):
            instances[role] = []
            for i in range(count):
                serve = serve_args(args, role, tp, instance_args)
                if "--kv-events-config" not in instance_args:
                    serve += ["--kv-events-config", kv_events_config()]
                env = {
                    "PDSERVE_SIDE_CHANNEL_HOST": args.host,
                    "PDSERVE_SIDE_CHANNEL_PORT": str(get_open_port()),
                    "PDSERVE_CPU_THREADS": threads,
                }
                if self.board is not None:
                    env["PDSERVE_CORE_BOARD"] = f"{self.board}:{slot}"
                    slot += tp
                child = self.launcher.spawn(f"{role}-{i}", serve, get_open_port(), env)
                instances[role].append(child)
        return instances

    def started(self) -> None:
        """Every instance has mapped the board: nothing is left behind if we die."""
        self.stop()

    def stop(self) -> None:
        if self.board is not None:
            self.board.unlink(missing_ok=True)


def _placement(args: argparse.Namespace, launcher: Launcher) -> LocalInstances | RayInstances:
    if not args.ray:
        return LocalInstances(launcher)
    try:
        from pdserve.entrypoints.launch_ray import RayInstances
    except ImportError as e:
        raise RuntimeError(f"--ray: {e}; pip install 'pdserve[ray]'") from None
    return RayInstances(args.ray_address)


def run_launch(args: argparse.Namespace, instance_args: list[str]) -> int:
    """`instance_args`: flags passed on to every `pdserve serve` (e.g. --dtype float32)."""
    if args.prefill < 1 or args.decode < 1:
        raise ValueError("--prefill and --decode must each be at least 1")
    if args.ray_cpus_per_rank < 1:
        raise ValueError("--ray-cpus-per-rank must be at least 1")
    launcher = Launcher(args.host)
    try:
        placed = _placement(args, launcher)
    except RuntimeError as e:
        print(f"pdserve launch: {e}", file=sys.stderr)
        return 1

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # After Ray's start, which installs a SIGTERM handler of its own in this process.
    signal.signal(signal.SIGTERM, on_signal)
    try:
        instances = placed.start(args, instance_args)
        wait_healthy(instances["prefill"] + instances["decode"], args.startup_timeout)
        placed.started()
        proxy = launcher.spawn(PROXY, proxy_args(args, instances), args.port)
        wait_healthy([proxy], 60)
        where = " on Ray" if args.ray else ""
        print(
            f"pdserve launch: serving {proxy.url}/v1 ({args.prefill} prefill, {args.decode} decode "
            f"instances{where}); Ctrl-C stops everything.",
            flush=True,
        )
        return watch(proxy, instances)
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"pdserve launch: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        launcher.stop()
        placed.stop()
