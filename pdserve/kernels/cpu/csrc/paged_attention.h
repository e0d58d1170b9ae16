// Paged attention for CPU tensors: each query token attends causally to its request's keys,
// read through the block table where they lie (no gathered copy of the cache).
//
// Shared by paged_attention_cpu.cpp (its calls) and decoder_cpu.cpp (a whole decoder stack).
// OpenMP splits the (request, KV head) work items; the libraries resolve libgomp to the copy
// torch already loaded, so they share torch's threads instead of fighting them for the cores.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dtypes.h"
#include "elementwise.h"
#include "fp8.h"
#include "kv_cache.h"

namespace {

using pdserve::BF16;
using pdserve::F32;

// Scores of `n` (<= 4) consecutive keys, `stride` elements apart, against `group` query heads,
// into scores[h * scores_stride + i]. Several keys at once keep independent sums in flight: one
// dot product's horizontal sum alone would leave the core waiting.
template <typename K>
inline void score_keys(const float* q, const typename K::T* key, int64_t stride, int64_t n,
                       int64_t group, int64_t dim, float* scores, int64_t scores_stride) {
#ifdef __AVX512F__
  if (dim % 16 == 0) {
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = q + h * dim;
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                       _mm512_setzero_ps()};
      for (int64_t d = 0; d < dim; d += 16) {
        const __m512 qv = _mm512_loadu_ps(qh + d);
        for (int64_t i = 0; i < n; ++i)
          acc[i] = _mm512_fmadd_ps(qv, K::load16(key + i * stride + d), acc[i]);
      }
      for (int64_t i = 0; i < n; ++i) scores[h * scores_stride + i] = _mm512_reduce_add_ps(acc[i]);
    }
    return;
  }
#endif
  for (int64_t h = 0; h < group; ++h)
    for (int64_t i = 0; i < n; ++i) {
      float s = 0.f;
      for (int64_t d = 0; d < dim; ++d) s += q[h * dim + d] * K::load(key[i * stride + d]);
      scores[h * scores_stride + i] = s;
    }
}

// Each of `rows` rows of `n` scores, `n` apart, becomes its softmax, in place.
inline void softmax_rows(float* scores, int64_t rows, int64_t n) {
  for (int64_t h = 0; h < rows; ++h) {
    float* s = scores + h * n;
    const float max = *std::max_element(s, s + n);
    // Apart from the sum, so that the exponentials vectorize (glibc's libmvec).
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] = std::exp(s[t] - max);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) sum += s[t];
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
  }
}

// A request's query tokens in runs of kTokensPerItem: with a long prompt's tokens spread over
// the threads, one prefill keeps every core busy. Each token's result is the same whatever run
// it falls in (its keys in order, one softmax), so the split changes no bits.
constexpr int64_t kTokensPerItem = 16;

struct TokenRun {
  int64_t req, begin, end;
};

inline std::vector<TokenRun> token_runs(const int32_t* query_start_loc, int64_t num_reqs) {
  std::vector<TokenRun> runs;
  for (int64_t req = 0; req < num_reqs; ++req)
    for (int64_t t = query_start_loc[req]; t < query_start_loc[req + 1]; t += kTokensPerItem)
      runs.push_back({req, t, std::min<int64_t>(t + kTokensPerItem, query_start_loc[req + 1])});
  return runs;
}

struct Geometry {
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  int64_t stride_q_token, stride_out_token;
  int64_t stride_block, stride_kv, stride_slot, stride_block_table;
  float scale;
  // A query sees its last `window` keys, itself included (0: all); scores are soft-capped to
  // softcap * tanh(score / softcap) before the softmax (0: not).
  int64_t window;
  float softcap;
  // An fp8 cache's keys and values are their codes times these (kernels/kv_cache.py), and are
  // stored times the reciprocals, computed by the caller: fast math would let the compiler
  // approximate a division here.
  float k_scale, v_scale, inv_k_scale, inv_v_scale;
};

// The first of a query's `num_keys` causal keys that its window lets it see.
inline int64_t first_key(int64_t num_keys, const Geometry& g) {
  return g.window > 0 ? std::max<int64_t>(0, num_keys - g.window) : 0;
}

inline void soft_cap(float* scores, int64_t n, float cap) {
  if (cap <= 0.f) return;
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; ++i) scores[i] = cap * std::tanh(scores[i] * inv);
}

