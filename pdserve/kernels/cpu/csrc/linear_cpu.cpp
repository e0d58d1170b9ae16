// The kernels of packed_linear.h and norm_linear.h, one call each: a matmul (bf16 or float32, the
// output in the weight's dtype or in float32), an RMSNorm and the matmul after it, a decoder
// layer's norm and gated MLP. Built and loaded by pdserve/kernels/cpu/native.py.
#include <cstdint>

#include "norm_linear.h"
#include "packed_linear.h"

extern "C" {

int pdserve_amx_ready() { return amx_ready() ? 1 : 0; }

void pdserve_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* out) {
  pack_bf16(w, n, k, out);
}

void pdserve_pack_f32(const float* w, int64_t n, int64_t k, float* out) { pack_f32(w, n, k, out); }

// dtype: 0 float32, 1 bfloat16; out_f32: the output in float32 (logits) rather than the dtype.
void pdserve_linear(int dtype, int out_f32, const void* x, int64_t m, int64_t k, int64_t stride_x,
                    const void* packed, int64_t n, const void* bias, void* out,
                    int64_t stride_out, int num_threads) {
  if (dtype == 0) {
    packed_linear(static_cast<const float*>(x), m, k, stride_x, static_cast<const float*>(packed),
                  n, static_cast<const float*>(bias), static_cast<float*>(out), stride_out,
                  num_threads);
    return;
  }
  const auto* xb = static_cast<const uint16_t*>(x);
  const auto* pb = static_cast<const uint16_t*>(packed);
  const auto* bb = static_cast<const uint16_t*>(bias);
  if (out_f32)
    packed_linear(xb, m, k, stride_x, pb, n, bb, static_cast<float*>(out), stride_out,
                  num_threads);
  else
    packed_linear(xb, m, k, stride_x, pb, n, bb, static_cast<uint16_t*>(out), stride_out,
                  num_threads);
}

#ifdef PDSERVE_AVX512_BF16
int pdserve_fused_available() { return 1; }

void pdserve_norm_linear(const T* x, const T* residual, int64_t stride_x, int64_t stride_residual,
                         const T* norm_weight, float eps, int64_t m, int64_t hidden,
                         const T* packed, int64_t n, const T* bias, T* residual_out, T* out,
                         int num_threads) {
  norm_linear(x, residual, stride_x, stride_residual, norm_weight, eps, m, hidden, packed, n, bias,
              residual_out, out, num_threads);
}

void pdserve_norm_mlp(const T* x, const T* residual, int64_t stride_x, int64_t stride_residual,
                      const T* norm_weight, float eps, int64_t m, int64_t hidden,
                      const T* gate_up, const T* gate_up_bias, int64_t intermediate,
                      const T* down, const T* down_bias, T* residual_out, T* out,
                      int num_threads) {
  norm_mlp(x, residual, stride_x, stride_residual, norm_weight, eps, m, hidden, gate_up,
           gate_up_bias, intermediate, down, down_bias, residual_out, out, num_threads);
}
#else
int pdserve_fused_available() { return 0; }
#endif

}  // extern "C"
