"""Push mode (NixlPushConnector, docs/push.md): the prefill side WRITEs each block into the
decode side's blocks as soon as it is final.

Decode side (`PushReceiver`): a request's blocks are allocated on arrival and registered with
every prefill rank it reads from (the same ranks and landing places a pull would READ); it waits
for each rank's `Pushed`, while their `PushAlive`s keep its watchdog from firing. Prefill side
(`PushSender`): registrations wait for their request (the two legs of a request arrive in either
order); each step's final blocks go out; a registration ends with `Pushed`, which the request's
lease counts as a `done` (lease.py), so the blocks free when every registrant is served, or when
the lease expires unregistered. Nothing here raises out of a step: a failure ends one request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.kv_connector.nixl.lease import LeaseHolder
from pdserve.kv_connector.nixl.metadata import (
    Notif,
    PushAlive,
    Pushed,
    PushRegistration,
    PushReqMeta,
    RecvReqMeta,
    send,
)
from pdserve.kv_connector.nixl.topology import RemoteEngine, Topology
from pdserve.kv_connector.transport.base import Transport, XferState, block_descs
from pdserve.utils import cdiv

logger = logging.getLogger(__name__)


@dataclass
class _Registration:
    agent: str
    msg: PushRegistration
    num_written: int = 0
    handles: list[int] = field(default_factory=list)
    failure: str | None = None  # set: no more writes; Pushed(ok=False) once none is in flight


@dataclass
class _Prompt:
    request_id: str  # this instance's
    meta: PushReqMeta


class PushSender:
    """Prefill side, one worker rank: registrations by transfer id, and the writes they ask."""

    def __init__(
        self,
        transport: Transport,
        kv_cache: torch.Tensor,
        leases: LeaseHolder,
        lease_duration: float,
        count: Callable[[str, float], None],
    ) -> None:
        self.transport = transport
        self.count = count  # the worker's counters
        self.block_len = kv_cache[0].nbytes
        self.block_size = kv_cache.shape[3]
        self.is_cuda = kv_cache.is_cuda
        self.leases = leases
        self.lease_duration = lease_duration
        self._prompts: dict[str, _Prompt] = {}  # transfer id -> the request filling it
        self._ids: dict[str, str] = {}  # request id -> transfer id
        self._regs: dict[str, list[_Registration]] = {}
        self._arrived: dict[str, float] = {}  # transfer id -> its first registration
        self._gone: dict[str, tuple[float, str]] = {}  # transfer id -> (when, why) it ended
        self._last_alive = 0.0

    # ---- from the scheduler ------------------------------------------------------------------

    def update(self, reqs: dict[str, PushReqMeta], aborts: list[str]) -> None:
        for req_id, meta in reqs.items():
            self._prompts[meta.transfer_id] = _Prompt(req_id, meta)
            self._ids[req_id] = meta.transfer_id
        for transfer_id in aborts:
            prompt = self._prompts.pop(transfer_id, None)
            if prompt is not None:
                self._ids.pop(prompt.request_id, None)
            self._end(transfer_id, "the request was aborted on the prefill instance")

    def forget(self, req_ids: set[str]) -> None:
        """Leases that ended (served, or expired): a later registration is answered at once."""
        for req_id in req_ids:
            transfer_id = self._ids.pop(req_id, None)
            if transfer_id is not None:
                self._prompts.pop(transfer_id, None)
                self._end(transfer_id, "the prefill instance no longer holds the request's KV")

    def _end(self, transfer_id: str, why: str) -> None:
        self._gone[transfer_id] = (time.monotonic(), why)
        for reg in self._regs.get(transfer_id, ()):
            reg.failure = reg.failure or why

    # ---- from peers --------------------------------------------------------------------------

    def heartbeat(self, notif: Notif) -> Notif:
        """A decode side's heartbeat names transfer ids; the leases know request ids."""
        ids = [self._prompts[t].request_id for t in notif.request_ids if t in self._prompts]
        return Notif("heartbeat", ids)

    def register(self, sender: str, msg: PushRegistration) -> None:
        regs = self._regs.setdefault(msg.transfer_id, [])
        self._arrived.setdefault(msg.transfer_id, time.monotonic())
        known = next(
            (r for r in regs if r.agent == sender and r.msg.request_id == msg.request_id), None
        )
        if msg.cancel:
            if known is not None:
                known.failure = known.failure or "the decode request was aborted"
            return
        try:
            agent = self.transport.add_remote_agent(msg.agent_metadata)
        except Exception as e:
            logger.warning("Push registration of request %s refused: %s", msg.request_id, e)
            return  # nobody to answer: its watchdog ends it
        if agent != sender:
            logger.warning("Push registration from %s names agent %s; dropped", sender, agent)
            return
        if known is not None:
            return  # a duplicate
        reg = _Registration(agent, msg)
        if msg.block_len != self.block_len and msg.block_ids:
            reg.failure = (
                f"the decode side lands blocks of {msg.block_len} bytes, this prefill rank's "
                f"are {self.block_len}"
            )
        gone = self._gone.get(msg.transfer_id)
        if gone is not None:
            reg.failure = reg.failure or gone[1]
        regs.append(reg)

    # ---- each step, after the forward pass ---------------------------------------------------

    def step(self) -> None:
        now = time.monotonic()
        synced = False
        alive: dict[str, list[str]] = {}
        for transfer_id, regs in list(self._regs.items()):
            prompt = self._prompts.get(transfer_id)
            if prompt is None and transfer_id not in self._gone:
                if now - self._arrived[transfer_id] > self.lease_duration:
                    self._end(transfer_id, "the prefill instance never got the request")
            for reg in regs:
                self._poll(reg)
                if reg.failure is None and prompt is not None:
                    ready = self._num_ready(reg, prompt.meta)
                    if ready > reg.num_written:
                        if self.is_cuda and not synced:
                            torch.cuda.current_stream().synchronize()  # the step's KV is written
                            synced = True
                        self._write(reg, prompt.meta, ready)
            for reg in [r for r in regs if not r.handles and self._settled(r, prompt)]:
                regs.remove(reg)
                ok = reg.failure is None
                send(self.transport, reg.agent, Pushed(reg.msg.request_id, ok, reg.failure or ""))
                self.count("pushes" if ok else "failed_pushes", 1.0)
                if prompt is not None:
                    done = Notif("done", [prompt.request_id], reg.msg.num_registrants)
                    self.leases.notify(done)
            for reg in regs:
                alive.setdefault(reg.agent, []).append(reg.msg.request_id)
                if reg.handles and prompt is not None:  # the blocks are being read: keep them
                    self.leases.notify(Notif("heartbeat", [prompt.request_id]))
            if not regs:
                del self._regs[transfer_id]
                self._arrived.pop(transfer_id, None)
        if alive and now - self._last_alive >= self.lease_duration / 6:
            self._last_alive = now
            for agent, request_ids in alive.items():
                send(self.transport, agent, PushAlive(request_ids))
        for transfer_id in [t for t, (when, _) in self._gone.items() if now - when > 60.0]:
            del self._gone[transfer_id]

    def _first_block(self, reg: _Registration, meta: PushReqMeta) -> int:
        """The prompt block the registration's first block takes: its blocks are the last."""
        return cdiv(meta.num_prompt_tokens, self.block_size) - len(reg.msg.block_ids)

    def _num_ready(self, reg: _Registration, meta: PushReqMeta) -> int:
        """Of the registration's blocks, how many (from its first) hold final KV."""
        if meta.num_final_tokens >= meta.num_prompt_tokens:
            final = cdiv(meta.num_prompt_tokens, self.block_size)
        else:
            final = meta.num_final_tokens // self.block_size
        return max(0, min(final, len(meta.block_ids)) - self._first_block(reg, meta))

    def _settled(self, reg: _Registration, prompt: _Prompt | None) -> bool:
        if reg.failure is not None:
            return True
        if prompt is None:
            return False
        meta = prompt.meta
        return meta.num_final_tokens >= meta.num_prompt_tokens and reg.num_written == len(
            reg.msg.block_ids
        )

    def _write(self, reg: _Registration, meta: PushReqMeta, ready: int) -> None:
        first = self._first_block(reg, meta)
        if first < 0:
            reg.failure = (
                f"the decode side registered {len(reg.msg.block_ids)} blocks for a prompt of "
                f"{meta.num_prompt_tokens} tokens"
            )
            return
        src = meta.block_ids[first + reg.num_written : first + ready]
        dst = reg.msg.block_ids[reg.num_written : ready]
        try:
            local, remote = block_descs(0, src, reg.msg.region, dst, self.block_len)
            reg.handles.append(self.transport.write(reg.agent, local, remote, b""))
        except Exception as e:  # bad descriptors, a vanished agent: this registration only
            logger.error("Push of request %s failed to start: %s", reg.msg.request_id, e)
            reg.failure = f"the KV write from the prefill instance failed to start: {e}"
            return
        reg.num_written = ready
        self.count("transfer_bytes", float(len(src) * self.block_len))

    def _poll(self, reg: _Registration) -> None:
        for handle in list(reg.handles):
            state = self.transport.check_state(handle)
            if state is XferState.PENDING:
                continue
            self.transport.release(handle)
            reg.handles.remove(handle)
            if state is XferState.ERROR:
                reg.failure = reg.failure or "the KV write failed in the transport"

    def has_work(self) -> bool:
        return bool(self._regs)


