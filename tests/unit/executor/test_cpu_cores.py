"""Cores lent between the instances of one host (executor/cpu_cores.py): the board, the engine
that marks it, and the worker that takes its threads from it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams, envs
from pdserve.core_board import CoreBoard, create_board
from pdserve.executor import cpu_cores
from pdserve.executor.cpu_cores import FixedThreads, cpu_threads
from pdserve.scheduler.output import CachedRequestData, SchedulerOutput


def step(tokens: dict[str, int]) -> SchedulerOutput:
    """A step that computes these tokens of these requests (only what the threads look at)."""
    cached = CachedRequestData.make_empty()
    return SchedulerOutput([], cached, tokens, sum(tokens.values()), set())


PREFILL = step({"a": 2000, "b": 1})  # a prefill chunk beside a decode
SMALL_PREFILL = step({"a": 100})
DECODE = step({"a": 1, "b": 1})


def decoder(width: int) -> torch.nn.Module:
    """The weights of a model with one decoder layer, width x width (never allocated)."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList(
        [torch.nn.Linear(width, width, bias=False, device="meta")]
    )
    return model


# 2 x 2048^2 FLOPs per token: PREFILL's 1999 prompt tokens are worth a second thread
# (_MIN_BORROWED_FLOPS, 1190 tokens), SMALL_PREFILL's 99 are not.
MODEL = decoder(2048)


@pytest.fixture(autouse=True)
def torch_threads() -> Iterator[None]:
    """The workers below set this process's torch threads: put them back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def board(tmp_path: Path) -> Path:
    path = tmp_path / "board"
    create_board(path, 3)
    return path


def test_marks_are_seen_by_the_other_instances(board: Path) -> None:
    prefill, decode = CoreBoard(board, 0, 1), CoreBoard(board, 1, 2)  # decode: TP=2
    assert prefill.idle_elsewhere() == 2 and decode.idle_elsewhere() == 1
    decode.mark(True)
    assert board.read_bytes() == b"\x00\x01\x01"
    assert prefill.idle_elsewhere() == 0 and decode.idle_elsewhere() == 1
    prefill.mark(True)
    assert decode.idle_elsewhere() == 0
    decode.mark(False)
    assert prefill.idle_elsewhere() == 2


def test_a_slot_off_the_board_names_the_variable(board: Path) -> None:
    with pytest.raises(ValueError, match="PDSERVE_CORE_BOARD: workers 2..3 are not on the board"):
        CoreBoard(board, 2, 2)


@pytest.mark.parametrize("value", ["no-slot", "/dev/shm/b:", "/dev/shm/b:x", ":1"])
def test_a_malformed_board_variable_is_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CORE_BOARD", value)
    with pytest.raises(ValueError, match="PDSERVE_CORE_BOARD must be 'PATH:SLOT'"):
        envs.core_board()


def test_without_a_board_the_threads_are_fixed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_CORE_BOARD", raising=False)
    monkeypatch.setenv("PDSERVE_CPU_THREADS", "1")
    threads = cpu_threads(world_size=1)
    assert type(threads) is FixedThreads and torch.get_num_threads() == 1
    threads.before_step(PREFILL)
    assert torch.get_num_threads() == 1


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="lending needs two cores")
def test_a_worker_borrows_the_share_of_an_idle_instance_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "board"
    create_board(path, 2)
    monkeypatch.setenv("PDSERVE_CPU_THREADS", "1")
    monkeypatch.setenv("PDSERVE_CORE_BOARD", f"{path}:1")
    threads, other = cpu_threads(world_size=1), CoreBoard(path, 0, 1)
    threads.model_loaded(MODEL)
    threads.before_step(PREFILL)
    assert torch.get_num_threads() == 2
    threads.before_step(DECODE)
    assert torch.get_num_threads() == 1, "a decode step runs on its share"
    threads.before_step(SMALL_PREFILL)
    assert torch.get_num_threads() == 1, "too little work to wake a second thread for"
    other.mark(True)
    threads.before_step(PREFILL)
    assert torch.get_num_threads() == 1
    other.mark(False)
    threads.before_step(PREFILL)
    assert torch.get_num_threads() == 2


def test_the_workers_of_an_instance_split_what_they_borrow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six workers of 1 thread on 8 cores: a TP=2 instance (slots 2, 3) beside four others,
    three of them idle. Each of its workers takes 1 + 3 // 2 threads, never more than the host's
    cores."""
    path = tmp_path / "board"
    path.write_bytes(b"\x01\x00\x00\x00\x00\x00")
    monkeypatch.setenv("PDSERVE_CPU_THREADS", "1")
    monkeypatch.setenv("PDSERVE_CORE_BOARD", f"{path}:2")
    threads = cpu_threads(world_size=2)
    threads.model_loaded(MODEL)
    threads.cores = 8
    threads.before_step(PREFILL)
    assert torch.get_num_threads() == 2
    threads.cores = 1
    threads.before_step(PREFILL)
    assert torch.get_num_threads() == 1


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="lending needs two cores")
def test_the_engine_marks_its_instance_and_its_worker_borrows(
    board: Path, tiny_model: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one process (the uniproc executor): the engine's marks, the worker's threads. The
    tiny model's prefills are worth a second thread only with no floor."""
    monkeypatch.setattr(cpu_cores, "_MIN_BORROWED_FLOPS", 0)
    monkeypatch.setenv("PDSERVE_CPU_THREADS", "1")
    monkeypatch.setenv("PDSERVE_CORE_BOARD", f"{board}:0")
    other = CoreBoard(board, 1, 2)  # another instance on this host, TP=2
    with LLM(model=tiny_model("llama"), dtype="float32", max_model_len=128) as llm:
        params = SamplingParams(max_tokens=4, temperature=0)
        prompt = {"prompt_token_ids": list(range(3, 40))}
        llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
        assert torch.get_num_threads() == 2, "1 + the 2 idle workers' shares, at most 2 cores"
        llm.generate("Hello", params, use_tqdm=False)
        assert torch.get_num_threads() == 1, "its last step decoded: its share"
        assert board.read_bytes()[0] == 0, "no request left: idle"

        llm._add_request("Hello", params)
        llm.engine_core.step()
        assert board.read_bytes()[0] == 1, "busy while it has a request"
        while llm.engine_core.has_unfinished_requests():
            llm.engine_core.step()
        assert board.read_bytes()[0] == 0

        other.mark(True)
        another = {"prompt_token_ids": list(range(50, 90))}  # no prefix hit: a prefill step
        llm.generate(another, SamplingParams(max_tokens=1), use_tqdm=False)
        assert torch.get_num_threads() == 1, "the other instance is busy: its own share"
