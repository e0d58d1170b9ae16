// The bodies of elementwise_cpu.cpp's kernels that other kernels run too, so that a fused call
// gives the same bits as its steps: rotary embedding (paged_attention_cpu.cpp's fused call), and
// RMSNorm (with the residual add before it) and SiLU-and-mul on bf16 rows with AVX-512
// (linear_cpu.cpp's). Each call runs its rows on `num_threads` OpenMP threads where the batch is
// large enough to gain from a second (kParallelMinElements), else on the caller's.
#pragma once
#include <cmath>
#include <cstdint>

#include "dtypes.h"

namespace pdserve {

// Below this many elements (~300 us of work on one thread) one thread finishes before a second
// would have started: a sleeping OpenMP thread (OMP_WAIT_POLICY=PASSIVE) takes 100-300 us to
// wake on these VMs, and a running one may be preempted. Every decode step's norms, rotations
// and activations stay on the calling thread; prefill's large batches are split.
constexpr int64_t kParallelMinElements = 1 << 20;

// x * cos + roll(x, head_dim / 2) * sin per head, the sign of sin folded into the table.
template <typename K>
inline void rotate(const int64_t* positions, const typename K::T* src, typename K::T* dst,
            const typename K::T* cos_sin, int64_t tokens, int64_t heads, int64_t head_dim,
            int64_t stride_token, int64_t stride_head, int num_threads) {
  const int64_t half = head_dim / 2;
  const bool parallel = tokens * heads * head_dim >= kParallelMinElements;
#pragma omp parallel for num_threads(num_threads) if (parallel)
  for (int64_t t = 0; t < tokens; ++t) {
    const typename K::T* cos = cos_sin + positions[t] * 2 * head_dim;
    const typename K::T* sin = cos + head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      const typename K::T* x = src + t * stride_token + h * stride_head;
      typename K::T* o = dst + (t * heads + h) * head_dim;
      // Two halves, so that the roll is an offset rather than a modulo per element.
      for (int64_t d = 0; d < half; ++d)
        o[d] = K::store(rounded<K>(K::load(x[d]) * K::load(cos[d])) +
                        rounded<K>(K::load(x[d + half]) * K::load(sin[d])));
      for (int64_t d = half; d < head_dim; ++d)
        o[d] = K::store(rounded<K>(K::load(x[d]) * K::load(cos[d])) +
                        rounded<K>(K::load(x[d - half]) * K::load(sin[d])));
    }
  }
}

// A gated activation g * sigmoid(arg(g)): SiLU's arg is g; GELU's tanh approximation is
// 0.5 g (1 + tanh(y)) = g * sigmoid(2y) with y = sqrt(2/pi) (g + 0.044715 g^3).
struct Silu {
  static float arg(float g) { return g; }
#ifdef __AVX512F__
  static __m512 arg16(__m512 g) { return g; }
#endif
};
struct GeluTanh {
  static constexpr float kA = 2.f * 0.7978845608028654f, kB = kA * 0.044715f;
  static float arg(float g) { return g * (kA + kB * g * g); }
#ifdef __AVX512F__
  static __m512 arg16(__m512 g) {
    return _mm512_mul_ps(g, _mm512_fmadd_ps(_mm512_mul_ps(g, g), _mm512_set1_ps(kB),
                                            _mm512_set1_ps(kA)));
  }
#endif
};

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The lanes of the 16 from element i that lie in a row of n.
inline __mmask16 lanes(int64_t i, int64_t n) {
  return n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
}

// exp(x), Cephes' single-precision polynomial on x - n ln2 (within 1-2 ulp of expf): libmvec's
// vector expf is about twice as slow, and silu's result is rounded to bfloat16 anyway.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(r, r), p, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(e, n);
}

inline void rms_norm_bf16(const uint16_t* x, const uint16_t* residual, const uint16_t* weight,
                   uint16_t* out, uint16_t* residual_out, int64_t rows, int64_t hidden,
                   int64_t stride_x, int64_t stride_residual, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * stride_x;
    uint16_t* o = out + r * hidden;
    __m512 sums = _mm512_setzero_ps();
    if (residual != nullptr) {
      const uint16_t* rr = residual + r * stride_residual;
      uint16_t* ro = residual_out + r * hidden;
      for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 m = lanes(i, hidden);
        const __m512 sum = _mm512_add_ps(BF16::load16(rr + i, m), BF16::load16(xr + i, m));
        const __m512 v = BF16::round16(sum);
        BF16::store16(ro + i, v, m);
        sums = _mm512_fmadd_ps(v, v, sums);  // masked-off lanes are zero
      }
      xr = ro;
    } else {
      for (int64_t i = 0; i < hidden; i += 16) {
        const __m512 v = BF16::load16(xr + i, lanes(i, hidden));
        sums = _mm512_fmadd_ps(v, v, sums);
      }
    }
    const __m512 inv =
        _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(sums) / float(hidden) + eps));
    for (int64_t i = 0; i < hidden; i += 16) {
      const __mmask16 m = lanes(i, hidden);
      const __m512 normed = BF16::round16(_mm512_mul_ps(BF16::load16(xr + i, m), inv));
      BF16::store16(o + i, _mm512_mul_ps(BF16::load16(weight + i, m), normed), m);
    }
  }
}

template <typename Act>
inline void act_and_mul_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int64_t d,
                             int64_t stride_x, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * d >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* gate = x + r * stride_x;
    const uint16_t* up = gate + d;
    uint16_t* o = out + r * d;
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 m = lanes(i, d);
      const __m512 g = BF16::load16(gate + i, m);
      const __m512 minus_arg = _mm512_sub_ps(_mm512_setzero_ps(), Act::arg16(g));
      const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(minus_arg));
      // 1 / den: the 14-bit estimate and one Newton step (within an ulp; a division takes
      // longer than everything else here together).
      __m512 rcp = _mm512_rcp14_ps(den);
      rcp = _mm512_mul_ps(rcp, _mm512_fnmadd_ps(den, rcp, _mm512_set1_ps(2.f)));
      const __m512 act = BF16::round16(_mm512_mul_ps(g, rcp));
      BF16::store16(o + i, _mm512_mul_ps(act, BF16::load16(up + i, m)), m);
    }
  }
}

inline void silu_and_mul_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int64_t d,
                              int64_t stride_x, int num_threads) {
  act_and_mul_bf16<Silu>(x, out, rows, d, stride_x, num_threads);
}
#endif

}  // namespace pdserve
