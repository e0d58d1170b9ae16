// y = x W^T (+ b) on CPU, the weight packed once after loading: bfloat16 on AMX tiles where the
// CPU has them, else with AVX512-BF16 dot products; float32 with AVX-512 FMAs; plain loops on a
// CPU without AVX-512.
//
// Batch invariance: every output element is summed over K in one fixed order (32 k at a time,
// in order, in float32) and rounded once, whatever the number of rows, the row's position or the
// thread count. Threads split the output features, never K; no path is chosen by the number of
// rows. So a request's results do not depend on what else is in its batch (oneDNN's and MKL's
// kernels change their summation order with M).
//
// Decode steps are bound by reading each weight once: the weight is packed in the order the
// kernel consumes it (one contiguous panel per 32 output features, each thread streaming its own
// run of panels), and the next panel is prefetched into L2 while the current one computes.
//
// Shared by linear_cpu.cpp (each call on its own), norm_linear.h (a norm and the matmuls after
// it) and decoder_cpu.cpp (a whole decoder stack).
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dtypes.h"
#include "elementwise.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PDSERVE_AVX512_BF16 1
#endif
#if defined(PDSERVE_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PDSERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using pdserve::BF16;
using pdserve::F32;

constexpr int64_t kBlockN = 32;  // output features per panel
constexpr int64_t kBlockK = 32;  // bf16: k values per block (an AMX tile row, 16 pairs)
constexpr int64_t kHalf = 16 * kBlockK;  // bf16 values of one 16-feature half of a k block
constexpr int kMaxRows = 32;     // rows per pass over a panel (AMX: two A tiles of 16)
// Rows per sweep over the panels: their activations stay in L2 while every panel streams past.
constexpr int64_t kChunkM = 128;

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// bf16: w [n, k] row-major -> round_up(n, 32) x round_up(k, 32) values: panels of 32 features;
// in each, per 32-k block, two 16-feature halves whose row r holds, for each of the 16
// features, the k pair (2r, 2r + 1): AMX's B tile, and the operand of vdpbf16ps. Padding is 0.
inline void pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* out) {
  const int64_t kp = round_up(k, kBlockK), np = round_up(n, kBlockN);
  std::memset(out, 0, sizeof(uint16_t) * np * kp);
  for (int64_t f = 0; f < n; ++f) {
    const int64_t panel = f / kBlockN, half = (f % kBlockN) / 16, col = f % 16;
    for (int64_t kk = 0; kk < k; ++kk) {
      const int64_t kb = kk / kBlockK, pair = (kk % kBlockK) / 2, lane = kk % 2;
      uint16_t* t = out + panel * kBlockN * kp + (kb * 2 + half) * kHalf;
      t[pair * kBlockK + col * 2 + lane] = w[f * k + kk];
    }
  }
}

// float32: w [n, k] -> round_up(n, 32) x k values: panels of 32 features, row kk of a panel the
// 32 features' weights at kk. Padding is 0.
inline void pack_f32(const float* w, int64_t n, int64_t k, float* out) {
  std::memset(out, 0, sizeof(float) * round_up(n, kBlockN) * k);
  for (int64_t f = 0; f < n; ++f)
    for (int64_t kk = 0; kk < k; ++kk)
      out[(f / kBlockN) * kBlockN * k + kk * kBlockN + f % kBlockN] = w[f * k + kk];
}

// The weight of feature j (< 32) at kk in a packed panel, for the plain loops.
inline float packed_at(const uint16_t* panel, int64_t kk, int64_t j) {
  return BF16::load(panel[(kk / kBlockK * 2 + j / 16) * kHalf + (kk % kBlockK) / 2 * kBlockK +
                          (j % 16) * 2 + kk % 2]);
}
inline float packed_at(const float* panel, int64_t kk, int64_t j) {
  return panel[kk * kBlockN + j];
}

