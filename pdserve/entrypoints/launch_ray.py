"""`pdserve launch --ray`: the deployment's instances placed on a Ray cluster.

Each instance gets a placement group of one bundle that holds all its ranks (their CPUs, and
their GPUs where the cluster has GPUs), so an instance lands on one node. An `InstanceActor`
placed in that bundle runs `pdserve serve` on the node as its child, with the instance's workers
under it (the mp executor): the actor holds the bundle's GPUs, so the CUDA_VISIBLE_DEVICES Ray
gives it names exactly the instance's devices. A bundle per rank would reserve the same devices
but leave the ranks after the first without a name for theirs. The instance's HTTP address, its
side channel and UCX listener (PDSERVE_SIDE_CHANNEL_HOST) are its node's IP, with ports found free
there. See docs/serving.md, "On a Ray cluster".

Lifetimes. The actors belong to the launcher (not detached): if it dies, Ray kills them. The
serve process dies with its actor (PR_SET_PDEATHSIG), its engine and workers with it. An instance
whose serve process exits stops the deployment; one whose actor dies (its node lost) is `lost`,
which the launcher survives while its role has other instances.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import uuid

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.entrypoints.launch import (
    SERVE_CMD,
    STOP_GRACE_S,
    Part,
    die_with_parent,
    kv_events_config,
    roles,
    serve_args,
)
from pdserve.executor.ray_executor import carried_env
from pdserve.utils import get_open_port


@ray.remote(concurrency_groups={"wait": 1})
class InstanceActor:
    """One instance's `pdserve serve`, on the node of its placement group."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        ip = ray.util.get_node_ip_address()
        port = get_open_port(ip)
        if "--kv-events-config" not in args:
            args = [*args, "--kv-events-config", kv_events_config()]
        env = {
            **os.environ,
            **env,
            "PDSERVE_SIDE_CHANNEL_HOST": ip,
            "PDSERVE_SIDE_CHANNEL_PORT": str(get_open_port(ip)),
        }
        self.url = f"http://{ip}:{port}"
        self.proc = subprocess.Popen(
            [*SERVE_CMD, *args, "--host", ip, "--port", str(port)],
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def where(self) -> tuple[str, str]:
        """(its URL, its node's id)."""
        return self.url, ray.get_runtime_context().get_node_id()

    @ray.method(concurrency_group="wait")
    def wait(self) -> int:
        """The serve process's exit code, once it has one."""
        return self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the instance's whole session after the grace period."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class RayInstance:
    def __init__(self, name: str, actor: ActorHandle, url: str, node_id: str) -> None:
        self.name = name
        self.actor = actor
        self.url = url
        self.node_id = node_id
        self.ended = actor.wait.remote()
        self.lost = False
        self._status: str | None = None

    def exit_status(self) -> str | None:
        if self._status is None and ray.wait([self.ended], timeout=0)[0]:
            try:
                self._status = f"exited with code {ray.get(self.ended)}"
            except RayActorError:
                self.lost = True
                self._status = f"was lost with its Ray actor (node {self.node_id[:12]})"
        return self._status


class RayInstances:
    """The instances of one launch, each on the node Ray placed its placement group on."""

    def __init__(self, address: str | None) -> None:
        # (name, its placement group, its actor), in the order they were placed.
        self.placing: list[tuple[str, PlacementGroup, ActorHandle]] = []
        self.placed: list[ActorHandle] = []
        # RAY_ADDRESS, or the cluster `ray start` runs on this node, or else a local Ray.
        try:
            ray.init(address=address, include_dashboard=False)
        except ConnectionError as e:
            raise RuntimeError(f"cannot join the Ray cluster at {address}: {e}") from e

    def start(self, args: argparse.Namespace, instance_args: list[str]) -> dict[str, list[Part]]:
        launch_id = uuid.uuid4().hex[:8]
        gpus = ray.cluster_resources().get("GPU", 0) >= 1
        env = {"PDSERVE_CPU_THREADS": str(args.ray_cpus_per_rank), **carried_env()}
        roles_of: dict[str, str] = {}
        # Ray places groups in the order they were made: the largest first, so that a small
        # instance does not take the node a large one needs.
        for role, count, tp in sorted(roles(args), key=lambda r: -r[2]):
            bundle = {"CPU": float(tp * args.ray_cpus_per_rank)}
            if gpus:
                bundle["GPU"] = float(tp)
            for i in range(count):
                name = f"{role}-{i}"
                roles_of[name] = role
                group = ray.util.placement_group([bundle], name=f"pdserve-{launch_id}-{name}")
                actor = InstanceActor.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0),
                ).remote(serve_args(args, role, tp, instance_args), env)
                self.placing.append((name, group, actor))
        self._wait_placed(args.startup_timeout)
        try:
            places = ray.get([actor.where.remote() for actor in self.placed])
        except RayError as e:
            raise RuntimeError(f"an instance failed to start on its node: {e}") from None
        instances: dict[str, list[Part]] = {"prefill": [], "decode": []}
        for (name, _, actor), (url, node_id) in zip(self.placing, places, strict=True):
            instances[roles_of[name]].append(RayInstance(name, actor, url, node_id))
            print(f"pdserve launch: {name} at {url} on Ray node {node_id}", flush=True)
        return instances

    def _wait_placed(self, timeout_s: float) -> None:
        ready = [group.ready() for _, group, _ in self.placing]
        done, _ = ray.wait(ready, num_returns=len(ready), timeout=timeout_s)
        self.placed = [actor for (_, _, actor), r in zip(self.placing, ready) if r in done]
        if unplaced := [
            f"{name} needs a node with {group.bundle_specs[0]}"
            for (name, group, _), r in zip(self.placing, ready)
            if r not in done
        ]:
            raise RuntimeError(
                f"Ray could not place {len(unplaced)} of {len(ready)} instances within "
                f"{timeout_s:.0f} s ({'; '.join(unplaced)}); available: "
                f"{ray.available_resources()}"
            )

    def started(self) -> None:
        pass

    def stop(self) -> None:
        if not ray.is_initialized():
            return
        # An actor whose group was never placed never started: it has nothing to stop.
        if stops := [actor.stop.remote() for actor in self.placed]:
            ray.wait(stops, num_returns=len(stops), timeout=STOP_GRACE_S + 5)
        for _, group, actor in self.placing:
            ray.kill(actor)
            ray.util.remove_placement_group(group)
        ray.shutdown()
