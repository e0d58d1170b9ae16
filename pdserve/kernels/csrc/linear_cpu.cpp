// The AMX linear kernels of amx_linear.h, one call each: a matmul, an RMSNorm and the matmul
// after it, a decoder layer's norm and gated MLP. Built and loaded by pdserve/kernels/native.py.
// Without AMX only pdserve_amx_enable is built, and it reports the kernels unavailable.
#include <cstdint>

#include "amx_linear.h"

#ifdef PDSERVE_AMX
extern "C" {

int pdserve_amx_enable() { return amx_enable(); }

void pdserve_amx_pack(const T* w, int64_t n, int64_t k, T* out) { amx_pack(w, n, k, out); }

void pdserve_amx_linear(const T* x, int64_t m, int64_t k, int64_t stride_x, const T* packed,
                        int64_t n, const T* bias, T* out, int64_t stride_out, int num_threads) {
  amx_linear(x, m, k, stride_x, packed, n, bias, out, stride_out, num_threads);
}

void pdserve_amx_norm_linear(const T* x, const T* residual, int64_t stride_x,
                             int64_t stride_residual, const T* norm_weight, float eps, int64_t m,
                             int64_t hidden, const T* packed, int64_t n, const T* bias,
                             T* residual_out, T* out, int num_threads) {
  amx_norm_linear(x, residual, stride_x, stride_residual, norm_weight, eps, m, hidden, packed, n,
                  bias, residual_out, out, num_threads);
}

void pdserve_amx_norm_mlp(const T* x, const T* residual, int64_t stride_x, int64_t stride_residual,
                          const T* norm_weight, float eps, int64_t m, int64_t hidden,
                          const T* gate_up, const T* gate_up_bias, int64_t intermediate,
                          const T* down, const T* down_bias, T* residual_out, T* out,
                          int num_threads) {
  amx_norm_mlp(x, residual, stride_x, stride_residual, norm_weight, eps, m, hidden, gate_up,
               gate_up_bias, intermediate, down, down_bias, residual_out, out, num_threads);
}

}  // extern "C"
#else
extern "C" int pdserve_amx_enable() { return -1; }
#endif
