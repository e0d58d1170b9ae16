// The small kernels between the matmuls of a decoder layer, each one pass over its rows where
// the torch reference takes five to ten: RMSNorm (with the residual add before it), rotary
// embedding, SiLU-and-mul. They round where the reference rounds (after every operation in
// the activation dtype), so they differ from it only in the order of the variance sum and in
// the last bit of SiLU's exp.
// Built and loaded by pdserve/kernels/native.py; rows split over torch's OpenMP threads.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dtypes.h"

namespace {

// Below this many elements (~300 us of work on one thread) one thread finishes before a second
// would have started: a sleeping OpenMP thread (OMP_WAIT_POLICY=PASSIVE) takes 100-300 us to
// wake on these VMs, and a running one may be preempted. Every decode step's norms, rotations
// and activations stay on the calling thread; prefill's large batches are split.
constexpr int64_t kParallelMinElements = 1 << 20;

using pdserve::BF16;
using pdserve::F32;
using pdserve::rounded;

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

void rms_norm_bf16(const uint16_t* x, const uint16_t* residual, const uint16_t* weight,
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

void silu_and_mul_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int64_t d,
                       int64_t stride_x, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * d >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* gate = x + r * stride_x;
    const uint16_t* up = gate + d;
    uint16_t* o = out + r * d;
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 m = lanes(i, d);
      const __m512 g = BF16::load16(gate + i, m);
      const __m512 minus_g = _mm512_sub_ps(_mm512_setzero_ps(), g);
      const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(minus_g));
      // 1 / den: the 14-bit estimate and one Newton step (within an ulp; a division takes
      // longer than everything else here together).
      __m512 rcp = _mm512_rcp14_ps(den);
      rcp = _mm512_mul_ps(rcp, _mm512_fnmadd_ps(den, rcp, _mm512_set1_ps(2.f)));
      const __m512 silu = BF16::round16(_mm512_mul_ps(g, rcp));
      BF16::store16(o + i, _mm512_mul_ps(silu, BF16::load16(up + i, m)), m);
    }
  }
}
#endif

template <typename K>
void rms_norm(const typename K::T* x, const typename K::T* residual, const typename K::T* weight,
              typename K::T* out, typename K::T* residual_out, int64_t rows, int64_t hidden,
              int64_t stride_x, int64_t stride_residual, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) {
    const typename K::T* xr = x + r * stride_x;
    typename K::T* o = out + r * hidden;
    float sum = 0.f;
    if (residual != nullptr) {
      const typename K::T* rr = residual + r * stride_residual;
      typename K::T* ro = residual_out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        ro[i] = K::store(K::load(rr[i]) + K::load(xr[i]));
        const float v = K::load(ro[i]);
        sum += v * v;
      }
      xr = ro;
    } else {
      for (int64_t i = 0; i < hidden; ++i) sum += K::load(xr[i]) * K::load(xr[i]);
    }
    const float inv = 1.f / std::sqrt(sum / float(hidden) + eps);
    for (int64_t i = 0; i < hidden; ++i)
      o[i] = K::store(K::load(weight[i]) * rounded<K>(K::load(xr[i]) * inv));
  }
}

// x * cos + roll(x, head_dim / 2) * sin per head, the sign of sin folded into the table.
template <typename K>
void rotate(const int64_t* positions, const typename K::T* src, typename K::T* dst,
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

template <typename K>
void silu_and_mul(const typename K::T* x, typename K::T* out, int64_t rows, int64_t d,
                  int64_t stride_x, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * d >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) {
    const typename K::T* gate = x + r * stride_x;
    const typename K::T* up = gate + d;
    typename K::T* o = out + r * d;
    for (int64_t i = 0; i < d; ++i) {
      const float g = K::load(gate[i]);
      o[i] = K::store(rounded<K>(g / (1.f + std::exp(-g))) * K::load(up[i]));
    }
  }
}

}  // namespace

// dtype: 0 float32, 1 bfloat16. `residual` may be null (then `residual_out` is unused).
extern "C" void pdserve_rms_norm(int dtype, const void* x, const void* residual,
                                 const void* weight, void* out, void* residual_out, int64_t rows,
                                 int64_t hidden, int64_t stride_x, int64_t stride_residual,
                                 float eps, int num_threads) {
  if (dtype == 0)
    rms_norm<F32>(static_cast<const float*>(x), static_cast<const float*>(residual),
                  static_cast<const float*>(weight), static_cast<float*>(out),
                  static_cast<float*>(residual_out), rows, hidden, stride_x, stride_residual, eps,
                  num_threads);
  else
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    rms_norm_bf16(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(residual),
                  static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out),
                  static_cast<uint16_t*>(residual_out), rows, hidden, stride_x, stride_residual,
                  eps, num_threads);
#else
    rms_norm<BF16>(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(residual),
                   static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out),
                   static_cast<uint16_t*>(residual_out), rows, hidden, stride_x, stride_residual,
                   eps, num_threads);
#endif
}

extern "C" void pdserve_rotary(int dtype, const int64_t* positions, const void* src, void* dst,
                               const void* cos_sin, int64_t tokens, int64_t heads,
                               int64_t head_dim, int64_t stride_token, int64_t stride_head,
                               int num_threads) {
  if (dtype == 0)
    rotate<F32>(positions, static_cast<const float*>(src), static_cast<float*>(dst),
                static_cast<const float*>(cos_sin), tokens, heads, head_dim, stride_token,
                stride_head, num_threads);
  else
    rotate<BF16>(positions, static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst),
                 static_cast<const uint16_t*>(cos_sin), tokens, heads, head_dim, stride_token,
                 stride_head, num_threads);
}

extern "C" void pdserve_silu_and_mul(int dtype, const void* x, void* out, int64_t rows, int64_t d,
                                     int64_t stride_x, int num_threads) {
  if (dtype == 0)
    silu_and_mul<F32>(static_cast<const float*>(x), static_cast<float*>(out), rows, d, stride_x,
                      num_threads);
  else
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    silu_and_mul_bf16(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), rows, d,
                      stride_x, num_threads);
#else
    silu_and_mul<BF16>(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), rows, d,
                       stride_x, num_threads);
#endif
}