template <typename K>
void attend(const typename K::T* query, const typename K::T* cache, const int32_t* block_table,
            const int32_t* query_start_loc, const int32_t* seq_lens, typename K::T* out,
            int64_t num_reqs, int num_threads, const Geometry& g) {
  using T = typename K::T;
  const int64_t group = g.num_heads / g.num_kv_heads, dim = g.head_dim;
  // Torch's thread count, passed in: the OpenMP default of the calling thread may differ.
  const std::vector<TokenRun> runs = token_runs(query_start_loc, num_reqs);
  const int64_t num_items = int64_t(runs.size()) * g.num_kv_heads;
#pragma omp parallel num_threads(num_threads)
  {
  std::vector<float> q(group * dim), acc(group * dim), scores, row(4 * dim);
#pragma omp for schedule(dynamic)
  for (int64_t item = 0; item < num_items; ++item) {
    const TokenRun& run = runs[item / g.num_kv_heads];
    const int64_t req = run.req, kv_head = item % g.num_kv_heads;
    const int32_t* table = block_table + req * g.stride_block_table;
    const int64_t q_begin = query_start_loc[req], q_end = query_start_loc[req + 1];
    const int64_t context = seq_lens[req] - (q_end - q_begin);
    for (int64_t token = run.begin; token < run.end; ++token) {
      const int64_t num_keys = context + (token - q_begin) + 1;  // causal: up to its own position
      const int64_t first = first_key(num_keys, g), seen = num_keys - first;
      scores.resize(group * seen);
      for (int64_t h = 0; h < group; ++h) {
        const T* src = query + token * g.stride_q_token + (kv_head * group + h) * dim;
        for (int64_t d = 0; d < dim; ++d) q[h * dim + d] = K::load(src[d]) * g.scale;
      }
      // Keys once each, scored against every query head of the group. Block by block: a
      // division per key would cost more than its dot products.
      for (int64_t t = first, b = first / g.block_size; t < num_keys; ++b) {
        const T* key = cache + int64_t(table[b]) * g.stride_block + kv_head * dim +
                       (t - b * g.block_size) * g.stride_slot;
        for (const int64_t end = std::min((b + 1) * g.block_size, num_keys); t < end;) {
          const int64_t n = std::min<int64_t>(4, end - t);
          // Converted once here, not once per query head.
          for (int64_t i = 0; i < n; ++i, key += g.stride_slot)
            for (int64_t d = 0; d < dim; ++d) row[i * dim + d] = K::load(key[d]);
          score_keys<F32>(q.data(), row.data(), dim, n, group, dim, &scores[t - first], seen);
          t += n;
        }
      }
      soft_cap(scores.data(), group * seen, g.softcap);
      softmax_rows(scores.data(), group, seen);
      std::fill(acc.begin(), acc.end(), 0.f);
#ifdef __AVX512F__
      // 16 columns at a time over all keys, the group's sums in registers.
      if (dim % 16 == 0 && group <= 8) {
        for (int64_t c = 0; c < dim; c += 16) {
          __m512 sums[8];
          for (int64_t h = 0; h < group; ++h) sums[h] = _mm512_setzero_ps();
          for (int64_t t = first, b = first / g.block_size; t < num_keys; ++b) {
            const T* value = cache + int64_t(table[b]) * g.stride_block + g.stride_kv +
                             kv_head * dim + c + (t - b * g.block_size) * g.stride_slot;
            for (const int64_t end = std::min((b + 1) * g.block_size, num_keys); t < end; ++t) {
              const __m512 v = K::load16(value);
              value += g.stride_slot;
              for (int64_t h = 0; h < group; ++h)
                sums[h] = _mm512_fmadd_ps(_mm512_set1_ps(scores[h * seen + t - first]), v, sums[h]);
            }
          }
          for (int64_t h = 0; h < group; ++h) _mm512_storeu_ps(&acc[h * dim + c], sums[h]);
        }
      } else
#endif
      for (int64_t t = first, b = first / g.block_size; t < num_keys; ++b) {
        const T* value = cache + int64_t(table[b]) * g.stride_block + g.stride_kv + kv_head * dim +
                         (t - b * g.block_size) * g.stride_slot;
        for (const int64_t end = std::min((b + 1) * g.block_size, num_keys); t < end; ++t) {
          for (int64_t d = 0; d < dim; ++d) row[d] = K::load(value[d]);
          value += g.stride_slot;
          for (int64_t h = 0; h < group; ++h) {
            const float p = scores[h * seen + t - first];
            float* a = &acc[h * dim];
            for (int64_t d = 0; d < dim; ++d) a[d] += p * row[d];
          }
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        T* dst = out + token * g.stride_out_token + (kv_head * group + h) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = K::store(acc[h * dim + d]);
      }
    }
  }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The bfloat16 path for head sizes that are multiples of 32, groups up to 8: keys scored in
// bf16 straight from the cache (vdpbf16ps: exact products, float32 sums), 16 keys at a time,
// and values accumulated for all of a group's heads at once.

// The sums of the 16 lanes of each of a[0..15], as one vector in key order: a transposing
// tree of 46 shuffles and adds, where 16 separate horizontal sums would take about 130.
inline __m512 sum_lanes16(const __m512* a) {
  __m512 r1[8], r2[4];
  for (int k = 0; k < 8; ++k)  // blocks: key 2k's two half-sums, then key 2k + 1's
    r1[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x44),
                          _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // block j: key 4k + j's four partial sums
    r2[k] = _mm512_add_ps(_mm512_shuffle_f32x4(r1[2 * k], r1[2 * k + 1], 0x88),
                          _mm512_shuffle_f32x4(r1[2 * k], r1[2 * k + 1], 0xDD));
  const __m512 s = _mm512_add_ps(_mm512_unpacklo_ps(r2[0], r2[1]), _mm512_unpackhi_ps(r2[0], r2[1]));
  const __m512 t = _mm512_add_ps(_mm512_unpacklo_ps(r2[2], r2[3]), _mm512_unpackhi_ps(r2[2], r2[3]));
  const __m512d sd = _mm512_castps_pd(s), td = _mm512_castps_pd(t);
  // Lane 4j + m now holds key 4m + j; the permutation is its own inverse.
  const __m512 v = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(sd, td)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(sd, td)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, v);
}

// scores[h * stride + i] = scale * q_h . key_i for the n (<= 16) keys at `key`, `key_stride`
// elements apart; q: the group's heads, bf16, `dim` apart.
inline void score16_bf16(const uint16_t* q, const uint16_t* key, int64_t key_stride, int64_t n,
                         int64_t group, int64_t dim, float scale, float* scores,
                         int64_t stride) {
  for (int64_t h = 0; h < group; ++h) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + h * dim + d);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        if (i < n)
          acc[i] = _mm512_dpbf16_ps(acc[i], qv,
                                    (__m512bh)_mm512_loadu_si512(key + i * key_stride + d));
    }
    const __m512 v = _mm512_mul_ps(sum_lanes16(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(scores + h * stride, __mmask16((1u << n) - 1), v);
  }
}

// The head's rows of a block's keys (or values) on their way to the cache while the block
// before them is worked on: blocks lie anywhere, so the hardware's stream prefetch stops at
// each block's end.
template <typename T>
inline void prefetch_block(const T* rows, const Geometry& g) {
  for (int64_t i = 0; i < g.block_size; ++i)
    for (int64_t d = 0; d < g.head_dim; d += 64 / sizeof(T))
      _mm_prefetch(reinterpret_cast<const char*>(rows + i * g.stride_slot + d), _MM_HINT_T0);
}

// acc[h * dim + c..] += sum_t p[h][t] * value_t[c..] for CH 16-column chunks from column c, all
// keys, the G heads' sums in registers. C: the cache's format (BF16, or fp8.h's, whose loads
// give value / kFactor).
template <typename C, int G, int CH>
inline void accumulate_values(const typename C::T* cache, const int32_t* table, int64_t first,
                              int64_t num_keys, const Geometry& g, int64_t kv_head, int64_t c,
                              const float* scores, float* acc) {
  const int64_t seen = num_keys - first;
  __m512 sums[G][CH];
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < CH; ++j) sums[h][j] = _mm512_setzero_ps();
  for (int64_t t = first, b = first / g.block_size; t < num_keys; ++b) {
    const typename C::T* value = cache + int64_t(table[b]) * g.stride_block + g.stride_kv +
                                 kv_head * g.head_dim + c + (t - b * g.block_size) * g.stride_slot;
    if (c == 0 && (b + 1) * g.block_size < num_keys)  // the later passes find them cached
      prefetch_block(cache + int64_t(table[b + 1]) * g.stride_block + g.stride_kv +
                         kv_head * g.head_dim,
                     g);
    for (const int64_t end = std::min((b + 1) * g.block_size, num_keys); t < end; ++t) {
      __m512 v[CH];
      for (int j = 0; j < CH; ++j) v[j] = C::load16(value + 16 * j);
      value += g.stride_slot;
      for (int h = 0; h < G; ++h) {
        const __m512 p = _mm512_set1_ps(scores[h * seen + t - first]);
        for (int j = 0; j < CH; ++j) sums[h][j] = _mm512_fmadd_ps(p, v[j], sums[h][j]);
      }
    }
  }
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < CH; ++j) _mm512_storeu_ps(acc + h * g.head_dim + c + 16 * j, sums[h][j]);
}

