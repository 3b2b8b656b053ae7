// Paged decode attention on the CPU: one query token per sequence, K/V read in place from the
// block pool through each sequence's block table (no gather, no padding).
//
// Built and loaded by kvabi/engine/native_kernels.py (g++ -O3 -march=native -fopenmp, plain C ABI,
// called through ctypes). The reference it must match is the torch path in paged_attention.py.
//
// Shapes (elements, not bytes):
//   q, out       [num_seqs, num_heads, head_dim], contiguous
//   k_cache/v_cache: canonical views [num_blocks, block_size, num_kv_heads, head_dim] with any
//                strides for the first three axes (so NHD and HND pools both work); head_dim
//                contiguous
//   tables       [num_seqs, table_width] int64, contiguous; context_lens [num_seqs] int64
// Query heads h use KV head h / (num_heads / num_kv_heads) (GQA). Scores, softmax and the
// weighted sum accumulate in float32; out is rounded once to the cache dtype.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, uint16_t* dst) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *dst = static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *dst = static_cast<uint16_t>(bits >> 16);
}

struct Pool {
  const void* k;
  const void* v;
  int64_t block_stride, slot_stride, head_stride;  // same for K and V (one canonical view)
  int64_t block_size;
};

// Calls fn(t, row) for each token t < context_len with a pointer to its row at `offset`
// (block-wise, so there is no division per token).
template <typename T, typename Fn>
inline void for_each_token(const T* base, const Pool& pool, const int64_t* table,
                           int64_t context_len, int64_t offset, Fn fn) {
  for (int64_t start = 0, b = 0; start < context_len; start += pool.block_size, ++b) {
    const T* block = base + table[b] * pool.block_stride + offset;
    const int64_t n = std::min(pool.block_size, context_len - start);
    for (int64_t j = 0; j < n; ++j) fn(start + j, block + j * pool.slot_stride);
  }
}

// One (sequence, KV head): the `group` query heads that share that KV head.
template <typename T>
void attend(const T* q, T* out, const Pool& pool, const int64_t* table, int64_t context_len,
            int64_t kv_head, int group, int head_dim, float scale, std::vector<float>& scores,
            std::vector<float>& acc, std::vector<float>& qf, std::vector<float>& row) {
  scores.resize(static_cast<size_t>(group) * context_len);
  acc.assign(static_cast<size_t>(group) * head_dim, 0.0f);
  qf.resize(static_cast<size_t>(group) * head_dim);
  row.resize(head_dim);  // one K or V row in float32, converted once for all `group` heads
  float* r = row.data();
  for (int i = 0; i < group * head_dim; ++i) qf[i] = to_f32(q[i]) * scale;
  const int64_t offset = kv_head * pool.head_stride;
  const T* kc = static_cast<const T*>(pool.k);
  for_each_token(kc, pool, table, context_len, offset, [&](int64_t t, const T* k) {
#pragma omp simd
    for (int d = 0; d < head_dim; ++d) r[d] = to_f32(k[d]);
    for (int g = 0; g < group; ++g) {
      const float* qg = &qf[static_cast<size_t>(g) * head_dim];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < head_dim; ++d) dot += qg[d] * r[d];
      scores[static_cast<size_t>(g) * context_len + t] = dot;
    }
  });
  std::vector<float> inv_sum(group);
  for (int g = 0; g < group; ++g) {
    float* s = &scores[static_cast<size_t>(g) * context_len];
    const float peak = *std::max_element(s, s + context_len);
    float sum = 0.0f;
    for (int64_t t = 0; t < context_len; ++t) sum += (s[t] = std::exp(s[t] - peak));
    inv_sum[g] = 1.0f / sum;
  }
  const T* vc = static_cast<const T*>(pool.v);
  for_each_token(vc, pool, table, context_len, offset, [&](int64_t t, const T* v) {
#pragma omp simd
    for (int d = 0; d < head_dim; ++d) r[d] = to_f32(v[d]);
    for (int g = 0; g < group; ++g) {
      const float p = scores[static_cast<size_t>(g) * context_len + t];
      float* a = &acc[static_cast<size_t>(g) * head_dim];
#pragma omp simd
      for (int d = 0; d < head_dim; ++d) a[d] += p * r[d];
    }
  });
  for (int g = 0; g < group; ++g)
    for (int d = 0; d < head_dim; ++d)
      store(acc[static_cast<size_t>(g) * head_dim + d] * inv_sum[g], &out[g * head_dim + d]);
}

template <typename T>
void decode(const T* q, T* out, const Pool& pool, const int64_t* tables, int64_t table_width,
            const int64_t* context_lens, int64_t num_seqs, int num_heads, int num_kv_heads,
            int head_dim, float scale, int num_threads) {
  const int group = num_heads / num_kv_heads;
  const int64_t work = num_seqs * num_kv_heads;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores, acc, qf, row;  // per thread, reused across its items
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < work; ++item) {
      const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t offset = (s * num_heads + h * group) * head_dim;
      attend<T>(q + offset, out + offset, pool, tables + s * table_width, context_lens[s], h,
                group, head_dim, scale, scores, acc, qf, row);
    }
  }
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16 (q, out and the cache share it). Returns 0, or -1 for an
// unknown dtype.
int kvabi_paged_decode(int dtype, const void* q, void* out, const void* k_cache,
                       const void* v_cache, int64_t block_stride, int64_t slot_stride,
                       int64_t head_stride, int64_t block_size, const int64_t* tables,
                       int64_t table_width, const int64_t* context_lens, int64_t num_seqs,
                       int num_heads, int num_kv_heads, int head_dim, float scale,
                       int num_threads) {
  const Pool pool{k_cache, v_cache, block_stride, slot_stride, head_stride, block_size};
  if (dtype == 0) {
    decode(static_cast<const float*>(q), static_cast<float*>(out), pool, tables, table_width,
           context_lens, num_seqs, num_heads, num_kv_heads, head_dim, scale, num_threads);
  } else if (dtype == 1) {
    decode(static_cast<const uint16_t*>(q), static_cast<uint16_t*>(out), pool, tables,
           table_width, context_lens, num_seqs, num_heads, num_kv_heads, head_dim, scale,
           num_threads);
  } else {
    return -1;
  }
  return 0;
}
}
