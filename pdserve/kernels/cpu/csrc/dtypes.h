// The activation dtypes of the CPU kernels: load to float, store back rounded as torch rounds.
#pragma once
#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace pdserve {

struct F32 {
  using T = float;
  static float load(T x) { return x; }
  static T store(float f) { return f; }
#ifdef __AVX512F__
  static __m512 load16(const T* p) { return _mm512_loadu_ps(p); }
#endif
};

struct BF16 {
  using T = uint16_t;
  static float load(T x) {
    uint32_t bits = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  static T store(float f) {  // round to nearest even, as torch rounds
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    // NaN tested on the bits (fast math assumes there is none), without a branch, so that
    // loops of stores vectorize.
    const uint32_t rounded = bits + 0x7fff + ((bits >> 16) & 1);
    return T(((bits & 0x7fffffff) > 0x7f800000 ? 0x7fc00000u : rounded) >> 16);
  }
#ifdef __AVX512F__
  static __m512 widen16(__m256i half) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
  static __m512 load16(const T* p) {
    return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // The lanes of `m` only (the others read as zero): a row's tail.
  static __m512 load16(const T* p, __mmask16 m) { return widen16(_mm256_maskz_loadu_epi16(m, p)); }
#ifdef __AVX512BF16__
  // cvtneps rounds to nearest even, as torch rounds.
  static void store16(T* p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
  }
  static __m512 round16(__m512 v) { return widen16((__m256i)_mm512_cvtneps_pbh(v)); }  // rounded<>
#endif
#endif
};

// One operation in the activation dtype: computed in float, rounded back.
template <typename K>
inline float rounded(float f) {
  return K::load(K::store(f));
}

}  // namespace pdserve