template <typename C, int G>
void accumulate_all_values(const typename C::T* cache, const int32_t* table, int64_t first,
                           int64_t num_keys, const Geometry& g, int64_t kv_head,
                           const float* scores, float* acc) {
  // As many columns per pass as keep the sums in registers: G * CH of 32 zmm.
  constexpr int CH = G <= 4 ? 4 : 2;
  int64_t c = 0;
  for (; c + 16 * CH <= g.head_dim; c += 16 * CH)
    accumulate_values<C, G, CH>(cache, table, first, num_keys, g, kv_head, c, scores, acc);
  for (; c < g.head_dim; c += 16)
    accumulate_values<C, G, 1>(cache, table, first, num_keys, g, kv_head, c, scores, acc);
}

// n keys of an fp8 cache, `stride` apart, as bf16 rows of `dim` in `tile`: exact (an fp8 code
// over kFactor has few enough bits), so vdpbf16ps scores them as it scores a bf16 cache.
template <typename C>
inline void keys_to_bf16(const uint8_t* key, int64_t stride, int64_t n, int64_t dim,
                         uint16_t* tile) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512 lo = C::load16(key + i * stride + d), hi = C::load16(key + i * stride + d + 16);
      _mm512_storeu_si512(tile + i * dim + d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

// C: the cache's format, BF16 or fp8.h's (whose codes load as value / kFactor: the factor and
// the layer's scales fold into the score's scale and the output's).
template <typename C>
void attend_bf16(const uint16_t* query, const typename C::T* cache, const int32_t* block_table,
                 const int32_t* query_start_loc, const int32_t* seq_lens, uint16_t* out,
                 int64_t num_reqs, int num_threads, const Geometry& g) {
  using T = typename C::T;
  constexpr bool kFp8 = !std::is_same_v<C, BF16>;
  const int64_t group = g.num_heads / g.num_kv_heads, dim = g.head_dim;
  using Accumulate = void (*)(const T*, const int32_t*, int64_t, int64_t, const Geometry&,
                              int64_t, const float*, float*);
  static constexpr Accumulate kAccumulate[8] = {
      accumulate_all_values<C, 1>, accumulate_all_values<C, 2>, accumulate_all_values<C, 3>,
      accumulate_all_values<C, 4>, accumulate_all_values<C, 5>, accumulate_all_values<C, 6>,
      accumulate_all_values<C, 7>, accumulate_all_values<C, 8>};
  const Accumulate accumulate = kAccumulate[group - 1];
  float key_scale = g.scale, out_scale = 1.f;
  if constexpr (kFp8) {
    key_scale = g.scale * g.k_scale * C::kFactor;
    out_scale = g.v_scale * C::kFactor;
  }
  const std::vector<TokenRun> runs = token_runs(query_start_loc, num_reqs);
  const int64_t num_items = int64_t(runs.size()) * g.num_kv_heads;
#pragma omp parallel num_threads(num_threads)
  {
  std::vector<uint16_t> q(group * dim), tile(kFp8 ? 16 * dim : 0);
  std::vector<float> acc(group * dim), scores;
  // A run's KV heads on one thread, one after the other: they share each slot's cache
  // lines, so the lines one head brought in serve the next.
#pragma omp for schedule(dynamic, g.num_kv_heads)
  for (int64_t item = 0; item < num_items; ++item) {
    const TokenRun& run = runs[item / g.num_kv_heads];
    const int64_t req = run.req, kv_head = item % g.num_kv_heads;
    const int32_t* table = block_table + req * g.stride_block_table;
    const int64_t q_begin = query_start_loc[req], q_end = query_start_loc[req + 1];
    const int64_t context = seq_lens[req] - (q_end - q_begin);
    for (int64_t token = run.begin; token < run.end; ++token) {
      const int64_t num_keys = context + (token - q_begin) + 1;  // causal: up to its own position
      const int64_t first = first_key(num_keys, g), seen = num_keys - first;
      // Rounded up to whole vectors: the last store of a row may write (and then ignore) lanes
      // past its keys, never into the next head's row.
      scores.resize(group * seen + 16);
      std::memcpy(q.data(), query + token * g.stride_q_token + kv_head * group * dim,
                  group * dim * sizeof(uint16_t));
      for (int64_t t = first, b = first / g.block_size; t < num_keys; ++b) {
        const T* key = cache + int64_t(table[b]) * g.stride_block + kv_head * dim +
                       (t - b * g.block_size) * g.stride_slot;
        if ((b + 1) * g.block_size < num_keys)
          prefetch_block(cache + int64_t(table[b + 1]) * g.stride_block + kv_head * dim, g);
        for (const int64_t end = std::min((b + 1) * g.block_size, num_keys); t < end;) {
          const int64_t n = std::min<int64_t>(16, end - t);
          if constexpr (kFp8) {
            keys_to_bf16<C>(key, g.stride_slot, n, dim, tile.data());
            score16_bf16(q.data(), tile.data(), dim, n, group, dim, key_scale, &scores[t - first],
                         seen);
          } else {
            score16_bf16(q.data(), key, g.stride_slot, n, group, dim, key_scale,
                         &scores[t - first], seen);
          }
          key += n * g.stride_slot;
          t += n;
        }
      }
      soft_cap(scores.data(), group * seen, g.softcap);
      softmax_rows(scores.data(), group, seen);
      accumulate(cache, table, first, num_keys, g, kv_head, scores.data(), acc.data());
      for (int64_t h = 0; h < group; ++h) {
        uint16_t* dst = out + token * g.stride_out_token + (kv_head * group + h) * dim;
        if constexpr (kFp8)
          for (int64_t d = 0; d < dim; ++d) dst[d] = BF16::store(acc[h * dim + d] * out_scale);
        else
          for (int64_t d = 0; d < dim; ++d) dst[d] = BF16::store(acc[h * dim + d]);
      }
    }
  }
  }
}
#endif

template <typename K>
void attend_any(const typename K::T* query, const typename K::T* cache, const int32_t* block_table,
                const int32_t* query_start_loc, const int32_t* seq_lens, typename K::T* out,
                int64_t num_reqs, int num_threads, const Geometry& g) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<K, BF16>) {
    if (g.head_dim % 32 == 0 && g.num_heads / g.num_kv_heads <= 8) {
      attend_bf16<BF16>(query, cache, block_table, query_start_loc, seq_lens, out, num_reqs,
                        num_threads, g);
      return;
    }
  }
