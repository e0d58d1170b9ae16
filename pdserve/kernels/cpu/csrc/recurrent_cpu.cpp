// One recurrent step of the state models for each request of a batch, in place on the
// requests' state slots, one pass over each state (the torch forms read and write it several
// times, through temporaries, after a gather and before a scatter of every slot):
// - Gated DeltaNet (Qwen3.5's linear attention): per value head, the state S [K, V] decays by
//   exp(g), learns the token's key -> value by the delta rule at rate beta, and is read by the
//   query; float32 throughout.
// - Mamba's selective scan: per channel, the state [S] decays by exp(A dt) and takes dt B u; the
//   readout sums the state, rounded to the activation dtype, times C (HF's rounding).
// Each (request, head) or (request, channel) runs the same code, so its bits do not depend on
// the batch, and a prompt's tokens (one call each) get the bits of decode steps.
// Built and loaded by pdserve/kernels/cpu/native.py; the pairs split over threads.
#include <cmath>
#include <cstdint>
#include <vector>

#include "dtypes.h"

namespace {

using pdserve::BF16;
using pdserve::F32;
using pdserve::rounded;

constexpr int64_t kParallelMinStates = 1 << 18;  // floats of state: below, one thread

void deltanet_step(const float* q, const float* k, const float* v, const float* decay,
                   const float* beta, float* state, int64_t slot_stride, const int64_t* slots,
                   float* out, int64_t rows, int64_t heads, int64_t key_dim, int64_t value_dim,
                   int num_threads) {
  const int64_t pairs = rows * heads;
#pragma omp parallel num_threads(num_threads) if (pairs * key_dim * value_dim >= kParallelMinStates)
  {
    std::vector<float> delta(value_dim);
#pragma omp for
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t r = p / heads, h = p % heads;
      float* s = state + slots[r] * slot_stride + h * key_dim * value_dim;
      const float* qp = q + p * key_dim;
      const float* kp = k + p * key_dim;
      const float* vp = v + p * value_dim;
      const float d = decay[p], b = beta[p];
      float* o = out + p * value_dim;
      // delta = (v - (d * S)^T k) * beta, the decay applied as S is read.
      for (int64_t j = 0; j < value_dim; ++j) delta[j] = 0.f;
      for (int64_t i = 0; i < key_dim; ++i) {
        float* row = s + i * value_dim;
        const float ki = kp[i];
        for (int64_t j = 0; j < value_dim; ++j) {
          row[j] *= d;
          delta[j] += row[j] * ki;
        }
      }
      for (int64_t j = 0; j < value_dim; ++j) delta[j] = (vp[j] - delta[j]) * b;
      // S += k delta^T; out = S^T q.
      for (int64_t j = 0; j < value_dim; ++j) o[j] = 0.f;
      for (int64_t i = 0; i < key_dim; ++i) {
        float* row = s + i * value_dim;
        const float ki = kp[i], qi = qp[i];
        for (int64_t j = 0; j < value_dim; ++j) {
          row[j] += ki * delta[j];
          o[j] += row[j] * qi;
        }
      }
    }
  }
}

template <typename K>
void mamba_step(const float* dt, const float* A, const typename K::T* B, const typename K::T* C,
                const typename K::T* u, float* state, int64_t slot_stride, const int64_t* slots,
                float* out, int64_t rows, int64_t channels, int64_t state_size, int num_threads) {
  const int64_t pairs = rows * channels;
#pragma omp parallel for num_threads(num_threads) if (pairs * state_size >= kParallelMinStates)
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t r = p / channels, c = p % channels;
    float* s = state + slots[r] * slot_stride + c * state_size;
    const float d = dt[p], du = K::load(u[p]);
    const float* a = A + c * state_size;
    const typename K::T* b = B + r * state_size;
    const typename K::T* cr = C + r * state_size;
    float y = 0.f;
    for (int64_t i = 0; i < state_size; ++i) {
      s[i] = std::exp(a[i] * d) * s[i] + d * K::load(b[i]) * du;
      y += rounded<K>(rounded<K>(s[i]) * K::load(cr[i]));
    }
    out[p] = y;
  }
}

}  // namespace

// dt [rows, channels] and A [channels, state_size] float32; B, C [rows, state_size] and u [rows,
// channels] in the activation dtype (0 float32, 1 bfloat16); state: the slots' float32 states,
// slot s at state + s * slot_stride, each [channels, state_size] contiguous. out [rows,
// channels] float32: the readout's sum, before its rounding to the dtype.
extern "C" void pdserve_mamba_step(int dtype, const float* dt, const float* A, const void* B,
                                   const void* C, const void* u, float* state,
                                   int64_t slot_stride, const int64_t* slots, float* out,
                                   int64_t rows, int64_t channels, int64_t state_size,
                                   int num_threads) {
  if (dtype == 0)
    mamba_step<F32>(dt, A, static_cast<const float*>(B), static_cast<const float*>(C),
                    static_cast<const float*>(u), state, slot_stride, slots, out, rows,
                    channels, state_size, num_threads);
  else
    mamba_step<BF16>(dt, A, static_cast<const uint16_t*>(B), static_cast<const uint16_t*>(C),
                     static_cast<const uint16_t*>(u), state, slot_stride, slots, out, rows,
                     channels, state_size, num_threads);
}

// q, k [rows, heads, key_dim], v and out [rows, heads, value_dim], decay and beta [rows, heads],
// contiguous float32; state: the slots' float32 states, slot s at state + s * slot_stride, each
// [heads, key_dim, value_dim] contiguous.
extern "C" void pdserve_deltanet_step(const float* q, const float* k, const float* v,
                                      const float* decay, const float* beta, float* state,
                                      int64_t slot_stride, const int64_t* slots, float* out,
                                      int64_t rows, int64_t heads, int64_t key_dim,
                                      int64_t value_dim, int num_threads) {
  deltanet_step(q, k, v, decay, beta, state, slot_stride, slots, out, rows, heads, key_dim,
                value_dim, num_threads);
}
