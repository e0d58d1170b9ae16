"""RayExecutor: one Ray actor per rank, placed in a placement group, driven by Ray actor tasks.

Control plane. Each call is one msgspec-encoded `RPCCall` (executor/rpc.py), sent as the bytes
argument of an actor task to every rank; the reply is an encoded `RPCReply`, so no object of
ours is pickled (Ray pickles a bytes object, which is the bytes). vLLM's RayExecutorV2 instead
reuses the multiprocess MessageQueue with TCP readers; here Ray's own tasks are the simpler and
sturdier choice:
- Ray already carries bytes between nodes; the queue would add a second transport (shared memory,
  ZMQ over TCP) with its own ports to open between nodes.
- The queue's shared memory would be attached by processes Ray starts rather than by our spawned
  children: on Python < 3.13 each actor's resource tracker unlinks it when the actor dies.
- A dead actor fails its pending tasks at once (RayActorError): no call waits for a reply that
  cannot come.
The price is one actor task per rank per call (about 2 ms round trip on one node), small beside
a step.

Order. The actors are synchronous with max_concurrency 1 and in-order execution, so each runs the
tasks of this driver in submission order: every rank sees the calls in the same order, which its
collectives need, and a response thread resolves futures in that order too. The one other method,
`wait_for_death`, runs in its own concurrency group and never returns: its ObjectRef becomes ready
(with an error) only when the actor dies, which the monitor thread watches for (both threads:
executor/worker_calls.py). See docs/executors.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

# Without Ray this import fails; Executor.get_class turns that into the install hint.
import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.config import EngineConfig
from pdserve.executor.base import Executor
from pdserve.executor.ray_worker import RayWorker
from pdserve.executor.rpc import check_method, decode_reply, decode_results, encode_call
from pdserve.executor.worker import Worker
from pdserve.executor.worker_calls import WorkerCalls, wait_for_reply

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 300.0
_MONITOR_POLL_S = 5.0  # how often the monitor looks up from ray.wait to notice a shutdown
_SHUTDOWN_WAIT_S = 10.0
# The driver's PDSERVE_* settings (runner choice, KV space...) and Triton's interpreter switch
# must hold in every worker, whose environment is the raylet's, not ours.
_CARRIED_ENV_PREFIXES = ("PDSERVE_", "TRITON_INTERPRET")


def carried_env() -> dict[str, str]:
    """This process's variables that must hold in what it starts through Ray."""
    return {k: v for k, v in os.environ.items() if k.startswith(_CARRIED_ENV_PREFIXES)}


@dataclass
class RayWorkerHandle:
    rank: int
    actor: ActorHandle
    node_id: str
    death_ref: ray.ObjectRef