// Plain loops (a CPU without AVX-512): c[r * 32 + j] = sum over k in order.
template <typename K>
void dot_rows_plain(const typename K::T* a, int64_t stride_a, int rows, int64_t k,
                    const typename K::T* panel, float* c) {
  for (int r = 0; r < rows; ++r) {
    float s[kBlockN] = {};
    for (int64_t kk = 0; kk < k; ++kk) {
      const float x = K::load(a[r * stride_a + kk]);
      for (int64_t j = 0; j < kBlockN; ++j) s[j] += x * packed_at(panel, kk, j);
    }
    std::memcpy(c + r * kBlockN, s, sizeof(s));
  }
}

// The next panel into L2, 2 KB per call (what one 32-k block of a bf16 panel reads).
inline void prefetch_next(const char* next, int64_t step, int64_t next_bytes) {
#ifdef __AVX512F__
  for (int64_t off = step * 2048; off < (step + 1) * 2048 && off < next_bytes; off += 64)
    _mm_prefetch(next + off, _MM_HINT_T1);
#endif
}

#ifdef __AVX512F__
// R rows' sums, 32 features (two vectors) each, zeroed and then stored into c. Every loop over
// the rows is unrolled (here and in the kernels), so that GCC keeps the sums in registers: else
// it stores the array back to the stack at each step, halving the kernels' speed.
template <int R>
__attribute__((always_inline)) inline void zero_sums(__m512 (&acc)[R][2]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
}

template <int R>
__attribute__((always_inline)) inline void store_sums(const __m512 (&acc)[R][2], float* c) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * kBlockN, acc[r][0]);
    _mm512_storeu_ps(c + r * kBlockN + 16, acc[r][1]);
  }
}
#endif

#ifdef PDSERVE_AVX512_BF16
// R rows of one bf16 panel with vdpbf16ps: per k pair, lane j += x0 * w0[j] + x1 * w1[j].
template <int R>
void dot_rows_bf16(const uint16_t* a, int64_t stride_a, int64_t num_kb, const uint16_t* panel,
                   const char* next, int64_t next_bytes, float* c) {
  __m512 acc[R][2];
  zero_sums<R>(acc);
  for (int64_t kb = 0; kb < num_kb; ++kb) {
    prefetch_next(next, kb, next_bytes);
    const uint16_t* b = panel + kb * 2 * kHalf;
    const uint16_t* x = a + kb * kBlockK;
    for (int p = 0; p < 16; ++p) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * kBlockK);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + kHalf + p * kBlockK);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * stride_a + 2 * p, 4);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, b1);
      }
    }
  }
  store_sums<R>(acc, c);
}
#endif

#ifdef __AVX512F__
template <int R>
void dot_rows_f32(const float* a, int64_t stride_a, int64_t k, const float* panel,
                  const char* next, int64_t next_bytes, float* c) {
  __m512 acc[R][2];
  zero_sums<R>(acc);
  for (int64_t kk = 0; kk < k; ++kk) {
    if (kk % 16 == 0) prefetch_next(next, kk / 16, next_bytes);
    const __m512 b0 = _mm512_loadu_ps(panel + kk * kBlockN);
    const __m512 b1 = _mm512_loadu_ps(panel + kk * kBlockN + 16);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(a[r * stride_a + kk]);
      acc[r][0] = _mm512_fmadd_ps(xv, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, b1, acc[r][1]);
    }
  }
  store_sums<R>(acc, c);
}
#endif

// Rows per register block of the AVX-512 kernels: 2 accumulators a row, 2 weights, 1 input.
constexpr int kRegRows = 12;