@dataclass
class _Awaited:
    meta: RecvReqMeta
    engine: RemoteEngine
    pending: set[str]  # prefill agents whose Pushed has not come
    deadline: float
    start: float
    num_bytes: int
    failure: str | None = None


class PushReceiver:
    """Decode side, one worker rank: registrations sent, and the pushes they wait for."""

    def __init__(
        self,
        transport: Transport,
        topology: Topology,
        lease_duration: float,
        count: Callable[[str, float], None],
    ) -> None:
        self.transport = transport
        self.count = count  # the worker's counters
        self.topology = topology
        self.lease_duration = lease_duration
        self._awaited: dict[str, _Awaited] = {}
        self.done: set[str] = set()
        self.failed: dict[str, tuple[list[int], str]] = {}  # request -> (its blocks, why)

    def register(self, req_id: str, meta: RecvReqMeta, engine: RemoteEngine, report: bool) -> None:
        """Ask every prefill rank the request reads from to push its blocks (none: tell them
        nothing is needed). `report`: the request waits for its blocks (not a decline)."""
        local = meta.local_block_ids
        num_registrants = self.topology.readers_per_remote_rank(engine.tp_size)
        landings = [
            self.topology.read_target(local, j, engine.tp_size, remote_meta.block_len)
            if local and self.topology.reads_from(j)
            else (0, [])
            for j, (_, remote_meta) in enumerate(engine.agents)
        ]
        # Taken after the landing places: a first heterogeneous-TP push registers its staging
        # area just now, and the writer must know that region.
        me = self.transport.get_agent_metadata()
        total = 0
        for (agent, remote_meta), (region, targets) in zip(engine.agents, landings):
            msg = PushRegistration(
                meta.remote_request_id,
                req_id,
                me,
                region,
                targets,
                remote_meta.block_len,
                num_registrants,
            )
            send(self.transport, agent, msg)
            total += len(targets) * remote_meta.block_len
        if not local:
            if report:
                self.done.add(req_id)
            return
        now = time.monotonic()
        self._awaited[req_id] = _Awaited(
            meta,
            engine,
            {agent for agent, _ in engine.agents},
            now + self.lease_duration,
            time.perf_counter(),
            total,
        )

    def cancel(self, req_ids: list[str]) -> None:
        """Aborted here: the prefill ranks stop writing; the blocks stay held until each said
        Pushed (or the watchdog fired)."""
        for req_id in req_ids:
            awaited = self._awaited.get(req_id)
            if awaited is None:
                continue
            awaited.failure = awaited.failure or "the request was aborted"
            for agent, remote_meta in awaited.engine.agents:
                if agent in awaited.pending:
                    msg = PushRegistration(
                        awaited.meta.remote_request_id,
                        req_id,
                        b"",
                        0,
                        [],
                        remote_meta.block_len,
                        1,
                        cancel=True,
                    )
                    send(self.transport, agent, msg)

    def pushed(self, sender: str, msg: Pushed) -> None:
        awaited = self._awaited.get(msg.request_id)
        if awaited is None or sender not in awaited.pending:
            logger.debug("Pushed for request %s from %s ignored", msg.request_id, sender)
            return
        awaited.pending.discard(sender)
        if not msg.ok:
            awaited.failure = awaited.failure or msg.reason or "the prefill side's push failed"
        if not awaited.pending:
            self._settle(msg.request_id, awaited)

    def alive(self, msg: PushAlive) -> None:
        deadline = time.monotonic() + self.lease_duration
        for req_id in msg.request_ids:
            awaited = self._awaited.get(req_id)
            if awaited is not None:
                awaited.deadline = max(awaited.deadline, deadline)

    def check_watchdogs(self) -> None:
        now = time.monotonic()
        for req_id, awaited in list(self._awaited.items()):
            if now < awaited.deadline:
                continue
            logger.error(
                "Push of request %s: no word from prefill engine %s for %.0f s.",
                req_id,
                awaited.meta.remote_engine_id,
                self.lease_duration,
            )
            self.cancel([req_id])
            self.count("push_watchdogs", 1.0)
            awaited.failure = (
                f"prefill engine {awaited.meta.remote_engine_id} sent no word of this request's "
                f"KV for {self.lease_duration:.0f} s"
            )
            self._settle(req_id, awaited)

    def _settle(self, req_id: str, awaited: _Awaited) -> None:
        del self._awaited[req_id]
        if awaited.failure is not None:
            self.failed[req_id] = (awaited.meta.local_block_ids, awaited.failure)
            return
        self.topology.finish(awaited.meta.local_block_ids, awaited.engine.tp_size)
        self.done.add(req_id)
        for name, value in (
            ("transfers", 1.0),
            ("transfer_seconds", time.perf_counter() - awaited.start),
            ("transfer_bytes", float(awaited.num_bytes)),
        ):
            self.count(name, value)

    def has_work(self) -> bool:
        return bool(self._awaited)
