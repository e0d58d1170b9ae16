// The write of one step's keys and values into the paged KV cache: kv_cache_cpu.cpp's kernel,
// and the store inside paged_attention_cpu.cpp's fused rotary + attention call.
#pragma once
#include <cstdint>
#include <cstring>

#include "dtypes.h"
#include "fp8.h"

namespace pdserve {

struct KVStrides {
  int64_t key_token, key_head, value_token, value_head;
  int64_t block, kv, slot, head;
};

// key/value [tokens, heads, head_dim] with adjacent elements in a head; slot -1 is not written.
inline void write_kv(const void* key, const void* value, void* cache, const int64_t* slot_mapping,
                     int64_t tokens, int64_t heads, int64_t head_bytes, int64_t block_size,
                     int64_t element_bytes, const KVStrides& s, int num_threads) {
  const char* k = static_cast<const char*>(key);
  const char* v = static_cast<const char*>(value);
  char* c = static_cast<char*>(cache);
  // Below a few thousand heads a second thread costs more to wake than it saves.
#pragma omp parallel for num_threads(num_threads) if (tokens * heads > 4096)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    char* dst = c + ((slot / block_size) * s.block + (slot % block_size) * s.slot) * element_bytes;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(dst + h * s.head * element_bytes,
                  k + (t * s.key_token + h * s.key_head) * element_bytes, head_bytes);
      std::memcpy(dst + (s.kv + h * s.head) * element_bytes,
                  v + (t * s.value_token + h * s.value_head) * element_bytes, head_bytes);
    }
  }
}

// The same into an fp8 cache of format C: each element of key (value) times inv_k (inv_v),
// stored rounded and saturated. Strides as write_kv's, in elements of each side's own type.
template <typename K, typename C>
inline void write_kv_fp8(const typename K::T* key, const typename K::T* value, uint8_t* cache,
                         const int64_t* slot_mapping, int64_t tokens, int64_t heads, int64_t dim,
                         int64_t block_size, const KVStrides& s, float inv_k, float inv_v,
                         int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (tokens * heads > 4096)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    uint8_t* dst = cache + (slot / block_size) * s.block + (slot % block_size) * s.slot;
    for (int64_t h = 0; h < heads; ++h) {
      const typename K::T* k = key + t * s.key_token + h * s.key_head;
      const typename K::T* v = value + t * s.value_token + h * s.value_head;
      uint8_t* dk = dst + h * s.head;
      for (int64_t d = 0; d < dim; ++d) dk[d] = C::from_float(K::load(k[d]) * inv_k);
      for (int64_t d = 0; d < dim; ++d) dk[s.kv + d] = C::from_float(K::load(v[d]) * inv_v);
    }
  }
}

}  // namespace pdserve
