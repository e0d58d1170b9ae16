"""The executor <-> worker RPC messages, msgpack-encoded with types taken from Worker's methods.

Arguments and results are decoded with the annotations of the Worker method they belong to, so
a `SchedulerOutput` arrives as a `SchedulerOutput` without pickling anything.
"""

from __future__ import annotations

import inspect
import typing
from functools import cache
from typing import Any

import msgspec

_encoder = msgspec.msgpack.Encoder()


class RPCCall(msgspec.Struct, array_like=True):
    method: str
    args: msgspec.Raw
    kwargs: msgspec.Raw
    output_rank: int | None  # None: every rank replies


class RPCReply(msgspec.Struct, array_like=True):
    ok: bool
    result: msgspec.Raw  # the encoded result, or the error message when not ok


_call_decoder = msgspec.msgpack.Decoder(RPCCall)
_reply_decoder = msgspec.msgpack.Decoder(RPCReply)


def encode_call(
    method: str, args: tuple[Any, ...], kwargs: dict[str, Any], output_rank: int | None
) -> bytes:
    return _encoder.encode(
        RPCCall(
            method,
            msgspec.Raw(_encoder.encode(args)),
            msgspec.Raw(_encoder.encode(kwargs)),
            output_rank,
        )
    )


def decode_call(payload: bytes) -> RPCCall:
    return _call_decoder.decode(payload)


def encode_reply(ok: bool, result: Any) -> bytes:
    return _encoder.encode(RPCReply(ok, msgspec.Raw(_encoder.encode(result))))


def decode_reply(payload: bytes) -> RPCReply:
    return _reply_decoder.decode(payload)


@cache
def _method_types(cls: type, method: str) -> tuple[list[tuple[str, Any]], Any]:
    fn = getattr(cls, method, None)
    if fn is None or method.startswith("_") or not callable(fn):
        raise ValueError(f"Worker has no RPC method {method!r}.")
    hints = typing.get_type_hints(fn)
    params = [
        (name, hints.get(name, Any))
        for name in list(inspect.signature(fn).parameters)[1:]  # skip self
    ]
    return params, hints.get("return", Any)


@cache
def _args_decoder(cls: type, method: str, num_args: int) -> msgspec.msgpack.Decoder:
    params, _ = _method_types(cls, method)
    if num_args > len(params):
        raise ValueError(f"{method}() takes {len(params)} arguments, got {num_args}.")
    return msgspec.msgpack.Decoder(
        tuple[tuple(t for _, t in params[:num_args])] if num_args else tuple
    )


@cache
def _result_decoder(cls: type, method: str) -> msgspec.msgpack.Decoder:
    _, result_type = _method_types(cls, method)
    return msgspec.msgpack.Decoder(result_type)


def check_method(cls: type, method: str) -> None:
    """Raise ValueError unless `method` is a public method of `cls` (checked before sending)."""
    _method_types(cls, method)


def decode_args(cls: type, call: RPCCall) -> tuple[tuple[Any, ...], dict[str, Any]]:
    raw_args = bytes(call.args)
    num_args = len(msgspec.msgpack.decode(raw_args, type=list[msgspec.Raw]))
    args = _args_decoder(cls, call.method, num_args).decode(raw_args)
    kwargs = msgspec.msgpack.decode(bytes(call.kwargs))
    if kwargs:
        params = dict(_method_types(cls, call.method)[0])
        kwargs = {k: msgspec.convert(v, params.get(k, Any)) for k, v in kwargs.items()}
    return tuple(args), kwargs


def decode_result(cls: type, method: str, reply: RPCReply) -> Any:
    return _result_decoder(cls, method).decode(bytes(reply.result))


def decode_results(cls: type, method: str, replies: list[tuple[int, RPCReply]]) -> list[Any]:
    """The results of (rank, reply) pairs; a RuntimeError naming the first rank that failed."""
    for rank, reply in replies:
        if not reply.ok:
            raise RuntimeError(
                f"Worker rank {rank} failed in {method}: {msgspec.msgpack.decode(bytes(reply.result))}"
            )
    return [decode_result(cls, method, reply) for _, reply in replies]
