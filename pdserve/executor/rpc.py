"""The executor <-> worker RPC messages, msgpack-encoded with types taken from Worker's methods.

Arguments and results are decoded with the annotations of the Worker method they belong to, so
a `SchedulerOutput` arrives as a `SchedulerOutput` without pickling anything. The step's two
messages travel in their wire forms (wire.py), converted here on both sides.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from functools import cache
from typing import Any

import msgspec

from pdserve.executor.wire import CODECS

_encoder = msgspec.msgpack.Encoder()


class RPCCall(msgspec.Struct, array_like=True):
    method: str
    args: msgspec.Raw  # the encoded tuple of arguments
    kwargs: msgspec.Raw
    output_rank: int | None  # None: every rank replies


class RPCReply(msgspec.Struct, array_like=True):
    ok: bool
    result: msgspec.Raw  # the encoded result, or the error message when not ok


# The same layouts with the values in place, so that a message is encoded in one pass.
class _OutgoingCall(msgspec.Struct, array_like=True):
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output_rank: int | None


class _OutgoingReply(msgspec.Struct, array_like=True):
    ok: bool
    result: Any


_call_decoder = msgspec.msgpack.Decoder(RPCCall)
_reply_decoder = msgspec.msgpack.Decoder(RPCReply)
_raw_list_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])


def _to_wire(value: Any, call_args: tuple[Any, ...]) -> Any:
    codec = CODECS.get(type(value))
    return value if codec is None else codec[1](value, call_args)


def encode_call(
    method: str, args: tuple[Any, ...], kwargs: dict[str, Any], output_rank: int | None
) -> bytes:
    return _encoder.encode(
        _OutgoingCall(
            method,
            tuple(_to_wire(v, ()) for v in args),
            {k: _to_wire(v, ()) for k, v in kwargs.items()},
            output_rank,
        )
    )


def decode_call(payload: bytes) -> RPCCall:
    return _call_decoder.decode(payload)


def encode_reply(ok: bool, result: Any, call_args: tuple[Any, ...]) -> bytes:
    """`call_args`: the arguments the result answers (a runner output is encoded against them)."""
    return _encoder.encode(_OutgoingReply(ok, _to_wire(result, call_args)))


def decode_reply(payload: bytes) -> RPCReply:
    return _reply_decoder.decode(payload)


class _TypedDecoder:
    """Decodes one value of `type_`, through its wire form where it has one."""

    def __init__(self, type_: Any) -> None:
        codec = CODECS.get(type_)
        self._type = type_ if codec is None else codec[0]
        self._decoder = msgspec.msgpack.Decoder(self._type)
        self._from_wire: Callable[[Any, tuple[Any, ...]], Any] | None = (
            None if codec is None else codec[2]
        )

    def decode(self, data: Any, call_args: tuple[Any, ...] = ()) -> Any:
        return self._finish(self._decoder.decode(data), call_args)

    def convert(self, value: Any) -> Any:
        """From the untyped decoding of the same bytes (keyword arguments are decoded so)."""
        return self._finish(msgspec.convert(value, self._type), ())

    def _finish(self, value: Any, call_args: tuple[Any, ...]) -> Any:
        return value if self._from_wire is None else self._from_wire(value, call_args)


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
def _param_decoders(cls: type, method: str) -> dict[str, _TypedDecoder]:
    params, _ = _method_types(cls, method)
    return {name: _TypedDecoder(type_) for name, type_ in params}


@cache
def _result_decoder(cls: type, method: str) -> _TypedDecoder:
    _, result_type = _method_types(cls, method)
    return _TypedDecoder(result_type)


def check_method(cls: type, method: str) -> None:
    """Raise ValueError unless `method` is a public method of `cls` (checked before sending)."""
    _method_types(cls, method)


def decode_args(cls: type, call: RPCCall) -> tuple[tuple[Any, ...], dict[str, Any]]:
    decoders = _param_decoders(cls, call.method)
    raw_args = _raw_list_decoder.decode(call.args)
    if len(raw_args) > len(decoders):
        raise ValueError(f"{call.method}() takes {len(decoders)} arguments, got {len(raw_args)}.")
    args = tuple(decoder.decode(raw) for decoder, raw in zip(decoders.values(), raw_args))
    kwargs = msgspec.msgpack.decode(call.kwargs)
    if kwargs:
        kwargs = {k: decoders[k].convert(v) if k in decoders else v for k, v in kwargs.items()}
    return args, kwargs


def decode_result(cls: type, method: str, reply: RPCReply, call_args: tuple[Any, ...]) -> Any:
    return _result_decoder(cls, method).decode(reply.result, call_args)


def decode_results(
    cls: type, method: str, replies: list[tuple[int, RPCReply]], call_args: tuple[Any, ...]
) -> list[Any]:
    """The results of (rank, reply) pairs; a RuntimeError naming the first rank that failed.
    `call_args`: the arguments the call was sent with."""
    for rank, reply in replies:
        if not reply.ok:
            raise RuntimeError(
                f"Worker rank {rank} failed in {method}: {msgspec.msgpack.decode(reply.result)}"
            )
    return [decode_result(cls, method, reply, call_args) for _, reply in replies]
