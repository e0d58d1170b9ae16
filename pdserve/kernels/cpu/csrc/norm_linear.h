// An RMSNorm and the matmuls after it in one call (kernels/cpu/norm_linear.py), bf16 on AMX or
// AVX512-BF16: a layer's input norm and q/k/v, its post-attention norm and gated MLP. Each step
// runs the same code as its own kernel (elementwise.h, packed_linear.h), so the bits are the
// steps'. Shared by linear_cpu.cpp and decoder_cpu.cpp.
#pragma once
#include <cstdint>
#include <vector>

#include "elementwise.h"
#include "packed_linear.h"

namespace {

#ifdef PDSERVE_AVX512_BF16
using T = BF16::T;

// An RMSNorm (with the residual add before it where `residual` is not null) and the matmul of
// its output, in one call: each step the same code as its own kernel, so the same bits.
// `residual_out` (unused without a residual) is [m, hidden], `out` [m, n].
inline void norm_linear(const T* x, const T* residual, int64_t stride_x, int64_t stride_residual,
                        const T* norm_weight, float eps, int64_t m, int64_t hidden,
                        const T* packed, int64_t n, const T* bias, T* residual_out, T* out,
                        int num_threads) {
  // Reused across calls of this thread (the engine's single caller).
  thread_local std::vector<T> normed;
  normed.resize(m * hidden);
  pdserve::rms_norm_bf16(x, residual, norm_weight, normed.data(), residual_out, m, hidden,
                         stride_x, stride_residual, eps, num_threads);
  packed_linear(normed.data(), m, hidden, hidden, packed, n, bias, out, n, num_threads);
}

// A decoder layer's second half: the post-attention norm, gate_up, SiLU-and-mul and down.
// `residual_out` and `out` are [m, hidden]; biases may be null.
inline void norm_mlp(const T* x, const T* residual, int64_t stride_x, int64_t stride_residual,
                     const T* norm_weight, float eps, int64_t m, int64_t hidden,
                     const T* gate_up, const T* gate_up_bias, int64_t intermediate, const T* down,
                     const T* down_bias, T* residual_out, T* out, int num_threads) {
  thread_local std::vector<T> projected, activated;
  projected.resize(m * 2 * intermediate);
  activated.resize(m * intermediate);
  norm_linear(x, residual, stride_x, stride_residual, norm_weight, eps, m, hidden, gate_up,
              2 * intermediate, gate_up_bias, residual_out, projected.data(), num_threads);
  pdserve::silu_and_mul_bf16(projected.data(), activated.data(), m, intermediate,
                             2 * intermediate, num_threads);
  packed_linear(activated.data(), m, intermediate, intermediate, down, hidden, down_bias, out,
                hidden, num_threads);
}
#endif

}  // namespace
