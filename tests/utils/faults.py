"""Fault plans for the fault-injecting KV transport (pdserve/kv_connector/transport/fault.py).

A `FaultPlan` owns a folder: the plan file every transport of an instance started with
`plan.env` reads (again whenever it changes), the release files that end its held faults, and
the events log its transports append to each time a rule applies. Tests wait for events
instead of sleeping, and release holds when they have seen what they came for.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar


class _Server(Protocol):
    def wait_pool_full(self, timeout: float = ...) -> None: ...


class _Pair(Protocol):
    p: _Server
    d: _Server
    p_plan: FaultPlan
    d_plan: FaultPlan


PairT = TypeVar("PairT", bound=_Pair)


def without_faults(pair: PairT) -> Iterator[PairT]:
    """A fixture's body: the pair with no faults planned; after the test, no faults and both
    pools full."""
    pair.p_plan.set()
    pair.d_plan.set()
    yield pair
    pair.p_plan.set()
    pair.d_plan.set()
    pair.d.wait_pool_full()
    pair.p.wait_pool_full()


def rule(name: str, at: str, action: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "at": at, "action": action, **fields}


class FaultPlan:
    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.path = folder / "plan.json"
        self.events = folder / "events.log"
        self.set()

    @property
    def env(self) -> dict[str, str]:
        return {"PDSERVE_KV_FAULT_PLAN": str(self.path)}

    def set(self, *rules: dict[str, Any]) -> None:
        """Install these rules (none: no faults); their counts and events start afresh."""
        for old in self.folder.glob("*.release"):
            old.unlink()
        self.events.write_text("")
        tmp = self.folder / "plan.json.tmp"
        tmp.write_text(json.dumps({"rules": list(rules)}))
        os.replace(tmp, self.path)  # a new inode: the transports see the change at once

    def fired(self, name: str) -> int:
        """How many times rule `name` applied, over every transport of the plan."""
        lines = self.events.read_text().splitlines() if self.events.exists() else []
        return sum(1 for line in lines if line.split(" ", 1)[0] == name)

    def wait_fired(self, name: str, times: int = 1, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.fired(name) < times:
            assert time.monotonic() < deadline, (
                f"fault rule {name} applied {self.fired(name)} of {times} times in {timeout} s"
            )
            time.sleep(0.02)

    def release(self, name: str) -> None:
        """End the holds of rule `name` (a delay without `seconds`)."""
        (self.folder / f"{name}.release").touch()
