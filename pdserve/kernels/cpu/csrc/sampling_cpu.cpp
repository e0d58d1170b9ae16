// Greedy sampling on CPU: the first maximum of each row of logits, read in their own dtype (a
// float32 copy of a [batch, vocab] bf16 tensor costs more than the search itself).
// Built and loaded by pdserve/kernels/cpu/native.py; rows split over torch's OpenMP threads.
//
// Values are compared as integers whose order is the floats' order (sign and magnitude made a
// two's complement, -0 and +0 one key): exact under fast math, and a positive NaN ranks above
// +inf, as torch's max puts NaN first.
#include <cstdint>

namespace {

inline int32_t ordered(int32_t bits) { return bits >= 0 ? bits : -(bits & 0x7fffffff); }

inline int32_t key(uint16_t bf16) { return ordered(int32_t(uint32_t(bf16) << 16)); }

inline int32_t key(float f32) {
  int32_t bits;
  __builtin_memcpy(&bits, &f32, 4);
  return ordered(bits);
}

template <typename T>
void argmax(const T* logits, int64_t rows, int64_t vocab, int64_t stride_row, int64_t* out,
            int num_threads) {
#pragma omp parallel for num_threads(num_threads)
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = logits + r * stride_row;
    int32_t best = INT32_MIN;
    for (int64_t i = 0; i < vocab; ++i) best = key(row[i]) > best ? key(row[i]) : best;
    int64_t index = 0;
    while (key(row[index]) != best) ++index;
    out[r] = index;
  }
}

}  // namespace

// dtype: 0 float32, 1 bfloat16.
extern "C" void pdserve_argmax(int dtype, const void* logits, int64_t rows, int64_t vocab,
                               int64_t stride_row, int64_t* out, int num_threads) {
  if (dtype == 0)
    argmax(static_cast<const float*>(logits), rows, vocab, stride_row, out, num_threads);
  else
    argmax(static_cast<const uint16_t*>(logits), rows, vocab, stride_row, out, num_threads);
}
