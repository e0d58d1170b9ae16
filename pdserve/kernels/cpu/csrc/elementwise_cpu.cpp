// The small kernels between the matmuls of a decoder layer, each one pass over its rows where
// the torch reference takes five to ten: RMSNorm (with the residual add before it), rotary
// embedding, SiLU- and GELU(tanh)-and-mul, a sigmoid gate, Gated DeltaNet's gates. They round where the reference rounds (after every operation in
// the activation dtype), so they differ from it only in the order of the variance sum and in
// the last bit of SiLU's exp.
// Built and loaded by pdserve/kernels/cpu/native.py; rows split over torch's OpenMP threads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dtypes.h"
#include "elementwise.h"

namespace {

using pdserve::BF16;
using pdserve::F32;
using pdserve::GeluTanh;
using pdserve::Silu;
using pdserve::kParallelMinElements;
using pdserve::rotate;
using pdserve::rounded;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
using pdserve::rms_norm_bf16;
using pdserve::act_and_mul_bf16;
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

template <typename K, typename Act>
void act_and_mul(const typename K::T* x, typename K::T* out, int64_t rows, int64_t d,
                 int64_t stride_x, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * d >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) {
    const typename K::T* gate = x + r * stride_x;
    const typename K::T* up = gate + d;
    typename K::T* o = out + r * d;
    for (int64_t i = 0; i < d; ++i) {
      const float g = K::load(gate[i]);
      // Capped where exp overflows: the build's fast math assumes no infinities.
      const float e = std::exp(std::min(-Act::arg(g), 88.f));
      o[i] = K::store(rounded<K>(g / (1.f + e)) * K::load(up[i]));
    }
  }
}

// out[r] = sigmoid(gate[r]) * x[r]: a gate of one value per row (Qwen2-MoE's shared expert).
// One exp per row, computed inside the row's loop: the same code for every row, where a
// vectorized loop over the gates would give a batch's last rows a scalar exp of other bits.
template <typename K>
void sigmoid_mul(const typename K::T* gate, int64_t stride_gate, const typename K::T* x,
                 typename K::T* out, int64_t rows, int64_t d, int64_t stride_x, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * d >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) {
    const float g = K::load(gate[r * stride_gate]);
    const float s = rounded<K>(1.f / (1.f + std::exp(-g)));
    const typename K::T* xr = x + r * stride_x;
    typename K::T* o = out + r * d;
    for (int64_t i = 0; i < d; ++i) o[i] = K::store(s * K::load(xr[i]));
  }
}

// Gated DeltaNet's gates of each token (row) and value head: g = -exp(A_log) * softplus(a +
// dt_bias) in float32 (softplus linear above 20, as torch's), the step's decay exp(g), and
// beta = sigmoid(b) rounded to the dtype. Every row runs the same loop over its heads, so a
// head's gates have the same bits in any row of any batch (a vectorized torch op over a few
// heads per row gives a batch's last rows a scalar exp of other bits).
template <typename K>
void deltanet_gates(const typename K::T* a, const typename K::T* b, int64_t stride,
                    const typename K::T* a_log, const typename K::T* dt_bias, float* g,
                    float* decay, float* beta, int64_t rows, int64_t heads, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * heads >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      const float x = K::load(a[r * stride + h]) + K::load(dt_bias[h]);
      const float softplus = x > 20.f ? x : std::log1p(std::exp(x));
      const float gate = -std::exp(K::load(a_log[h])) * softplus;
      g[r * heads + h] = gate;
      decay[r * heads + h] = std::exp(gate);
      const float bb = K::load(b[r * stride + h]);
      beta[r * heads + h] = rounded<K>(1.f / (1.f + std::exp(std::min(-bb, 88.f))));
    }
  }
}

}  // namespace

extern "C" void pdserve_deltanet_gates(int dtype, const void* a, const void* b, int64_t stride,
                                       const void* a_log, const void* dt_bias, float* g,
                                       float* decay, float* beta, int64_t rows, int64_t heads,
                                       int num_threads) {
  if (dtype == 0)
    deltanet_gates<F32>(static_cast<const float*>(a), static_cast<const float*>(b), stride,
                        static_cast<const float*>(a_log), static_cast<const float*>(dt_bias), g,
                        decay, beta, rows, heads, num_threads);
  else
    deltanet_gates<BF16>(static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b),
                         stride, static_cast<const uint16_t*>(a_log),
                         static_cast<const uint16_t*>(dt_bias), g, decay, beta, rows, heads,
                         num_threads);
}

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

namespace {

template <typename Act>
void act_and_mul_any(int dtype, const void* x, void* out, int64_t rows, int64_t d,
                     int64_t stride_x, int num_threads) {
  if (dtype == 0)
    act_and_mul<F32, Act>(static_cast<const float*>(x), static_cast<float*>(out), rows, d,
                          stride_x, num_threads);
  else
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    act_and_mul_bf16<Act>(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), rows, d,
                          stride_x, num_threads);
#else
    act_and_mul<BF16, Act>(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), rows,
                           d, stride_x, num_threads);
#endif
}

}  // namespace

extern "C" void pdserve_silu_and_mul(int dtype, const void* x, void* out, int64_t rows, int64_t d,
                                     int64_t stride_x, int num_threads) {
  act_and_mul_any<Silu>(dtype, x, out, rows, d, stride_x, num_threads);
}

extern "C" void pdserve_gelu_tanh_and_mul(int dtype, const void* x, void* out, int64_t rows,
                                          int64_t d, int64_t stride_x, int num_threads) {
  act_and_mul_any<GeluTanh>(dtype, x, out, rows, d, stride_x, num_threads);
}

extern "C" void pdserve_sigmoid_mul(int dtype, const void* gate, int64_t stride_gate,
                                    const void* x, void* out, int64_t rows, int64_t d,
                                    int64_t stride_x, int num_threads) {
  if (dtype == 0)
    sigmoid_mul<F32>(static_cast<const float*>(gate), stride_gate, static_cast<const float*>(x),
                     static_cast<float*>(out), rows, d, stride_x, num_threads);
  else
    sigmoid_mul<BF16>(static_cast<const uint16_t*>(gate), stride_gate,
                      static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), rows, d,
                      stride_x, num_threads);
}
