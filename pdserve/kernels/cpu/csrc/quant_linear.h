// y = x W^T (+ b) on CPU with W kept in GGUF's block formats: Q4_0, Q4_1 and Q8_0, 32 weights a
// block along K with a float16 scale d (and Q4_1's float16 minimum m), and Q4_K, whose
// 256-weight super-blocks hold float16 d and dmin and, per 32-weight sub-block, 6-bit sc and m. Called on its own by
// quant_linear_cpu.cpp (pdserve/kernels/quant_linear.py packs and calls) and within a decoder
// stack by norm_linear.h and decoder_cpu.cpp.
//
// Packed once after loading: panels of 16 output features; per 32-k block of a panel, the 16
// features' float16 scales (Q4_1: then their minimums), then their quants in the order VNNI's
// vpdpbusd consumes them: lane j of a 64-byte vector holds feature j's 4 consecutive k. Q4: vector
// i of a block holds k 8i..8i+3 in the low nibbles and k 8i+4..8i+7 in the high ones. Q8_0:
// vector t holds k 4t..4t+3 as unsigned bytes, the int8 + 128.
//
// Q4_K's 32-k blocks are its sub-blocks: the header holds the 16 features' float16 d and dmin,
// then their sc and m bytes, and the kernel forms d sc and -(dmin m) (exact in float32).
//
// Every weight's value is d * u + m with u its unsigned quant: Q4_0 m = -8d, Q4_1 its minimum,
// Q8_0 m = -128d, Q4_K d sc and -(dmin m).
//
// bf16 activations (the serving path, llama.cpp's numerics): each row of x is quantized per
// 32-k block to int8 with a float32 scale s = max|x| / 127; a block's products are summed exactly
// in int32 (vpdpbusd), then y = sum over blocks, in order, of s * (d * S + m * sum(xq)) in
// float32, rounded once to the output dtype.
// float32 activations (exact): each weight dequantized as gguf dequantizes (Q4_0 d * (q - 8),
// Q4_1 d * q + m, Q8_0 q * d: one rounding each) and summed over K in order with one FMA per k:
// the bits of packed_linear.h's float32 kernel over the dequantized weights.
//
// Batch invariance: a row's quantization and sums depend on the row alone, in one fixed order;
// threads split the panels, never K.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dtypes.h"
#include "elementwise.h"
#include "packed_linear.h"

namespace {


constexpr int64_t kQK = 32;         // weights per block
constexpr int64_t kPanel = 16;      // output features per panel
enum QType : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12 };  // ggml's type ids

constexpr int64_t kSuperBlock = 256, kQ4KBytes = 144;  // Q4_K: d, dmin, scales[12], qs[128]

// A GGUF row's bytes per 32 weights (Q4_K: a super-block's share).
int64_t gguf_block_bytes(int qtype) {
  return qtype == kQ4_0 ? 18 : qtype == kQ4_1 ? 20 : qtype == kQ4_K ? kQ4KBytes / 8 : 34;
}
int64_t header_bytes(int qtype) { return qtype == kQ4_1 ? 64 : qtype == kQ4_K ? 96 : 32; }
int64_t quant_bytes(int qtype) { return qtype == kQ8_0 ? 512 : 256; }
int64_t packed_block_bytes(int qtype) { return header_bytes(qtype) + quant_bytes(qtype); }