@dataclass
class _PendingCall:
    method: str
    args: tuple[Any, ...]  # a result is decoded against its call's arguments
    refs: list[tuple[int, ray.ObjectRef]]  # (rank, reply) of the ranks that reply
    single: bool


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, placement_group: PlacementGroup | None = None) -> None:
        super().__init__(config)
        self.world_size = config.parallel_config.world_size
        self.shutting_down = False
        self.workers: list[RayWorkerHandle] = []
        # Every actor started and its wait_for_death ref, in start order (ranks come later).
        self._actors: list[ActorHandle] = []
        self._death_refs: list[ray.ObjectRef] = []
        self._calls: WorkerCalls[_PendingCall] = WorkerCalls(
            self._read_replies, self._wait_for_death, self._worker_died
        )
        self._send_lock = threading.Lock()
        if not ray.is_initialized():
            # Joins the cluster of RAY_ADDRESS or of `ray start` on this node, else starts a
            # local one, which lives until this process exits.
            ray.init(include_dashboard=False)
        # Inside a Ray task or actor placed in a group (vLLM's convention), that group is used.
        user_pg = placement_group or ray.util.get_current_placement_group()
        self._owns_placement_group = user_pg is None
        self.placement_group: PlacementGroup | None = user_pg
        try:
            if self.placement_group is None:
                self.placement_group = self._create_placement_group()
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise
        self._calls.start()

    # ---- start-up ----------------------------------------------------------------------------

    @property
    def _device_resource(self) -> str:
        return "GPU" if self.config.device == "cuda" else "CPU"

    def _create_placement_group(self) -> PlacementGroup:
        # PACK: as few nodes as possible, so that TP ranks share a node where they fit.
        pg = ray.util.placement_group(
            [{self._device_resource: 1.0}] * self.world_size, strategy="PACK"
        )
        if not pg.wait(timeout_seconds=int(_STARTUP_TIMEOUT_S)):
            ray.util.remove_placement_group(pg)
            raise RuntimeError(
                f"Ray could not reserve {self.world_size} bundles of 1 {self._device_resource} "
                f"within {_STARTUP_TIMEOUT_S:.0f} s; available: {ray.available_resources()}."
            )
        return pg

    def _bundle_indices(self) -> list[int]:
        """The first world_size bundles of the placement group that hold one device each."""
        res = self._device_resource
        indices = [i for i, b in enumerate(self.placement_group.bundle_specs) if b.get(res, 0) >= 1]
        if len(indices) < self.world_size:
            raise ValueError(
                f"placement_group has {len(indices)} bundles with 1 {res}; world size "
                f"{self.world_size} (tensor_parallel_size x pipeline_parallel_size) needs that many."
            )
        return indices[: self.world_size]

    def _start_workers(self) -> None:
        gpu = self._device_resource == "GPU"
        env = carried_env()
        for index in self._bundle_indices():
            self._actors.append(
                RayWorker.options(
                    num_cpus=0 if gpu else 1,
                    num_gpus=1 if gpu else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement_group, placement_group_bundle_index=index
                    ),
                    # Stated, not defaulted: every rank must run the calls in the order they were sent.
                    allow_out_of_order_execution=False,
                    runtime_env={"env_vars": env},
                ).remote()
            )
        self._death_refs = [actor.wait_for_death.remote() for actor in self._actors]
        infos = self._wait_all(
            [a.node_info.remote() for a in self._actors], "actor", "report its node"
        )
        # Ranks: the driver's node first (rank 0 there hosts the TCP store), then node by node.
        driver_node = ray.get_runtime_context().get_node_id()
        order = sorted(range(len(infos)), key=lambda i: (infos[i][0] != driver_node, infos[i][1]))
        self.workers = [
            RayWorkerHandle(rank, self._actors[i], infos[i][0], self._death_refs[i])
            for rank, i in enumerate(order)
        ]
        _, ip, port = infos[order[0]]
        init_method = f"tcp://{ip}:{port}"
        self._wait_all(
            [w.actor.setup.remote(self.config, w.rank, init_method) for w in self.workers],
            "rank",
            "start",
        )

    @staticmethod
    def _wait_all(refs: list[ray.ObjectRef], index_name: str, step: str) -> list[Any]:
        """The results of one start-up call per worker, in order (index: actor or rank).

        The first failure is raised at once, naming its worker: the others may be waiting for it
        in a collective and would never finish.
        """
        pending = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while pending:
            done, _ = ray.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise RuntimeError(
                    f"Worker {index_name}s {sorted(pending.values())} did not "
                    f"{step} within {_STARTUP_TIMEOUT_S:.0f} s."
                )
            i = pending.pop(done[0])
            try:
                results[i] = ray.get(done[0])
            except RayTaskError as e:
                cause = e.cause if e.cause is not None else e
                raise RuntimeError(
                    f"Worker {index_name} {i} failed to {step}: {type(cause).__name__}: {cause}"
                ) from None
            except RayActorError as e:
                raise RuntimeError(
                    f"Worker {index_name} {i} died before it could {step}: {e}"
                ) from None
        return results

    # ---- RPC -----------------------------------------------------------------------------------

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        check_method(Worker, method)
        payload = encode_call(method, args, kwargs or {}, unique_reply_rank)
        ranks = range(self.world_size) if unique_reply_rank is None else [unique_reply_rank]
        with self._send_lock:  # a call's place in the queue is its place on every actor
            # Checked under the lock: no call may queue behind shutdown's end-of-calls mark.
            if self.is_failed or self.shutting_down:
                raise RuntimeError("Executor failed.")
            refs = [w.actor.call.remote(payload) for w in self.workers]
            future = self._calls.add(
                _PendingCall(
                    method, args, [(r, refs[r]) for r in ranks], unique_reply_rank is not None
                )
            )
        return wait_for_reply(future, method, timeout, non_block)

    def _read_replies(self, call: _PendingCall) -> Any:
        replies = [
            (rank, decode_reply(self._get(rank, ref, call.method))) for rank, ref in call.refs
        ]
        results = decode_results(Worker, call.method, replies, call.args)
        return results[0] if call.single else results

    @staticmethod
    def _get(rank: int, ref: ray.ObjectRef, method: str) -> bytes:
        try:
            return ray.get(ref)
        except RayActorError:
            raise RuntimeError(f"Executor failed: worker rank {rank} died in {method}.") from None

    # ---- failure and shutdown --------------------------------------------------------------

    def _wait_for_death(self) -> str | None:
        refs = [w.death_ref for w in self.workers]
        done: list[ray.ObjectRef] = []
        while not done and not self.shutting_down:
            done, _ = ray.wait(refs, num_returns=1, timeout=_MONITOR_POLL_S)
        if self.shutting_down:
            return None
        dead = self.workers[refs.index(done[0])]
        return f"rank {dead.rank} (Ray actor on node {dead.node_id})"

    def shutdown(self) -> None:
        """Kill the actors and release the placement group; Ray itself keeps running."""
        if self.shutting_down:
            return
        self.shutting_down = True
        for actor in self._actors:
            ray.kill(actor)
        if self._death_refs:
            # Wait for the kills to land, so that the devices are free when this returns.
            _, alive = ray.wait(
                self._death_refs, num_returns=len(self._death_refs), timeout=_SHUTDOWN_WAIT_S
            )
            if alive:
                logger.warning(
                    "%d Ray workers were still alive %.0f s after being killed.",
                    len(alive),
                    _SHUTDOWN_WAIT_S,
                )
        if self._owns_placement_group and self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
        self.placement_group = None
        with self._send_lock:
            self._calls.close()
