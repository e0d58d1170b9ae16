"""kv_buffer_device (vLLM's key) and the host-staging knobs: what each combination means, and a
ValueError naming the field for each bad one."""

from __future__ import annotations

import pytest
import torch

from pdserve.config.kv_transfer import KVTransferConfig


def _config(kv_buffer_device: str | None = None, **extra: object) -> KVTransferConfig:
    return KVTransferConfig(kv_buffer_device=kv_buffer_device, kv_connector_extra_config=extra)


@pytest.mark.parametrize(
    "kv_buffer_device,extra,match",
    [
        ("tpu", {}, "kv_transfer_config.kv_buffer_device must be one of 'cuda', 'cpu'"),
        ("cpu", {"host_staging": "yes"}, "host_staging must be a bool"),
        ("cpu", {"host_buffer_blocks": 0}, "host_buffer_blocks must be a positive integer"),
        ("cpu", {"host_buffer_blocks": True}, "host_buffer_blocks must be a positive integer"),
        (None, {"host_buffer_size": 4}, "unknown keys \\['host_buffer_size'\\]"),
    ],
)
def test_bad_values_name_the_field(
    kv_buffer_device: str | None, extra: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        _config(kv_buffer_device, **extra)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_buffer_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="kv_buffer_device is 'cuda' but torch sees no CUDA"):
        _config("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_staging_contradicts_a_cuda_buffer() -> None:
    with pytest.raises(ValueError, match="host_staging stages through host memory"):
        _config("cuda", host_staging=True)


@pytest.mark.parametrize(
    "kv_buffer_device,extra,device,staged",
    [
        (None, {}, "cpu", False),  # the CPU default: the cache itself is host memory
        (None, {}, "cuda", False),  # the GPU default: the cache is registered as VRAM
        ("cpu", {}, "cuda", True),  # vLLM's host buffer
        ("cpu", {}, "cpu", False),
        ("cpu", {"host_staging": True}, "cpu", True),  # the CPU suite's way through staging
        (None, {"host_staging": True}, "cpu", True),
        ("cpu", {"host_staging": True}, "cuda", True),
    ],
)
def test_when_the_transport_moves_host_copies(
    kv_buffer_device: str | None, extra: dict[str, object], device: str, staged: bool
) -> None:
    assert _config(kv_buffer_device, **extra).uses_host_staging(device) is staged


def test_a_cuda_cache_behind_a_cpu_buffer_cannot_skip_staging() -> None:
    with pytest.raises(ValueError, match="host_staging is false"):
        _config("cpu", host_staging=False).uses_host_staging("cuda")


def test_vllm_style_config_dict_is_accepted() -> None:
    config = KVTransferConfig.from_any(
        {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}
    )
    assert config.buffer_device("cuda") == "cpu" and config.host_buffer_blocks is None
