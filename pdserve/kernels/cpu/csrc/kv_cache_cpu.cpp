// Writes of one step's keys and values into the paged KV cache on CPU: a copy per token and
// head, where the torch reference's advanced-index assignment checks, sorts and dispatches.
// Built and loaded by pdserve/kernels/cpu/native.py; tokens split over torch's OpenMP threads.
#include <cstdint>

#include "kv_cache.h"

extern "C" void pdserve_write_kv_cache(const void* key, const void* value, void* cache,
                                       const int64_t* slot_mapping, int64_t tokens, int64_t heads,
                                       int64_t head_bytes, int64_t block_size,
                                       int64_t element_bytes, const pdserve::KVStrides* s,
                                       int num_threads) {
  pdserve::write_kv(key, value, cache, slot_mapping, tokens, heads, head_bytes, block_size,
                    element_bytes, *s, num_threads);
}

// An fp8 cache's write (kv_cache.h's write_kv_fp8). act: 0 float32, 1 bfloat16; format: 1 e4m3,
// 2 e5m2 (the FP8_FORMATS of kernels/kv_cache.py).
extern "C" void pdserve_write_kv_cache_fp8(int act, int format, const void* key, const void* value,
                                           void* cache, const int64_t* slot_mapping,
                                           int64_t tokens, int64_t heads, int64_t dim,
                                           int64_t block_size, const pdserve::KVStrides* s,
                                           float inv_k, float inv_v, int num_threads) {
  using pdserve::BF16, pdserve::E4M3, pdserve::E5M2, pdserve::F32;
  auto* c = static_cast<uint8_t*>(cache);
  const auto* kf = static_cast<const float*>(key);
  const auto* vf = static_cast<const float*>(value);
  const auto* kb = static_cast<const uint16_t*>(key);
  const auto* vb = static_cast<const uint16_t*>(value);
  if (act == 0 && format == 1)
    pdserve::write_kv_fp8<F32, E4M3>(kf, vf, c, slot_mapping, tokens, heads, dim, block_size, *s,
                                     inv_k, inv_v, num_threads);
  else if (act == 0)
    pdserve::write_kv_fp8<F32, E5M2>(kf, vf, c, slot_mapping, tokens, heads, dim, block_size, *s,
                                     inv_k, inv_v, num_threads);
  else if (format == 1)
    pdserve::write_kv_fp8<BF16, E4M3>(kb, vb, c, slot_mapping, tokens, heads, dim, block_size, *s,
                                      inv_k, inv_v, num_threads);
  else
    pdserve::write_kv_fp8<BF16, E5M2>(kb, vb, c, slot_mapping, tokens, heads, dim, block_size, *s,
                                      inv_k, inv_v, num_threads);
}
