// An RMSNorm and the matmuls after it in one call (kernels/cpu/norm_linear.py), bf16 on AMX or
// AVX512-BF16: a layer's input norm and q/k/v, its post-attention norm and gated MLP. Each step
// runs the same code as its own kernel (elementwise.h, packed_linear.h), so the bits are the
// steps'. Shared by linear_cpu.cpp and decoder_cpu.cpp.
#pragma once
#include <cstdint>
#include <vector>

#include "elementwise.h"
#include "packed_linear.h"
#include "quant_linear.h"

namespace {

#ifdef PDSERVE_AVX512_BF16
using T = BF16::T;

// x W^T (+ b), x's rows `stride_x` apart: W bf16-packed (qtype 0, packed_linear.h) or kept in
// GGUF blocks of that type (quant_linear.h).
inline void project(const T* x, int64_t m, int64_t k, int64_t stride_x, const void* w, int qtype,
                    int64_t n, const T* bias, T* out, int64_t stride_out, int num_threads) {
#ifdef PDSERVE_QUANT_LINEAR
  if (qtype != 0) {
    quant_linear(x, m, k, stride_x, static_cast<const uint8_t*>(w), qtype, n, bias, out,
                 stride_out, num_threads);
    return;
  }
#endif
  packed_linear(x, m, k, stride_x, static_cast<const T*>(w), n, bias, out, stride_out,
                num_threads);
}

// An RMSNorm (with the residual add before it where `residual` is not null) and the matmul of
// its output, in one call: each step the same code as its own kernel, so the same bits.
// `residual_out` (unused without a residual) is [m, hidden], `out` [m, n].
inline void norm_linear(const T* x, const T* residual, int64_t stride_x, int64_t stride_residual,
                        const T* norm_weight, float eps, int64_t m, int64_t hidden,
                        const void* packed, int64_t n, const T* bias, T* residual_out, T* out,
                        int num_threads, int qtype = 0) {
  // Reused across calls of this thread (the engine's single caller).
  thread_local std::vector<T> normed;
  normed.resize(m * hidden);
  pdserve::rms_norm_bf16(x, residual, norm_weight, normed.data(), residual_out, m, hidden,
                         stride_x, stride_residual, eps, num_threads);
  project(normed.data(), m, hidden, hidden, packed, qtype, n, bias, out, n, num_threads);
}

// A decoder layer's second half: the post-attention norm, gate_up, SiLU-and-mul and down.
// `residual_out` and `out` are [m, hidden]; biases may be null.
inline void norm_mlp(const T* x, const T* residual, int64_t stride_x, int64_t stride_residual,
                     const T* norm_weight, float eps, int64_t m, int64_t hidden,
                     const void* gate_up, const T* gate_up_bias, int64_t intermediate,
                     const void* down, const T* down_bias, T* residual_out, T* out,
                     int num_threads, int gate_up_type = 0, int down_type = 0) {
  thread_local std::vector<T> projected, activated;
  projected.resize(m * 2 * intermediate);
  activated.resize(m * intermediate);
  norm_linear(x, residual, stride_x, stride_residual, norm_weight, eps, m, hidden, gate_up,
              2 * intermediate, gate_up_bias, residual_out, projected.data(), num_threads,
              gate_up_type);
  pdserve::silu_and_mul_bf16(projected.data(), activated.data(), m, intermediate,
                             2 * intermediate, num_threads);
  project(activated.data(), m, intermediate, intermediate, down, down_type, hidden, down_bias,
          out, hidden, num_threads);
}
#endif

}  // namespace
