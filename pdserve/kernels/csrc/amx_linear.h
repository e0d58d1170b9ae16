// y = x W^T (+ b) in bfloat16 on AMX tiles, for decode-sized batches. A decode step's matmuls are
// bound by reading each weight once, and oneDNN's kernels read them at about half the memory
// bandwidth here: the weight is packed in the order the tiles consume it (one contiguous panel
// per 32 output features, each thread streaming its own run of panels), and the next panel is
// prefetched into L2 while the current one computes.
//
// Accumulation is float32 over K in order, 32 at a time, with one rounding to nearest even at
// the end (bias added before it).
// Shared by linear_cpu.cpp (each call on its own) and decoder_cpu.cpp (a whole decoder stack).
// PDSERVE_AMX is defined where the compiler targets AMX.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PDSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "dtypes.h"
#include "elementwise.h"

namespace {

using pdserve::BF16;
using T = BF16::T;
using pdserve::lanes;

constexpr int kTileRows = 16;  // rows of an A or C tile
constexpr int kBlockK = 32;    // bf16 values in a 64-byte tile row
constexpr int kBlockN = 32;    // output features per panel: two B tiles of 16
constexpr int kBlockM = 32;    // rows per pass: two A tiles of 16
// Rows per sweep over the panels: their activations stay in L2 while every panel streams past.
constexpr int64_t kChunkM = 128;
constexpr int64_t kPanelTile = kTileRows * kBlockK;  // bf16 values in one B tile

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
void configure_tiles(int rows) {
  TileConfig cfg;
  const int top = rows < kTileRows ? rows : kTileRows;
  const int bottom = rows > kTileRows ? rows - kTileRows : kTileRows;
  const int tile_rows[8] = {top, top, bottom, bottom, top, bottom, kTileRows, kTileRows};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = uint8_t(tile_rows[t]);
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// The rows [m0, m0 + rows) of one panel: 2 x 2 tiles over K, then bias and rounding.
void panel_pass(const T* x, int64_t m0, int rows, int64_t num_kb, int64_t stride_x,
                const T* panel, const char* next, int64_t next_bytes, int64_t f0, int64_t n,
                const T* bias, T* out, int64_t stride_out, float* c) {
  const bool two = rows > kTileRows;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const T* a = x + m0 * stride_x;
  const int64_t stride_bytes = stride_x * int64_t(sizeof(T));
  for (int64_t kb = 0; kb < num_kb; ++kb) {
    // The next panel into L2, 2 KB (what this step reads of its own panel) per step.
    for (int64_t off = kb * 2048; off < (kb + 1) * 2048 && off < next_bytes; off += 64)
      _mm_prefetch(next + off, _MM_HINT_T1);
    _tile_loadd(4, a + kb * kBlockK, stride_bytes);
    _tile_loadd(6, panel + (kb * 2) * kPanelTile, 64);
    _tile_loadd(7, panel + (kb * 2 + 1) * kPanelTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a + kTileRows * stride_x + kb * kBlockK, stride_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t ldc = kBlockN * sizeof(float);
  _tile_stored(0, c, ldc);
  _tile_stored(1, c + 16, ldc);
  if (two) {
    _tile_stored(2, c + kTileRows * kBlockN, ldc);
    _tile_stored(3, c + kTileRows * kBlockN + 16, ldc);
  }
  for (int half = 0; half < 2; ++half) {
    const int64_t f = f0 + half * 16;
    if (f >= n) break;
    const __mmask16 mask = lanes(f, n);
    const __m512 b = bias ? BF16::load16(bias + f, mask) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r) {
      const __m512 v = _mm512_add_ps(_mm512_load_ps(c + r * kBlockN + half * 16), b);
      BF16::store16(out + (m0 + r) * stride_out + f, v, mask);
    }
  }
}

// 0 once Linux has granted this process AMX's tile state (it hands it out only on request).
inline int amx_enable() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return int(syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata));
}

// w [n, k] row-major -> round_up(n, 32) x round_up(k, 32) values: panels of 32 features; in
// each, per 32-k block, two B tiles whose row r holds, for each of 16 features, the k pair
// (2r, 2r + 1). Padding is zero.
inline void amx_pack(const T* w, int64_t n, int64_t k, T* out) {
  const int64_t kp = round_up(k, kBlockK), np = round_up(n, kBlockN);
  std::memset(out, 0, sizeof(T) * np * kp);
  for (int64_t f = 0; f < n; ++f) {
    const int64_t panel = f / kBlockN, tile = (f % kBlockN) / 16, col = f % 16;
    for (int64_t kk = 0; kk < k; ++kk) {
      const int64_t kb = kk / kBlockK, pair = (kk % kBlockK) / 2, lane = kk % 2;
      T* t = out + panel * kBlockN * kp + (kb * 2 + tile) * kPanelTile;
      t[pair * kBlockK + col * 2 + lane] = w[f * k + kk];
    }
  }
}

// out[m, n] = x[m, :k] . W[n, :k] + bias[n], x's rows `stride_x` apart. `k` is a multiple of 32
// (the caller pads x where the model's is not).
inline void amx_linear(const T* x, int64_t m, int64_t k, int64_t stride_x, const T* packed,
                       int64_t n, const T* bias, T* out, int64_t stride_out, int num_threads) {
  const int64_t num_panels = round_up(n, kBlockN) / kBlockN;
  const int64_t num_kb = k / kBlockK;
  const int64_t panel_size = kBlockN * k;
  const int64_t panel_bytes = panel_size * int64_t(sizeof(T));
#pragma omp parallel num_threads(num_threads)
  {
    alignas(64) float c[kBlockM * kBlockN];
    for (int64_t chunk = 0; chunk < m; chunk += kChunkM) {
      const int64_t chunk_end = chunk + kChunkM < m ? chunk + kChunkM : m;
      int configured = -1;
#pragma omp for schedule(static)
      for (int64_t p = 0; p < num_panels; ++p) {
        const T* panel = packed + p * panel_size;
        const char* next = reinterpret_cast<const char*>(panel + panel_size);
        for (int64_t m0 = chunk; m0 < chunk_end; m0 += kBlockM) {
          const int rows = int(chunk_end - m0 < kBlockM ? chunk_end - m0 : kBlockM);
          if (rows != configured) configure_tiles(configured = rows);
          // Prefetch while the panel is read from memory, its first pass.
          panel_pass(x, m0, rows, num_kb, stride_x, panel, next,
                     m0 == chunk && p + 1 < num_panels ? panel_bytes : 0, p * kBlockN, n, bias,
                     out, stride_out, c);
        }
      }
    }
    _tile_release();
  }
}


// An RMSNorm (with the residual add before it where `residual` is not null) and the matmul of
// its output, in one call: each step the same code as its own kernel, so the same bits.
// `residual_out` (unused without a residual) is [m, hidden], `out` [m, n].
inline void amx_norm_linear(const T* x, const T* residual, int64_t stride_x,
                            int64_t stride_residual, const T* norm_weight, float eps, int64_t m,
                            int64_t hidden, const T* packed, int64_t n, const T* bias,
                            T* residual_out, T* out, int num_threads) {
  // Reused across calls of this thread (the engine's single caller).
  thread_local std::vector<T> normed;
  normed.resize(m * hidden);
  pdserve::rms_norm_bf16(x, residual, norm_weight, normed.data(), residual_out, m, hidden,
                         stride_x, stride_residual, eps, num_threads);
  amx_linear(normed.data(), m, hidden, hidden, packed, n, bias, out, n, num_threads);
}

// A decoder layer's second half: the post-attention norm, gate_up, SiLU-and-mul and down.
// `residual_out` and `out` are [m, hidden]; biases may be null.
inline void amx_norm_mlp(const T* x, const T* residual, int64_t stride_x, int64_t stride_residual,
                         const T* norm_weight, float eps, int64_t m, int64_t hidden,
                         const T* gate_up, const T* gate_up_bias, int64_t intermediate,
                         const T* down, const T* down_bias, T* residual_out, T* out,
                         int num_threads) {
  thread_local std::vector<T> projected, activated;
  projected.resize(m * 2 * intermediate);
  activated.resize(m * intermediate);
  amx_norm_linear(x, residual, stride_x, stride_residual, norm_weight, eps, m, hidden,
                          gate_up, 2 * intermediate, gate_up_bias, residual_out, projected.data(),
                          num_threads);
  pdserve::silu_and_mul_bf16(projected.data(), activated.data(), m, intermediate,
                             2 * intermediate, num_threads);
  amx_linear(activated.data(), m, intermediate, intermediate, down, hidden, down_bias, out,
                     hidden, num_threads);
}

}  // extern "C"

#else

extern "C" inline int amx_enable() { return -1; }

#endif