// Up to kMaxRows rows of a panel into c, in register blocks of kRegRows: each row's sums are the
// same whatever block it falls in (the blocks differ only in how many rows share a weight load).
template <typename K>
void dot_panel(const typename K::T* a, int64_t stride_a, int rows, int64_t k,
               const typename K::T* panel, const char* next, int64_t next_bytes, float* c) {
#ifdef __AVX512F__
  using Fn = void (*)(const typename K::T*, int64_t, int64_t, const typename K::T*, const char*,
                      int64_t, float*);
  Fn const* table = nullptr;
  int64_t steps = 0;
  if constexpr (std::is_same_v<K, F32>) {
    static constexpr Fn kF32[kRegRows + 1] = {
        nullptr,          dot_rows_f32<1>, dot_rows_f32<2>,  dot_rows_f32<3>, dot_rows_f32<4>,
        dot_rows_f32<5>,  dot_rows_f32<6>, dot_rows_f32<7>,  dot_rows_f32<8>, dot_rows_f32<9>,
        dot_rows_f32<10>, dot_rows_f32<11>, dot_rows_f32<12>};
    table = kF32, steps = k;
  }
#ifdef PDSERVE_AVX512_BF16
  if constexpr (std::is_same_v<K, BF16>) {
    static constexpr Fn kBF16[kRegRows + 1] = {
        nullptr,           dot_rows_bf16<1>, dot_rows_bf16<2>,  dot_rows_bf16<3>,
        dot_rows_bf16<4>,  dot_rows_bf16<5>, dot_rows_bf16<6>,  dot_rows_bf16<7>,
        dot_rows_bf16<8>,  dot_rows_bf16<9>, dot_rows_bf16<10>, dot_rows_bf16<11>,
        dot_rows_bf16<12>};
    table = kBF16, steps = k / kBlockK;
  }
#endif
  if (table != nullptr) {
    for (int r0 = 0; r0 < rows; r0 += kRegRows) {
      const int n = rows - r0 < kRegRows ? rows - r0 : kRegRows;
      // Only the first block streams the panel from memory: it prefetches the next one.
      table[n](a + r0 * stride_a, stride_a, steps, panel, next, r0 == 0 ? next_bytes : 0,
               c + r0 * kBlockN);
    }
    return;
  }
#endif
  (void)next, (void)next_bytes;
  dot_rows_plain<K>(a, stride_a, rows, k, panel, c);
}

