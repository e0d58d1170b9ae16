// Paged attention for CPU tensors (paged_attention.h), and a layer's rotary + cache write +
// attention in one call. Built at run time by pdserve/kernels/cpu/native.py with the machine's
// compiler and called through ctypes: no torch headers, so it builds in about a second.
#include <cstdint>

#include "paged_attention.h"

using pdserve::E4M3;
using pdserve::E5M2;

// dtype: 0 float32, 1 bfloat16; cache_format: 0 the activations' dtype, 1 e4m3, 2 e5m2 (the
// FP8_FORMATS of kernels/kv_cache.py). Returns 0 where this build cannot (an fp8 cache needs
// bfloat16 activations and AVX-512 BF16, head sizes of 32s, groups up to 8): the caller falls back.
extern "C" int pdserve_paged_attention(int dtype, int cache_format, const void* query,
                                       const void* cache, const int32_t* block_table,
                                       const int32_t* query_start_loc, const int32_t* seq_lens,
                                       void* out, int64_t num_reqs, int num_threads,
                                       const Geometry* g) {
  const auto* qb = static_cast<const uint16_t*>(query);
  auto* ob = static_cast<uint16_t*>(out);
  if (cache_format == 0) {
    if (dtype == 0)
      attend_any<F32>(static_cast<const float*>(query), static_cast<const float*>(cache),
                      block_table, query_start_loc, seq_lens, static_cast<float*>(out),
                      num_reqs, num_threads, *g);
    else
      attend_any<BF16>(qb, static_cast<const uint16_t*>(cache), block_table, query_start_loc,
                       seq_lens, ob, num_reqs, num_threads, *g);
    return 1;
  }
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (dtype != 1 || g->head_dim % 32 != 0 || g->num_heads / g->num_kv_heads > 8) return 0;
  const auto* c = static_cast<const uint8_t*>(cache);
  if (cache_format == 1)
    attend_bf16<E4M3>(qb, c, block_table, query_start_loc, seq_lens, ob, num_reqs, num_threads,
                      *g);
  else
    attend_bf16<E5M2>(qb, c, block_table, query_start_loc, seq_lens, ob, num_reqs, num_threads,
                      *g);
  return 1;
#else
  return 0;
#endif
}

// bfloat16 only: float32 keeps the torch rotary, whose bits are HF's. g->stride_q_token is
// unused. cache_format and the return as pdserve_paged_attention's.
extern "C" int pdserve_rope_attention(int cache_format, const void* qkv, int64_t stride_qkv,
                                      const int64_t* positions, const void* cos_sin, void* cache,
                                      const int64_t* slot_mapping, int64_t num_tokens,
                                      const int32_t* block_table, const int32_t* query_start_loc,
                                      const int32_t* seq_lens, void* out, int64_t num_reqs,
                                      int num_threads, const Geometry* g) {
  const auto* x = static_cast<const uint16_t*>(qkv);
  const auto* table = static_cast<const uint16_t*>(cos_sin);
  auto* o = static_cast<uint16_t*>(out);
  if (cache_format == 0) {
    rope_attend<BF16>(x, stride_qkv, positions, table, static_cast<uint16_t*>(cache),
                      slot_mapping, num_tokens, g->block_size, block_table, query_start_loc,
                      seq_lens, o, num_reqs, num_threads, *g);
    return 1;
  }
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (g->head_dim % 32 != 0 || g->num_heads / g->num_kv_heads > 8) return 0;
  auto* c = static_cast<uint8_t*>(cache);
  if (cache_format == 1)
    rope_attend<BF16, E4M3>(x, stride_qkv, positions, table, c, slot_mapping, num_tokens,
                            g->block_size, block_table, query_start_loc, seq_lens, o, num_reqs,
                            num_threads, *g);
  else
    rope_attend<BF16, E5M2>(x, stride_qkv, positions, table, c, slot_mapping, num_tokens,
                            g->block_size, block_table, query_start_loc, seq_lens, o, num_reqs,
                            num_threads, *g);
  return 1;
#else
  return 0;
#endif
}
