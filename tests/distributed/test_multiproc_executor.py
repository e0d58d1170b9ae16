"""MultiprocExecutor with real worker processes: the cases of vLLM's test_multiproc_executor.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pdserve.config import EngineConfig
from pdserve.executor.multiproc import MultiprocExecutor
from tests.utils.procs import pid_alive, wait_until_gone


def make_executor(path: str, tp: int) -> MultiprocExecutor:
    config = EngineConfig.from_engine_args(
        model=path,
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=64,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp",
    )
    return MultiprocExecutor(config)


# Module-scoped: its tests only call the workers and leave them healthy.
@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def executor(request, tiny_model):
    executor = make_executor(tiny_model("llama"), request.param)
    yield executor
    executor.shutdown()


def test_initialization(executor):
    tp = executor.config.parallel_config.tensor_parallel_size
    assert executor.world_size == tp
    assert len(executor.workers) == tp
    assert executor.output_rank == 0
    assert all(w.proc.is_alive() for w in executor.workers)


def test_collective_rpc(executor):
    tp = executor.world_size
    assert executor.collective_rpc("check_health") == [None] * tp
    executor.check_health()
    assert not executor.is_failed
    for rank in range(tp):
        assert executor.collective_rpc("determine_num_blocks", unique_reply_rank=rank) == 64
    futures = [executor.collective_rpc("determine_num_blocks", non_block=True) for _ in range(5)]
    assert [f.result(30) for f in futures] == [[64] * tp] * 5


def test_calls_from_several_threads_get_their_own_replies(executor):
    """Blocking calls read their replies themselves while nothing else is unresolved, and
    queue behind the response thread otherwise: either way each gets its own answer."""
    tp = executor.world_size
    results: dict[str, list] = {"blocks": [], "health": [], "futures": []}

    def blocks() -> None:
        for _ in range(20):
            results["blocks"].append(executor.collective_rpc("determine_num_blocks"))

    def health() -> None:
        for _ in range(20):
            results["health"].append(executor.collective_rpc("check_health"))
            future = executor.collective_rpc("determine_num_blocks", non_block=True)
            results["futures"].append(future)

    threads = [threading.Thread(target=blocks), threading.Thread(target=health)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results["blocks"] == [[64] * tp] * 20
    assert results["health"] == [[None] * tp] * 20
    assert [f.result(30) for f in results["futures"]] == [[64] * tp] * 20
    assert executor.collective_rpc("determine_num_blocks", unique_reply_rank=0) == 64


def test_rpc_errors_fail_the_call_not_the_worker(executor):
    with pytest.raises(ValueError, match="no RPC method"):
        executor.collective_rpc("no_such_method")
    with pytest.raises(RuntimeError, match="initialize_kv_cache"):
        executor.collective_rpc("initialize_kv_cache", args=(-1,))
    executor.check_health()


def test_worker_monitor_notices_sigkill(tiny_model):
    executor = make_executor(tiny_model("llama"), 2)
    pids = [w.proc.pid for w in executor.workers]
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while not executor.is_failed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert executor.is_failed
    with pytest.raises(RuntimeError, match="Executor failed"):
        executor.check_health()
    assert wait_until_gone(pids, 10) == [], "a worker outlived the failed executor"
    executor.shutdown()


def test_shutdown_is_idempotent(tiny_model):
    executor = make_executor(tiny_model("llama"), 2)
    procs = [w.proc for w in executor.workers]
    for _ in range(3):
        executor.shutdown()
    assert not any(p.is_alive() for p in procs)
    assert executor.rpc_broadcast_mq is None
    with pytest.raises(RuntimeError, match="Executor failed"):
        executor.check_health()


def test_startup_failure_names_the_rank(tiny_model, tmp_path):
    import shutil

    path = shutil.copytree(tiny_model("llama"), tmp_path / "model")
    config = EngineConfig.from_engine_args(
        model=str(path),
        dtype="float32",
        max_model_len=128,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    (path / "model.safetensors").unlink()  # the workers load weights after the parent's checks
    with pytest.raises(
        RuntimeError, match=r"Worker rank 0 failed to start: ValueError.*safetensors"
    ):
        MultiprocExecutor(config)


PARENT_SCRIPT = """
import sys, time
from pdserve.config import EngineConfig
from pdserve.executor.multiproc import MultiprocExecutor
config = EngineConfig.from_engine_args(model=sys.argv[1], dtype="float32", max_model_len=128,
    num_gpu_blocks_override=64, tensor_parallel_size=2, distributed_executor_backend="mp")
executor = MultiprocExecutor(config)
print(" ".join(str(w.proc.pid) for w in executor.workers), flush=True)
time.sleep(600)
"""


def test_parent_sigkill_leaves_no_worker(tiny_model):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT_SCRIPT, tiny_model("llama")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        parent.kill()
        parent.wait(10)
        assert wait_until_gone(pids, 10) == [], "a worker outlived its killed parent"
    finally:
        parent.kill()
