// One recurrent step of Gated DeltaNet (Qwen3.5's linear attention) for each request of a
// batch, in place on the requests' state slots: per value head, the state S [K, V] decays by
// exp(g), learns the token's key -> value by the delta rule at rate beta, and is read by the
// query. One pass over each state (the torch form reads and writes it six times, after a gather
// and before a scatter of every slot), float32 throughout.
// Each (request, head) runs the same code, so its bits do not depend on the batch.
// Built and loaded by pdserve/kernels/cpu/native.py; (request, head) pairs split over threads.
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kParallelMinStates = 1 << 18;  // floats of state: below, one thread

void deltanet_step(const float* q, const float* k, const float* v, const float* decay,
                   const float* beta, float* state, int64_t slot_stride, const int64_t* slots,
                   float* out, int64_t rows, int64_t heads, int64_t key_dim, int64_t value_dim,
                   int num_threads) {
  const int64_t pairs = rows * heads;
#pragma omp parallel num_threads(num_threads) if (pairs * key_dim * value_dim >= kParallelMinStates)
  {
    std::vector<float> delta(value_dim);
#pragma omp for
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t r = p / heads, h = p % heads;
      float* s = state + slots[r] * slot_stride + h * key_dim * value_dim;
      const float* qp = q + p * key_dim;
      const float* kp = k + p * key_dim;
      const float* vp = v + p * value_dim;
      const float d = decay[p], b = beta[p];
      float* o = out + p * value_dim;
      // delta = (v - (d * S)^T k) * beta, the decay applied as S is read.
      for (int64_t j = 0; j < value_dim; ++j) delta[j] = 0.f;
      for (int64_t i = 0; i < key_dim; ++i) {
        float* row = s + i * value_dim;
        const float ki = kp[i];
        for (int64_t j = 0; j < value_dim; ++j) {
          row[j] *= d;
          delta[j] += row[j] * ki;
        }
      }
      for (int64_t j = 0; j < value_dim; ++j) delta[j] = (vp[j] - delta[j]) * b;
      // S += k delta^T; out = S^T q.
      for (int64_t j = 0; j < value_dim; ++j) o[j] = 0.f;
      for (int64_t i = 0; i < key_dim; ++i) {
        float* row = s + i * value_dim;
        const float ki = kp[i], qi = qp[i];
        for (int64_t j = 0; j < value_dim; ++j) {
          row[j] += ki * delta[j];
          o[j] += row[j] * qi;
        }
      }
    }
  }
}

}  // namespace

// q, k [rows, heads, key_dim], v and out [rows, heads, value_dim], decay and beta [rows, heads],
// contiguous float32; state: the slots' float32 states, slot s at state + s * slot_stride, each
// [heads, key_dim, value_dim] contiguous.
extern "C" void pdserve_deltanet_step(const float* q, const float* k, const float* v,
                                      const float* decay, const float* beta, float* state,
                                      int64_t slot_stride, const int64_t* slots, float* out,
                                      int64_t rows, int64_t heads, int64_t key_dim,
                                      int64_t value_dim, int num_threads) {
  deltanet_step(q, k, v, decay, beta, state, slot_stride, slots, out, rows, heads, key_dim,
                value_dim, num_threads);
}
