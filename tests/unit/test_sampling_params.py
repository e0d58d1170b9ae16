"""SamplingParams: validation names the field, normalisation, msgspec roundtrip."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, r"\bn\b"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_k": 1},
        {"min_p": 1.0},
        {"max_tokens": None, "min_tokens": 100},
        {"min_tokens": 4, "max_tokens": 4},
        {"logprobs": 0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 2.0},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(
            n=3,
            temperature=0.7,
            top_p=0.9,
            top_k=-1,
            min_p=0.05,
            seed=1234,
            max_tokens=None,
            min_tokens=2,
            stop="###",
            stop_token_ids=[2, 7],
            ignore_eos=True,
            include_stop_str_in_output=True,
            logprobs=5,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            skip_special_tokens=False,
        ),
    ],
)
def test_msgpack_roundtrip_preserves_params(params):
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params
    assert msgspec.structs.asdict(decoded) == msgspec.structs.asdict(params)


def test_decoding_validates():
    data = msgspec.msgpack.encode({"top_p": 0.0})
    with pytest.raises(ValueError, match="top_p"):
        msgspec.msgpack.decode(data, type=SamplingParams)
    data = msgspec.msgpack.encode({"top_k": -1})
    assert msgspec.msgpack.decode(data, type=SamplingParams).top_k == 0