// Q4_K's 6-bit scale and minimum of sub-block j (ggml's get_scale_min_k4).
inline void q4k_scale_min(const uint8_t* scales, int j, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = scales[j] & 63;
    m = scales[j + 4] & 63;
  } else {
    sc = uint8_t((scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4));
    m = uint8_t((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
  }
}

// Block b (32 weights) of a GGUF row: its bytes where its own format starts it, its header into
// `dst` as feature j's, and the unsigned quant of weight kk through `quant`.
inline uint8_t gguf_quant(const uint8_t* row, int qtype, int64_t b, int kk) {
  if (qtype == kQ4_K) {  // sub-block b % 8: the low nibbles of 32 bytes, then their high ones
    const uint8_t* qs = row + (b / 8) * kQ4KBytes + 16 + 32 * ((b % 8) / 2);
    return (b % 2) ? qs[kk] >> 4 : qs[kk] & 0x0F;
  }
  const uint8_t* block = row + b * gguf_block_bytes(qtype);
  if (qtype == kQ8_0) return uint8_t(int(int8_t(block[2 + kk])) + 128);
  const uint8_t* qs = block + (qtype == kQ4_1 ? 4 : 2);
  return kk < 16 ? qs[kk] & 0x0F : qs[kk - 16] >> 4;
}

inline void pack_header(const uint8_t* row, int qtype, int64_t b, int64_t j, uint8_t* dst) {
  if (qtype == kQ4_K) {
    const uint8_t* super = row + (b / 8) * kQ4KBytes;
    std::memcpy(dst + 2 * j, super, 2);       // d
    std::memcpy(dst + 32 + 2 * j, super + 2, 2);  // dmin
    q4k_scale_min(super + 4, int(b % 8), dst[64 + j], dst[80 + j]);
    return;
  }
  const uint8_t* block = row + b * gguf_block_bytes(qtype);
  std::memcpy(dst + 2 * j, block, 2);                               // d
  if (qtype == kQ4_1) std::memcpy(dst + 32 + 2 * j, block + 2, 2);  // m
}

// raw: n rows of k / 32 GGUF blocks -> ceil(n / 16) panels of k / 32 packed blocks (zero-padded
// features).
void pack(const uint8_t* raw, int qtype, int64_t n, int64_t k, uint8_t* out) {
  const int64_t nb = k / kQK, row_bytes = nb * gguf_block_bytes(qtype);
  const int64_t pb = packed_block_bytes(qtype), num_panels = (n + kPanel - 1) / kPanel;
  std::memset(out, 0, size_t(num_panels * nb * pb));
  for (int64_t f = 0; f < n; ++f) {
    const int64_t j = f % kPanel;
    const uint8_t* row = raw + f * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* dst = out + ((f / kPanel) * nb + b) * pb;
      pack_header(row, qtype, b, j, dst);
      uint8_t* q = dst + header_bytes(qtype);
      for (int kk = 0; kk < kQK; ++kk) {
        const uint8_t u = gguf_quant(row, qtype, b, kk);
        if (qtype == kQ8_0) {
          q[(kk / 4) * 64 + 4 * j + kk % 4] = u;
        } else {
          const int i = kk / 8, hi = (kk % 8) / 4, s = kk % 4;
          q[i * 64 + 4 * j + s] |= uint8_t(u << (4 * hi));
        }
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define PDSERVE_QUANT_LINEAR 1

inline __m512 load_half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 load_u8_16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// A block's scales d and offsets m (the value of quant 0) as float32 lanes: exact products
// (Q4_K's float16 times a 6-bit integer, -8d, -128d), as gguf's dequantization forms them.
inline void block_scales(const uint8_t* block, int qtype, __m512& d, __m512& m) {
  d = load_half16(block);
  if (qtype == kQ4_K) {
    const __m512 dm = _mm512_mul_ps(load_half16(block + 32), load_u8_16(block + 80));
    m = _mm512_mul_ps(dm, _mm512_set1_ps(-1.f));
    d = _mm512_mul_ps(d, load_u8_16(block + 64));
  } else if (qtype == kQ4_1) {
    m = load_half16(block + 32);
  } else {
    m = _mm512_mul_ps(d, _mm512_set1_ps(qtype == kQ4_0 ? -8.f : -128.f));
  }
}

// One row of bf16 activations -> int8 per 32-k block, its scale and its quants' sum.
void quantize_row(const uint16_t* x, int64_t k, int8_t* xq, float* scale, int32_t* sum) {
  for (int64_t b = 0; b < k / kQK; ++b) {
    const __m512 lo = pdserve::BF16::load16(x + b * kQK), hi = pdserve::BF16::load16(x + b * kQK + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float s = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(s == 0.f ? 0.f : 1.f / s);
    const __m512i qlo = _mm512_cvt_roundps_epi32(_mm512_mul_ps(lo, inv),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i qhi = _mm512_cvt_roundps_epi32(_mm512_mul_ps(hi, inv),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kQK), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kQK + 16), _mm512_cvtsepi32_epi8(qhi));
    scale[b] = s;
    sum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  }
}

// R rows of one panel, bf16 activations quantized: the rows' 16 sums into c (R x 16).
template <int R>
void dot_rows_int8(const int8_t* xq, const float* xs, const int32_t* xsum, int64_t nb,
                   const uint8_t* panel, int qtype, float* c) {
  const int64_t pb = packed_block_bytes(qtype), hb = header_bytes(qtype);
  const int64_t k = nb * kQK;
  __m512 total[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = panel + b * pb;
    const uint8_t* q = block + hb;
    __m512i acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    if (qtype == kQ8_0) {
      for (int t = 0; t < 8; ++t) {
        const __m512i w = _mm512_loadu_si512(q + t * 64);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, xq + r * k + b * kQK + 4 * t, 4);
          acc[r] = _mm512_dpbusd_epi32(acc[r], w, _mm512_set1_epi32(four));
        }
      }
    } else {
      for (int i = 0; i < 4; ++i) {
        const __m512i w = _mm512_loadu_si512(q + i * 64);
        const __m512i lo = _mm512_and_si512(w, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t four_lo, four_hi;
          std::memcpy(&four_lo, xq + r * k + b * kQK + 8 * i, 4);
          std::memcpy(&four_hi, xq + r * k + b * kQK + 8 * i + 4, 4);
          acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(four_lo));
          acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(four_hi));
        }
      }
    }
    __m512 d, m;
    block_scales(block, qtype, d, m);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 offset = _mm512_mul_ps(m, _mm512_set1_ps(float(xsum[r * nb + b])));
      const __m512 sums = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(acc[r]), offset);
      total[r] = _mm512_fmadd_ps(sums, _mm512_set1_ps(xs[r * nb + b]), total[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(c + r * kPanel, total[r]);
}

constexpr int kQuantRegRows = 8;

// Up to kQuantRegRows rows, float32 activations: each weight dequantized as gguf does, then one FMA
// per k in order.
template <int R>
void dot_rows_exact(const float* x, int64_t stride_x, int64_t nb, const uint8_t* panel, int qtype,
                    float* c) {
  const int64_t pb = packed_block_bytes(qtype), hb = header_bytes(qtype);
  const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = panel + b * pb;
    const uint8_t* q = block + hb;
    __m512 d, m;
    block_scales(block, qtype, d, m);
    for (int kk = 0; kk < kQK; ++kk) {
      __m512i u;
      if (qtype == kQ8_0)
        u = _mm512_and_si512(_mm512_srli_epi32(_mm512_loadu_si512(q + (kk / 4) * 64), 8 * (kk % 4)),
                             _mm512_set1_epi32(0xFF));
      else
        u = _mm512_and_si512(
            _mm512_srli_epi32(_mm512_loadu_si512(q + (kk / 8) * 64), 8 * (kk % 4) + 4 * ((kk % 8) / 4)),
            _mm512_set1_epi32(0x0F));
      // The _round_ forms are never contracted into FMAs: one rounding each, as numpy's.
      __m512 w;
      if (qtype == kQ4_0)
        w = _mm512_mul_round_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(8))),
                                round);
      else if (qtype == kQ4_1 || qtype == kQ4_K)  // Q4_K: d sc u - dmin m
        w = _mm512_add_round_ps(_mm512_mul_round_ps(d, _mm512_cvtepi32_ps(u), round), m, round);
      else
        w = _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(128))),
                                d, round);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * stride_x + b * kQK + kk]), w, acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(c + r * kPanel, acc[r]);
}