#endif
  attend<K>(query, cache, block_table, query_start_loc, seq_lens, out, num_reqs, num_threads, g);
}

// A layer's attention from its q/k/v projection: rotate q and k (elementwise.h's rotary), store
// k and v at their slots (kv_cache.h's write), attend. The same bits as the three kernels, in
// one call: qkv [tokens, (num_heads + 2 num_kv_heads) head_dim], rows `stride_qkv` apart. C: the
// cache's format, K's own or (bf16 activations, AVX-512 BF16) an fp8 one.
template <typename K, typename C = K>
void rope_attend(const typename K::T* qkv, int64_t stride_qkv, const int64_t* positions,
                 const typename K::T* cos_sin, typename C::T* cache, const int64_t* slot_mapping,
                 int64_t num_tokens, int64_t block_size, const int32_t* block_table,
                 const int32_t* query_start_loc, const int32_t* seq_lens, typename K::T* out,
                 int64_t num_reqs, int num_threads, Geometry g) {
  using T = typename K::T;
  const int64_t dim = g.head_dim, q_size = g.num_heads * dim, kv_size = g.num_kv_heads * dim;
  // Reused across calls of this thread (the engine's single caller).
  thread_local std::vector<T> q, k;
  q.resize(num_tokens * q_size);
  k.resize(num_tokens * kv_size);
  pdserve::rotate<K>(positions, qkv, q.data(), cos_sin, num_tokens, g.num_heads, dim,
                     stride_qkv, dim, num_threads);
  pdserve::rotate<K>(positions, qkv + q_size, k.data(), cos_sin, num_tokens, g.num_kv_heads,
                     dim, stride_qkv, dim, num_threads);
  const pdserve::KVStrides s{kv_size, dim, stride_qkv, dim,
                             g.stride_block, g.stride_kv, g.stride_slot, dim};
  g.stride_q_token = q_size;
  if constexpr (std::is_same_v<C, K>) {
    pdserve::write_kv(k.data(), qkv + q_size + kv_size, cache, slot_mapping, num_tokens,
                      g.num_kv_heads, dim * int64_t(sizeof(T)), block_size, sizeof(T), s,
                      num_threads);
    attend_any<K>(q.data(), cache, block_table, query_start_loc, seq_lens, out, num_reqs,
                  num_threads, g);
  } else {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    pdserve::write_kv_fp8<K, C>(k.data(), qkv + q_size + kv_size, cache, slot_mapping, num_tokens,
                                g.num_kv_heads, dim, block_size, s, g.inv_k_scale, g.inv_v_scale,
                                num_threads);
    attend_bf16<C>(q.data(), cache, block_table, query_start_loc, seq_lens, out, num_reqs,
                   num_threads, g);
#endif
  }
}

}  // namespace

