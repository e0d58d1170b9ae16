// The kernels of quant_linear.h, one call each: packing GGUF blocks and the matmul on them.
// Built and loaded by pdserve/kernels/cpu/native.py; pdserve/kernels/quant_linear.py calls.
#include <cstdint>

#include "quant_linear.h"

extern "C" {

int64_t pdserve_quant_packed_bytes(int qtype, int64_t n, int64_t k) {
  return (n + kPanel - 1) / kPanel * (k / kQK) * packed_block_bytes(qtype);
}

void pdserve_quant_pack(const uint8_t* raw, int qtype, int64_t n, int64_t k, uint8_t* out) {
  pack(raw, qtype, n, k, out);
}

#ifdef PDSERVE_QUANT_LINEAR
int pdserve_quant_linear_available() { return 1; }

// dtype: 0 float32 (exact), 1 bfloat16 (int8 activations), the bias's too; out_f32: the output
// in float32 (logits) rather than the dtype.
void pdserve_quant_linear(int dtype, int out_f32, const void* x, int64_t m, int64_t k,
                          int64_t stride_x, const uint8_t* packed, int qtype, int64_t n,
                          const void* bias, void* out, int64_t stride_out, int num_threads) {
  if (dtype == 0) {
    quant_linear(static_cast<const float*>(x), m, k, stride_x, packed, qtype, n,
                 static_cast<const float*>(bias), static_cast<float*>(out), stride_out,
                 num_threads);
    return;
  }
  const auto* xb = static_cast<const uint16_t*>(x);
  const auto* bb = static_cast<const uint16_t*>(bias);
  if (out_f32)
    quant_linear(xb, m, k, stride_x, packed, qtype, n, bb, static_cast<float*>(out), stride_out,
                 num_threads);
  else
    quant_linear(xb, m, k, stride_x, packed, qtype, n, bb, static_cast<uint16_t*>(out),
                 stride_out, num_threads);
}
#else
int pdserve_quant_linear_available() { return 0; }
#endif

}  // extern "C"
