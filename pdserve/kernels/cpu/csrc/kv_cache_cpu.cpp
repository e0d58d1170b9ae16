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
