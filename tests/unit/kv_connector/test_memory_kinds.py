"""Transport regions carry their memory kind: host memory, or a CUDA device's. Each backend says
which kinds it reaches; NIXL describes each side of a READ as DRAM or VRAM with its device.
The CUDA registrations run where a GPU is; the CPU suite runs everything around them."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
import torch

from pdserve.kv_connector.transport import base
from pdserve.kv_connector.transport.base import (
    HOST,
    Desc,
    MemoryKind,
    Transport,
    XferState,
    make_transport,
    memory_kind,
)

BACKENDS = ["nixl", "ucx"]
DEVICE1 = MemoryKind("device", 1)
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_memory_kind_of_a_tensor() -> None:
    assert memory_kind(torch.zeros(4)) == HOST and str(HOST) == "host"
    assert str(DEVICE1) == "device (cuda:1)"
    with pytest.raises(ValueError, match="CPU or CUDA memory, got device meta"):
        memory_kind(torch.empty(4, device="meta"))


def test_nixl_describes_each_side_by_its_segment_and_device() -> None:
    nixl = pytest.importorskip("pdserve.kv_connector.transport.nixl")
    regions = [nixl.Region(1000, 64, HOST), nixl.Region(5000, 64, DEVICE1)]
    rows, segment = nixl.xfer_descs([Desc(1, 16, 8), Desc(1, 0, 8)], regions)
    assert segment == "VRAM" and rows.tolist() == [[5016, 8, 1], [5000, 8, 1]]
    rows, segment = nixl.xfer_descs([Desc(0, 8, 8)], regions)
    assert segment == "DRAM" and rows.tolist() == [[1008, 8, 0]]
    with pytest.raises(ValueError, match="one kind per side"):
        nixl.xfer_descs([Desc(0, 0, 8), Desc(1, 0, 8)], regions)


@pytest.mark.parametrize(
    "tls,reaches",
    [
        ("self,posix", False),
        ("self,posix,cuda_copy,cuda_ipc", True),
        ("cuda", True),
        ("all", True),
        ("^cuda_ipc,cuda_copy", False),
        ("^tcp", True),
    ],
)
def test_ucx_tls_that_reach_cuda_memory(tls: str, reaches: bool) -> None:
    ucx = pytest.importorskip("pdserve.kv_connector.transport.ucx")
    assert ucx.tls_reaches_device(tls) is reaches


@pytest.fixture(params=BACKENDS)
def transport(request: pytest.FixtureRequest) -> Iterator[Transport]:
    t = make_transport(request.param, f"kinds-{request.param}", timeout_s=3.0)
    yield t
    t.shutdown()


def test_host_region_is_registered_with_its_kind(transport: Transport) -> None:
    assert transport.register_region(torch.zeros(64, dtype=torch.uint8)) == 0
    assert transport.reaches(HOST) and transport._kinds == [HOST]
    if transport.name == "nixl":
        md = msgspec.msgpack.decode(transport.get_agent_metadata())
        assert md[2][0][2] == ["host", 0]  # the region's kind travels with its address


@NO_CUDA
def test_device_region_without_cuda_is_refused_with_the_reason(
    transport: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(base, "memory_kind", lambda tensor: MemoryKind("device", 0))
    with pytest.raises(ValueError, match=f"the {transport.name} transport cannot register "):
        transport.register_region(torch.zeros(64, dtype=torch.uint8))
    assert not transport._tensors


@NO_CUDA
def test_which_remote_kinds_a_reader_reaches(transport: Transport) -> None:
    assert transport.read_obstacle(HOST) is None
    if transport.name == "nixl":  # a one-sided READ touches the remote memory itself
        assert transport.read_obstacle(DEVICE1) == "torch sees no CUDA device"
    else:  # the owner sends from the memory it registered
        assert transport.read_obstacle(DEVICE1) is None


@NO_CUDA
def test_ucx_device_memory_adds_the_cuda_transports() -> None:
    plain = make_transport("ucx", "kinds-plain")
    cuda = make_transport("ucx", "kinds-cuda", device_memory=True)
    try:
        assert plain.no_device_reason == "its UCX TLS 'self,posix' has no CUDA transport"
        assert cuda.no_device_reason == "torch sees no CUDA device"  # its TLS would reach it
    finally:
        plain.shutdown()
        cuda.shutdown()


@CUDA
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_region_is_registered_and_read(backend: str) -> None:
    """Both registration paths take a CUDA tensor, and a READ moves VRAM to VRAM and to host."""
    owner = make_transport(backend, f"cuda-owner-{backend}", device_memory=True)
    reader = make_transport(backend, f"cuda-reader-{backend}", device_memory=True)
    try:
        src = torch.arange(4096, dtype=torch.int32, device="cuda").view(torch.uint8)
        owner.register_region(src)
        dst_device = torch.zeros_like(src)
        dst_host = torch.zeros(src.numel(), dtype=torch.uint8)
        assert reader.register_region(dst_device) == 0 and reader.register_region(dst_host) == 1
        assert reader._kinds == [MemoryKind("device", src.device.index or 0), HOST]
        torch.cuda.synchronize()
        peer = reader.add_remote_agent(owner.get_agent_metadata())
        owner.add_remote_agent(reader.get_agent_metadata())
        for region in (0, 1):
            handle = reader.read(
                peer, [Desc(region, 0, src.numel())], [Desc(0, 0, src.numel())], b"n"
            )
            deadline = time.monotonic() + 20
            while (state := reader.check_state(handle)) is XferState.PENDING:
                assert time.monotonic() < deadline
                time.sleep(0.001)
            assert state is XferState.DONE
            reader.release(handle)
        assert torch.equal(dst_device, src) and torch.equal(dst_host, src.cpu())
    finally:
        reader.shutdown()
        owner.shutdown()
