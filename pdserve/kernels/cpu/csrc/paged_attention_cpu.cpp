// Paged attention for CPU tensors (paged_attention.h), and a layer's rotary + cache write +
// attention in one call. Built at run time by pdserve/kernels/cpu/native.py with the machine's
// compiler and called through ctypes: no torch headers, so it builds in about a second.
#include <cstdint>

#include "paged_attention.h"

// dtype: 0 float32, 1 bfloat16.
extern "C" void pdserve_paged_attention(int dtype, const void* query, const void* cache,
                                        const int32_t* block_table, const int32_t* query_start_loc,
                                        const int32_t* seq_lens, void* out, int64_t num_reqs,
                                        int num_threads, const Geometry* g) {
  if (dtype == 0)
    attend_any<F32>(static_cast<const float*>(query), static_cast<const float*>(cache),
                    block_table, query_start_loc, seq_lens, static_cast<float*>(out), num_reqs,
                    num_threads, *g);
  else
    attend_any<BF16>(static_cast<const uint16_t*>(query), static_cast<const uint16_t*>(cache),
                     block_table, query_start_loc, seq_lens, static_cast<uint16_t*>(out),
                     num_reqs, num_threads, *g);
}

// bfloat16 only: float32 keeps the torch rotary, whose bits are HF's. g->stride_q_token is unused.
extern "C" void pdserve_rope_attention(const void* qkv, int64_t stride_qkv,
                                       const int64_t* positions, const void* cos_sin, void* cache,
                                       const int64_t* slot_mapping, int64_t num_tokens,
                                       const int32_t* block_table,
                                       const int32_t* query_start_loc, const int32_t* seq_lens,
                                       void* out, int64_t num_reqs, int num_threads,
                                       const Geometry* g) {
  rope_attend<BF16>(static_cast<const uint16_t*>(qkv), stride_qkv, positions,
                    static_cast<const uint16_t*>(cos_sin), static_cast<uint16_t*>(cache),
                    slot_mapping, num_tokens, g->block_size, block_table, query_start_loc,
                    seq_lens, static_cast<uint16_t*>(out), num_reqs, num_threads, *g);
}
