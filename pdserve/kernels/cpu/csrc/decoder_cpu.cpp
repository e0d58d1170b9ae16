// A Llama decoder stack's decode step in one call: per layer the input norm and q/k/v, rotary +
// cache write + attention, o_proj, and the post-attention norm and gated MLP, each the same
// code as its own kernel (packed_linear.h, paged_attention.h), so the bits are the per-layer
// path's. In the engine the Python around each kernel call costs more than the kernel (the
// weights streaming past evict the interpreter's state); this leaves one call per step.
// Built and loaded by pdserve/kernels/cpu/native.py; without AVX512-BF16 nothing but
// pdserve_decoder_layers_available is built.
#include <cstdint>
#include <cstring>
#include <vector>

#include "norm_linear.h"
#include "packed_linear.h"
#include "paged_attention.h"

#ifdef PDSERVE_AVX512_BF16
namespace {

// One layer's weights (packed by packed_linear.h, or in GGUF blocks by quant_linear.h: each
// projection's type, 0 for bf16; biases and the cache view as the model holds them).
struct LayerWeights {
  const T* input_norm;
  const void* qkv;
  const T* qkv_bias;
  const void* o;
  const T* o_bias;
  const T* post_norm;
  const void* gate_up;
  const T* gate_up_bias;
  const void* down;
  const T* down_bias;
  int64_t qkv_type, o_type, gate_up_type, down_type;
};

struct StackShape {
  int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim;
  float eps, scale;
};

// rope_attend over a cache of the layer's format and scales.
void attend_layer(int cache_format, const float* kv_scale, const T* qkv, int64_t stride_qkv,
                  const int64_t* positions, const T* cos_sin, void* cache,
                  const int64_t* slot_mapping, int64_t m, const int32_t* block_table,
                  const int32_t* query_start_loc, const int32_t* seq_lens, T* out,
                  int64_t num_reqs, int num_threads, Geometry g) {
  if (cache_format == 0) {
    rope_attend<BF16>(qkv, stride_qkv, positions, cos_sin, static_cast<T*>(cache), slot_mapping,
                      m, g.block_size, block_table, query_start_loc, seq_lens, out, num_reqs,
                      num_threads, g);
    return;
  }
  g.k_scale = kv_scale[0];
  g.v_scale = kv_scale[1];
  g.inv_k_scale = kv_scale[2];
  g.inv_v_scale = kv_scale[3];
  auto* codes = static_cast<uint8_t*>(cache);
  if (cache_format == 1)
    rope_attend<BF16, pdserve::E4M3>(qkv, stride_qkv, positions, cos_sin, codes, slot_mapping, m,
                                     g.block_size, block_table, query_start_loc, seq_lens, out,
                                     num_reqs, num_threads, g);
  else
    rope_attend<BF16, pdserve::E5M2>(qkv, stride_qkv, positions, cos_sin, codes, slot_mapping, m,
                                     g.block_size, block_table, query_start_loc, seq_lens, out,
                                     num_reqs, num_threads, g);
}

}  // namespace

extern "C" {

int pdserve_decoder_layers_available() { return 1; }

// hidden [m, hidden] in; residual null on the first stage (the first norm adds nothing). Out:
// them). `caches[l]` is layer l's view, all with the strides of `g` (its stride_q_token unused),
// holding bf16 or (cache_format 1 e4m3, 2 e5m2) fp8 codes with layer l's k_scale, v_scale and
// their reciprocals at kv_scales[4 l..].
void pdserve_decoder_layers(const LayerWeights* layers, void* const* caches, int cache_format,
                            const float* kv_scales, int64_t num_layers,
                            const StackShape* s, const Geometry* g, const T* hidden,
                            const T* residual, int64_t m, const int64_t* positions,
                            const T* cos_sin, const int64_t* slot_mapping,
                            const int32_t* block_table, const int32_t* query_start_loc,
                            const int32_t* seq_lens, int64_t num_reqs, T* hidden_out,
                            T* residual_out, int num_threads) {
  const int64_t d = s->hidden, q_size = s->num_heads * s->head_dim;
  const int64_t qkv_size = q_size + 2 * s->num_kv_heads * s->head_dim;
  thread_local std::vector<T> qkv, attended, projected, stream, out;
  qkv.resize(m * qkv_size);
  attended.resize(m * q_size);
  projected.resize(m * d);
  stream.resize(m * d);  // the residual stream, updated in place by each norm
  out.resize(m * d);
  const T* x = hidden;
  if (residual != nullptr) std::memcpy(stream.data(), residual, m * d * sizeof(T));
  for (int64_t l = 0; l < num_layers; ++l) {
    const LayerWeights& w = layers[l];
    if (l == 0 && residual == nullptr) {
      std::memcpy(stream.data(), x, m * d * sizeof(T));
      norm_linear(x, nullptr, d, 0, w.input_norm, s->eps, m, d, w.qkv, qkv_size, w.qkv_bias,
                  nullptr, qkv.data(), num_threads, int(w.qkv_type));
    } else {
      norm_linear(x, stream.data(), d, d, w.input_norm, s->eps, m, d, w.qkv, qkv_size,
                  w.qkv_bias, stream.data(), qkv.data(), num_threads, int(w.qkv_type));
    }
    attend_layer(cache_format, kv_scales + 4 * l, qkv.data(), qkv_size, positions, cos_sin,
                 caches[l], slot_mapping, m, block_table, query_start_loc, seq_lens,
                 attended.data(), num_reqs, num_threads, *g);
    project(attended.data(), m, q_size, q_size, w.o, int(w.o_type), d, w.o_bias,
            projected.data(), d, num_threads);
    norm_mlp(projected.data(), stream.data(), d, d, w.post_norm, s->eps, m, d, w.gate_up,
             w.gate_up_bias, s->intermediate, w.down, w.down_bias, stream.data(), out.data(),
             num_threads, int(w.gate_up_type), int(w.down_type));
    x = out.data();
  }
  std::memcpy(hidden_out, out.data(), m * d * sizeof(T));
  std::memcpy(residual_out, stream.data(), m * d * sizeof(T));
}

}  // extern "C"
#else
extern "C" int pdserve_decoder_layers_available() { return 0; }
#endif
