"""The one lookup-by-name idiom: lazy entries, choices listed in the error, the field named."""

from __future__ import annotations

import sys

import pytest

from pdserve.registry import Registry


def test_entry_is_imported_on_first_get_only() -> None:
    sys.modules.pop("json.tool", None)
    reg: Registry[object] = Registry("formatter", "cfg.formatter", {"tool": "json.tool:main"})
    assert "json.tool" not in sys.modules
    import json.tool

    assert reg.get("tool") is json.tool.main
    assert reg.supported_names() == ("tool",) and "tool" in reg and "other" not in reg


def test_unknown_name_names_the_field_and_every_choice() -> None:
    reg: Registry[object] = Registry(
        "formatter", "cfg.formatter", {"a": "json:dumps", "b": "json:loads"}
    )
    with pytest.raises(ValueError, match=r"cfg\.formatter must be one of 'a', 'b', got 'c'\."):
        reg.get("c")


def test_register_rejects_a_second_entry_and_a_bad_target() -> None:
    reg: Registry[object] = Registry("formatter", "cfg.formatter", {"a": "json:dumps"})
    with pytest.raises(ValueError, match="registered already"):
        reg.register("a", "json:loads")
    with pytest.raises(ValueError, match="not 'module:attribute'"):
        reg.register("b", "json.loads")


def test_missing_library_propagates_as_import_error() -> None:
    reg: Registry[object] = Registry("formatter", "cfg.formatter", {"x": "no_such_module_here:f"})
    with pytest.raises(ImportError):
        reg.get("x")


def test_executors_by_name() -> None:
    from pdserve.config.plugins import EXECUTORS
    from pdserve.executor.multiproc import MultiprocExecutor
    from pdserve.executor.uniproc import UniProcExecutor

    assert EXECUTORS.supported_names() == ("uni", "mp", "ray")
    assert EXECUTORS.get("uni") is UniProcExecutor and EXECUTORS.get("mp") is MultiprocExecutor
    with pytest.raises(
        ValueError, match=r"distributed_executor_backend must be one of 'uni', 'mp', 'ray'"
    ):
        EXECUTORS.check("mpi")


def test_transports_by_name() -> None:
    from pdserve.config.plugins import TRANSPORTS
    from pdserve.kv_connector.transport import BACKENDS

    assert BACKENDS == TRANSPORTS.supported_names() == ("nixl", "ucx")
    with pytest.raises(
        ValueError,
        match=r"kv_transfer_config\.kv_connector_extra_config\.transport must be one of 'nixl'",
    ):
        TRANSPORTS.check("tcp")


def test_models_and_activations_by_name() -> None:
    from torch import nn

    from pdserve.models.layers.activation import get_act_fn
    from pdserve.models.llama import LlamaForCausalLM
    from pdserve.models.registry import MODELS

    assert MODELS.get("MistralForCausalLM") is LlamaForCausalLM
    assert "Mamba2ForCausalLM" not in MODELS  # recognized but refused: models/registry.py says why
    assert isinstance(get_act_fn("gelu"), nn.GELU)
    with pytest.raises(ValueError, match=r"hidden_act must be one of 'relu', 'silu', 'gelu'"):
        get_act_fn("swish")
