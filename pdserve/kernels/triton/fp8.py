"""Conversion of float32 to the fp8 KV cache's codes in integer arithmetic, so that every target
stores the bytes of the torch reference (kernels/kv_cache.py's quantize_kv) and of csrc/fp8.h.

Triton's own float32 -> fp8 cast does not: below sm_90 it goes through float16 rounded toward
zero (a second rounding; on sm_80 the step to e5m2 then rounds ties away from zero), and its
interpreter rounds ties away from zero and drops the carry of a rounded-up mantissa into the
exponent (1.0625 -> 1.125, 124.3 -> 64 in e4m3).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_fp8(x, limit: tl.constexpr, dtype: tl.constexpr):
    """x (float32) as codes of `dtype` (tl.float8e4nv or tl.float8e5): saturated at +-limit,
    rounded to nearest, ties to even."""
    MANTISSA: tl.constexpr = dtype.fp_mantissa_width
    BIAS: tl.constexpr = dtype.exponent_bias
    bits = tl.clamp(x, -limit, limit).to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    exponent = ((bits >> 23) & 0xFF) - 127
    significand = (bits & 0x7FFFFF) | 0x800000
    # Below the format's smallest normal exponent the step stays that of its subnormals. From a
    # shift of 30 on every significand (< 2^24) rounds to 0, float32 subnormals' included: the
    # cap keeps the shifts defined.
    shift = tl.minimum(23 - MANTISSA + tl.maximum(1 - BIAS - exponent, 0), 30)
    code = significand >> shift
    rest = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    code += ((rest > half) | ((rest == half) & ((code & 1) == 1))).to(tl.int32)
    # Added, not or-ed: a rounded-up mantissa carries into the exponent.
    code += tl.maximum(exponent + BIAS - 1, 0) << MANTISSA
    return (code | sign).to(tl.uint8).to(dtype, bitcast=True)