template <typename Fn>
inline void by_register_rows(int rows, Fn&& fn) {
  // fn(std::integral_constant<int, R>, r0) for blocks of up to kQuantRegRows rows.
  for (int r0 = 0; r0 < rows; r0 += kQuantRegRows) {
    switch (rows - r0 < kQuantRegRows ? rows - r0 : kQuantRegRows) {
      case 1: fn(std::integral_constant<int, 1>(), r0); break;
      case 2: fn(std::integral_constant<int, 2>(), r0); break;
      case 3: fn(std::integral_constant<int, 3>(), r0); break;
      case 4: fn(std::integral_constant<int, 4>(), r0); break;
      case 5: fn(std::integral_constant<int, 5>(), r0); break;
      case 6: fn(std::integral_constant<int, 6>(), r0); break;
      case 7: fn(std::integral_constant<int, 7>(), r0); break;
      default: fn(std::integral_constant<int, 8>(), r0); break;
    }
  }
}

// Rows per sweep over the panels: their quantized activations stay in L2.
constexpr int64_t kQuantChunkM = 64;

// O: the output's dtype, T's or float32 (logits).
template <typename T, typename O>
void quant_linear(const T* x, int64_t m, int64_t k, int64_t stride_x, const uint8_t* packed,
                  int qtype, int64_t n, const T* bias, O* out, int64_t stride_out,
                  int num_threads) {
  const int64_t nb = k / kQK, num_panels = (n + kPanel - 1) / kPanel;
  const int64_t panel_bytes = nb * packed_block_bytes(qtype);
  std::vector<int8_t> xq;
  std::vector<float> xs;
  std::vector<int32_t> xsum;
  if constexpr (std::is_same_v<T, uint16_t>) {
    xq.resize(size_t(m * k));
    xs.resize(size_t(m * nb));
    xsum.resize(size_t(m * nb));
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < m; ++r)
      quantize_row(x + r * stride_x, k, xq.data() + r * k, xs.data() + r * nb,
                   xsum.data() + r * nb);
  }
#pragma omp parallel num_threads(num_threads)
  {
    alignas(64) float c[kQuantRegRows * kPanel];
    for (int64_t chunk = 0; chunk < m; chunk += kQuantChunkM) {
      const int rows_in_chunk = int(chunk + kQuantChunkM < m ? kQuantChunkM : m - chunk);
#pragma omp for schedule(static)
      for (int64_t p = 0; p < num_panels; ++p) {
        const uint8_t* panel = packed + p * panel_bytes;
        by_register_rows(rows_in_chunk, [&](auto rows, int r0) {
          constexpr int R = decltype(rows)::value;
          const int64_t row = chunk + r0;
          if constexpr (std::is_same_v<T, uint16_t>)
            dot_rows_int8<R>(xq.data() + row * k, xs.data() + row * nb, xsum.data() + row * nb,
                             nb, panel, qtype, c);
          else
            dot_rows_exact<R>(x + row * stride_x, stride_x, nb, panel, qtype, c);
          store16_rows(c, kPanel, R, p * kPanel, n, bias, out + row * stride_out, stride_out);
        });
      }
    }
  }
}
#endif

}  // namespace

