"""vLLM features pdserve does not implement: each engine argument and CLI flag gets an error
naming the feature, before any model is read or runner chosen; left off, it is accepted."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from pdserve.config import EngineConfig
from pdserve.config import args as engine_args
from pdserve.config.unsupported import UNSUPPORTED_FEATURES, UnsupportedFeature
from pdserve.entrypoints import cli

FEATURES = list(UNSUPPORTED_FEATURES.values())
IDS = [f.arg for f in FEATURES]
# A value that turns each kind of argument on.
ON = {bool: True, int: 2, str: "fp8", dict: {"method": "eagle"}}


def error_pattern(f: UnsupportedFeature) -> str:
    return rf"^{f.arg}=.* " + re.escape(f"({f.flag}): pdserve does not implement {f.feature}.")


@pytest.mark.parametrize("feature", FEATURES, ids=IDS)
def test_engine_argument_names_the_feature(feature):
    with pytest.raises(ValueError, match=error_pattern(feature)):
        EngineConfig.from_engine_args(**{feature.arg: ON[feature.kind]})


def test_arguments_left_off_are_accepted(tiny_model):
    off = {f.arg: f.off[-1] for f in FEATURES}
    config = EngineConfig.from_engine_args(model=tiny_model("llama"), **off)
    assert config.model_config.runner_type == "generate"


def cli_args(feature: UnsupportedFeature, flag: str) -> list[str]:
    if feature.kind is bool:
        return [flag]
    value = ON[feature.kind]
    return [flag, json.dumps(value) if feature.kind is dict else str(value)]


@pytest.mark.parametrize("feature", FEATURES, ids=IDS)
def test_cli_flag_names_the_feature(capsys, feature):
    flags = [feature.flag] + ([feature.short_flag] if feature.short_flag else [])
    for flag in flags:
        assert cli.main(["generate", *cli_args(feature, flag)]) == 2
        err = capsys.readouterr().err
        assert f"({feature.flag}): pdserve does not implement {feature.feature}" in err


def test_cli_off_flags_reach_the_config_as_off():
    parser = argparse.ArgumentParser()
    engine_args.add_engine_args(parser)
    args = parser.parse_args(["--no-enable-lora", "--runner", "generate"])
    kwargs = engine_args.engine_kwargs(args)
    assert all(kwargs[f.arg] in f.off for f in FEATURES)


def test_a_vllm_flag_pdserve_lacks_is_named_not_unrecognized(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--cpu-offload-gb", "2", "--trust-remote-code"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--cpu-offload-gb, --trust-remote-code: vLLM flag(s) pdserve does not" in err
    assert "unrecognized" not in err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_the_vllm_flag_list_holds_the_flags_pdserve_takes():
    """Its flags with vLLM's names are vLLM's (the list is vLLM 0.32's `serve` flags)."""
    flags = cli._vllm_serve_flags()
    for flag in ("--kv-transfer-config", "--kv-events-config", "--max-model-len", "--block-size"):
        assert flag in flags
