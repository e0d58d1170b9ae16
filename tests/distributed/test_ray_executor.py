"""RayExecutor on a one-node Ray: the cases of vLLM's test_ray_v2_executor.py that apply here."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from typing import TYPE_CHECKING, Any

import pytest

from pdserve.config import EngineConfig

if TYPE_CHECKING:
    from pdserve.executor.ray_executor import RayExecutor

needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="ray is not installed (pip install 'pdserve[ray]')",
)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session: starting one costs seconds and ~900 MB."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")  # else Ray writes an auth token file
        import ray

        # Logical CPUs: one per worker actor, so that 4 ranks fit on a 2-core machine.
        ray.init(num_cpus=4, include_dashboard=False)
        yield ray
        ray.shutdown()


def make_config(path: str, tp: int, pp: int = 1) -> EngineConfig:
    return EngineConfig.from_engine_args(
        model=path,
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=64,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="ray",
    )


def make_executor(path: str, tp: int, pp: int = 1, **kwargs: Any) -> RayExecutor:
    from pdserve.executor.ray_executor import RayExecutor

    return RayExecutor(make_config(path, tp, pp), **kwargs)


@pytest.fixture(scope="class", params=[(1, 1), (2, 1), (2, 2)], ids=["tp1", "tp2", "tp2pp2"])
def executor(request, ray_session, tiny_model):
    tp, pp = request.param
    executor = make_executor(tiny_model("llama"), tp, pp)
    yield executor
    executor.shutdown()  # before other tests: Ray has 4 CPUs, one per rank


@pytest.mark.slow
@needs_ray
class TestExecutor:
    def test_executor(self, executor, ray_session):
        par, sched = executor.config.parallel_config, executor.config.scheduler_config
        tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
        world = tp * pp
        assert executor.world_size == world
        assert len(executor.workers) == world
        assert executor.output_rank == (pp - 1) * tp
        assert executor.config.use_v2_model_runner  # the rule below is V2's
        assert executor.max_concurrent_batches == pp + int(bool(sched.async_scheduling))
        executor.check_health()
        assert not executor.is_failed
        assert [w.rank for w in executor.workers] == list(range(world))
        driver_node = ray_session.get_runtime_context().get_node_id()
        assert all(w.node_id == driver_node for w in executor.workers)
        # Each future gets its own call's answer, whichever is waited on first.
        blocks = executor.collective_rpc("determine_num_blocks", non_block=True)
        bad = executor.collective_rpc("initialize_kv_cache", args=(-1,), non_block=True)
        health = executor.collective_rpc("check_health", non_block=True)
        assert health.result(30) == [None] * world
        assert isinstance(bad.exception(0), RuntimeError)
        assert blocks.result(0) == [64] * world
        for rank in range(world):
            assert executor.collective_rpc("determine_num_blocks", unique_reply_rank=rank) == 64
        with pytest.raises(RuntimeError, match="Worker rank 0 failed in initialize_kv_cache"):
            executor.collective_rpc("initialize_kv_cache", args=(-1,))
        executor.check_health()  # a failed call fails the call, not the worker


@pytest.mark.slow
@needs_ray
def test_worker_death_fails_the_executor(ray_session, tiny_model):
    executor = make_executor(tiny_model("llama"), 2)
    try:
        ray_session.kill(executor.workers[1].actor)
        deadline = time.monotonic() + 30
        while not executor.is_failed and time.monotonic() < deadline:
            time.sleep(0.1)
        assert executor.is_failed and executor.shutting_down
        with pytest.raises(RuntimeError, match="Executor failed"):
            executor.check_health()
        with pytest.raises(ray_session.exceptions.RayActorError):
            ray_session.get(executor.workers[0].actor.node_info.remote(), timeout=30)
    finally:
        executor.shutdown()


@pytest.mark.slow
@needs_ray
def test_shutdown_kills_actors_and_removes_its_placement_group(ray_session, tiny_model):
    executor = make_executor(tiny_model("llama"), 1)
    pg, worker = executor.placement_group, executor.workers[0]
    assert ray_session.wait([worker.death_ref], timeout=0.1)[0] == []  # pending while alive
    for _ in range(3):
        executor.shutdown()
    with pytest.raises(ray_session.exceptions.RayActorError):
        ray_session.get(worker.actor.node_info.remote(), timeout=30)
    assert ray_session.util.placement_group_table(pg)["state"] == "REMOVED"
    assert ray_session.is_initialized()  # Ray belongs to whoever started it
    with pytest.raises(RuntimeError, match="Executor failed"):
        executor.check_health()


@pytest.mark.slow
@needs_ray
def test_user_placement_group_is_used_and_kept(ray_session, tiny_model):
    pg = ray_session.util.placement_group([{"CPU": 1.0}] * 2, strategy="PACK")
    ray_session.get(pg.ready(), timeout=60)
    try:
        executor = make_executor(tiny_model("llama"), 2, placement_group=pg)
        try:
            assert executor.placement_group is pg
            assert executor.collective_rpc("check_health") == [None, None]
        finally:
            executor.shutdown()
        assert ray_session.util.placement_group_table(pg)["state"] == "CREATED"
        with pytest.raises(ValueError, match="placement_group has 2 bundles"):
            make_executor(tiny_model("llama"), 2, 2, placement_group=pg)  # world 4
    finally:
        ray_session.util.remove_placement_group(pg)


@pytest.mark.slow
@needs_ray
def test_startup_failure_names_the_rank(ray_session, tiny_model, tmp_path):
    path = shutil.copytree(tiny_model("llama"), tmp_path / "model")
    config = make_config(str(path), 1)
    (path / "model.safetensors").unlink()  # the workers load weights after the driver's checks
    from pdserve.executor.ray_executor import RayExecutor

    before = set(ray_session.util.placement_group_table())
    with pytest.raises(
        RuntimeError, match=r"Worker rank 0 failed to start: ValueError.*safetensors"
    ):
        RayExecutor(config)
    created = [
        pg for pg_id, pg in ray_session.util.placement_group_table().items() if pg_id not in before
    ]
    assert [pg["state"] for pg in created] == ["REMOVED"]


def test_missing_ray_is_a_clear_error(monkeypatch, tiny_model):
    """Runs without Ray too (and without starting one): pdserve imports, the backend explains."""
    from pdserve.executor.base import Executor

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    monkeypatch.delitem(sys.modules, "pdserve.executor.ray_executor", raising=False)
    config = EngineConfig.from_engine_args(
        model=tiny_model("llama"), distributed_executor_backend="ray"
    )
    with pytest.raises(ValueError, match=r"pip install 'pdserve\[ray\]'"):
        Executor.get_class(config)
