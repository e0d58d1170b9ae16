// The fp8 KV cache formats (--kv-cache-dtype): e4m3 (OCP's "fn": no infinities, 448 its largest
// value) and e5m2 (float16's top byte). Stores round to nearest even and saturate, as torch's
// conversion after kernels/kv_cache.py's clamp does, so every path writes the same bytes.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace pdserve {

// v >> s rounded to nearest, ties to even.
inline uint32_t shift_rne(uint32_t v, int s) {
  if (s > 31) return 0;
  const uint32_t q = v >> s, rem = v & ((1u << s) - 1), half = 1u << (s - 1);
  return q + uint32_t(rem > half || (rem == half && (q & 1)));
}

// M mantissa bits, exponent bias B, MAX the largest finite code. Integer arithmetic only: the
// kernels build with fast math, which may fold a float rounding trick away.
template <int M, int B, uint32_t MAX>
struct FP8 {
  using T = uint8_t;

  static uint8_t from_float(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint8_t sign = uint8_t((u >> 24) & 0x80);
    u &= 0x7fffffffu;
    const int exp = int(u >> 23) - 127;
    uint32_t q;
    if (exp >= 1 - B)  // a normal number of the format, or past its largest: saturated below
      q = shift_rne(u, 23 - M) - (uint32_t(127 - B) << M);
    else if ((u >> 23) == 0)  // a float32 subnormal: far below the format's smallest step
      q = 0;
    else  // the format's subnormals, steps of 2^(1 - B - M)
      q = shift_rne((u & 0x7fffffu) | 0x800000u, 24 - exp - B - M);
    return uint8_t(sign | std::min(q, MAX));
  }

  // The code's bits as a float16's: its value / kFactor (float16's exponent bias is 15, so
  // e4m3's lands 2^8 lower, and e5m2 is float16's top byte). Subnormals land on float16's
  // subnormals exactly, which the hardware's float16 conversion widens exactly.
  static constexpr float kFactor = float(1u << (15 - B));

#ifdef __AVX512F__
  static __m256i half_bits16(const uint8_t* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if constexpr (M == 2) return _mm256_slli_epi16(b, 8);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    return _mm256_or_si256(sign, _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)),
                                                   10 - M));
  }
  // 16 codes as floats, each its value / kFactor.
  static __m512 load16(const uint8_t* p) { return _mm512_cvtph_ps(half_bits16(p)); }
#endif
};

using E4M3 = FP8<3, 7, 0x7e>;
using E5M2 = FP8<2, 15, 0x7b>;

}  // namespace pdserve