#ifdef PDSERVE_AMX
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 accumulate C (2 x 2 of 16 x 16 float), 4-5 hold A (16 rows x 32 k), 6-7 hold B
// (16 k pairs x 16 features x 2, the VNNI layout). `rows` < 32 configures a pass over a
// batch's last rows, so that no tile reads past the activations.
inline void configure_tiles(int rows) {
  TileConfig cfg;
  const int top = rows < 16 ? rows : 16;
  const int bottom = rows > 16 ? rows - 16 : 16;
  const int tile_rows[8] = {top, top, bottom, bottom, top, bottom, 16, 16};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = uint8_t(tile_rows[t]);
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Up to 32 rows of one bf16 panel on tiles: 2 x 2 tiles over K, into c (32 x 32 float).
inline void dot_panel_amx(const uint16_t* a, int64_t stride_a, int rows, int64_t num_kb,
                          const uint16_t* panel, const char* next, int64_t next_bytes, float* c) {
  const bool two = rows > 16;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t stride_bytes = stride_a * int64_t(sizeof(uint16_t));
  for (int64_t kb = 0; kb < num_kb; ++kb) {
    prefetch_next(next, kb, next_bytes);
    _tile_loadd(4, a + kb * kBlockK, stride_bytes);
    _tile_loadd(6, panel + (kb * 2) * kHalf, 64);
    _tile_loadd(7, panel + (kb * 2 + 1) * kHalf, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a + 16 * stride_a + kb * kBlockK, stride_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t ldc = kBlockN * sizeof(float);
  _tile_stored(0, c, ldc);
  _tile_stored(1, c + 16, ldc);
  if (two) {
    _tile_stored(2, c + 16 * kBlockN, ldc);
    _tile_stored(3, c + 16 * kBlockN + 16, ldc);
  }
}
#endif

// Whether bf16 runs on AMX tiles: built for them, and Linux granted this process their state
// (it hands it out only on request). Asked once per library.
inline bool amx_ready() {
#ifdef PDSERVE_AMX
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  static const bool ready = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ready;
#else
  return false;
#endif
}

#ifdef PDSERVE_AVX512_BF16
// Rows of 16 sums (c's rows `ldc` apart) + bias into out's features [f, min(f + 16, n)),
// rounded once to O. Shared with quant_linear.h.
template <typename T, typename O>
void store16_rows(const float* c, int64_t ldc, int rows, int64_t f, int64_t n, const T* bias,
                  O* out, int64_t stride_out) {
  const __mmask16 mask = pdserve::lanes(f, n);
  __m512 b = _mm512_setzero_ps();
  if (bias != nullptr) {
    if constexpr (std::is_same_v<T, float>)
      b = _mm512_maskz_loadu_ps(mask, bias + f);
    else
      b = BF16::load16(bias + f, mask);
  }
  for (int r = 0; r < rows; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + r * ldc), b);
    if constexpr (std::is_same_v<O, float>)
      _mm512_mask_storeu_ps(out + r * stride_out + f, mask, v);
    else
      BF16::store16(out + r * stride_out + f, v, mask);
  }
}
#endif

// Rows r of c (+ bias) into out's rows, features [f0, min(f0 + 32, n)): rounded once to O.
template <typename T, typename O>
void store_rows(const float* c, int rows, int64_t f0, int64_t n, const T* bias, O* out,
                int64_t stride_out) {
  using KB = std::conditional_t<std::is_same_v<T, float>, F32, BF16>;
  using KO = std::conditional_t<std::is_same_v<O, float>, F32, BF16>;
  const int64_t width = n - f0 < kBlockN ? n - f0 : kBlockN;
#ifdef PDSERVE_AVX512_BF16
  for (int half = 0; half < 2 && half * 16 < width; ++half)
    store16_rows(c + half * 16, kBlockN, rows, f0 + half * 16, n, bias, out, stride_out);
  return;
#endif
  for (int r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j)
      out[r * stride_out + f0 + j] =
          KO::store(c[r * kBlockN + j] + (bias ? KB::load(bias[f0 + j]) : 0.f));
}

// out[m, n] = x[m, :k] . W[n, :k] + bias[n], x's rows `stride_x` apart. T: the activations' and
// weight's dtype (uint16_t = bf16, or float); O: the output's (T, or float for logits). For
// bf16, `k` is a multiple of 32 (the caller pads x where the model's is not).
template <typename T, typename O>
void packed_linear(const T* x, int64_t m, int64_t k, int64_t stride_x, const T* packed,
                   int64_t n, const T* bias, O* out, int64_t stride_out, int num_threads) {
  using K = std::conditional_t<std::is_same_v<T, float>, F32, BF16>;
  const int64_t num_panels = round_up(n, kBlockN) / kBlockN;
  const int64_t panel_size = kBlockN * k;
  const int64_t panel_bytes = panel_size * int64_t(sizeof(T));
  const bool amx = std::is_same_v<K, BF16> && amx_ready();
  (void)amx;
#pragma omp parallel num_threads(num_threads)
  {
    alignas(64) float c[kMaxRows * kBlockN];
    for (int64_t chunk = 0; chunk < m; chunk += kChunkM) {
      const int64_t chunk_end = chunk + kChunkM < m ? chunk + kChunkM : m;
#ifdef PDSERVE_AMX
      int configured = -1;
#endif
#pragma omp for schedule(static)
      for (int64_t p = 0; p < num_panels; ++p) {
        const T* panel = packed + p * panel_size;
        const char* next = reinterpret_cast<const char*>(panel + panel_size);
        const int64_t next_bytes = p + 1 < num_panels ? panel_bytes : 0;
        for (int64_t m0 = chunk; m0 < chunk_end; m0 += kMaxRows) {
          const int rows = int(chunk_end - m0 < kMaxRows ? chunk_end - m0 : kMaxRows);
          // Prefetch while the panel is read from memory, its first pass.
          const int64_t prefetch = m0 == chunk ? next_bytes : 0;
#ifdef PDSERVE_AMX
          if constexpr (std::is_same_v<K, BF16>) {
            if (amx) {
              if (rows != configured) configure_tiles(configured = rows);
              dot_panel_amx(x + m0 * stride_x, stride_x, rows, k / kBlockK, panel, next,
                            prefetch, c);
              store_rows(c, rows, p * kBlockN, n, bias, out + m0 * stride_out, stride_out);
              continue;
            }
          }
#endif
          dot_panel<K>(x + m0 * stride_x, stride_x, rows, k, panel, next, prefetch, c);
          store_rows(c, rows, p * kBlockN, n, bias, out + m0 * stride_out, stride_out);
        }
      }
    }
#ifdef PDSERVE_AMX
    if (amx) _tile_release();
#endif
  }
}

}  // namespace
