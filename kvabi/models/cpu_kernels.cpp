// kvabi's CPU kernels: paged decode attention, and the elementwise steps of a Llama layer fused
// (RMSNorm with the residual add, SiLU-and-mul, RoPE in place). torch runs each of the latter as
// 3-8 separate passes over memory, with slow bf16 paths; here each is one pass.
//
// Built and loaded by kvabi/models/cpu_kernels.py (g++ -O3 -march=native -fopenmp, plain C ABI,
// called through ctypes); tests/models/test_cpu_kernels.py compares each with its torch
// reference. dtype codes: 0 = float32, 1 = bfloat16. Arithmetic is float32; for bf16 the
// intermediate roundings of the torch reference are reproduced where it rounds (rnd<T>), so the
// results agree with it to the last bit or within an ulp.
//
// Paged decode attention: one query token per sequence, K/V read in place from the block pool
// through each sequence's block table (no gather, no padding). Shapes (elements, not bytes):
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
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <type_traits>
#include <vector>

namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t bf16) { return __builtin_bit_cast(float, static_cast<uint32_t>(bf16) << 16); }
// float -> bf16 bits, round to nearest even as torch does; a select rather than a branch for NaN
// so that the loops calling it vectorize.
inline uint16_t bf16_bits(float x) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}
inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, uint16_t* dst) { *dst = bf16_bits(x); }

// The value x takes once stored as T (float: itself; bf16: rounded to nearest even).
template <typename T>
inline float rnd(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return to_f32(bf16_bits(x));
  }
}

// exp(x) within ~2 ulp: Cody-Waite range reduction and Cephes' polynomial, in plain float
// arithmetic so the compiler vectorizes the loops that call it (a scalar libm call per element
// cost more than the rest of a kernel). x is clamped to [-87, 88], where 2^n stays a normal float.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // n = round(x / ln 2) by the 1.5 * 2^23 trick (std::floor would stop GCC vectorizing)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  return p * __builtin_bit_cast(float, bits);
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

// Scores q.k * scale of a bf16 cache with AVX512-BF16's dot-product instruction: the bf16
// products are exact in float32 as in the generic path; only the summation order differs. It
// reads K without converting it and sums 32 products per instruction. Returns false (nothing
// done) where it does not apply: float32, a head size other than 64/128, more than 8 query
// heads per KV head, or a CPU/compiler without AVX512-BF16.
template <typename T, int DIM>
bool bf16_scores(const T* q, int group, const Pool& pool, const int64_t* table,
                 int64_t context_len, int64_t offset, float scale, float* scores) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t> && (DIM == 64 || DIM == 128)) {
    constexpr int kChunks = DIM / 32;  // 32 bf16 per 512-bit register
    if (group > 8) return false;
    __m512bh qv[8][kChunks];
    for (int g = 0; g < group; ++g)
      for (int c = 0; c < kChunks; ++c)
        qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * DIM + c * 32);
    for_each_token(static_cast<const T*>(pool.k), pool, table, context_len, offset,
                   [&](int64_t t, const T* k) {
                     __m512bh kv[kChunks];
                     for (int c = 0; c < kChunks; ++c)
                       kv[c] = (__m512bh)_mm512_loadu_si512(k + c * 32);
                     for (int g = 0; g < group; ++g) {
                       __m512 acc = _mm512_setzero_ps();
                       for (int c = 0; c < kChunks; ++c) acc = _mm512_dpbf16_ps(acc, qv[g][c], kv[c]);
                       scores[g * context_len + t] = _mm512_reduce_add_ps(acc) * scale;
                     }
                   });
    return true;
  }
#endif
  (void)q, (void)group, (void)pool, (void)table, (void)context_len, (void)offset, (void)scale;
  (void)scores;
  return false;
}

// acc[g] = sum_t p[g][t] * v_t for a bf16 cache with the accumulators held in registers (the
// generic loop keeps them in memory: a load and a store per multiply-add). Same float32
// arithmetic as the generic path. Returns false where it does not apply (float32, head size
// other than 64/128, more accumulators than registers).
template <typename T, int DIM>
bool bf16_weighted_sum(int group, const Pool& pool, const int64_t* table, int64_t context_len,
                       int64_t offset, const float* p, float* acc) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, uint16_t> && (DIM == 64 || DIM == 128)) {
    constexpr int kChunks = DIM / 16;  // 16 floats per 512-bit register
    constexpr int kMaxGroup = 16 / kChunks;  // 16 accumulator registers
    if (group > kMaxGroup) return false;
    __m512 sums[kMaxGroup][kChunks];
    for (int g = 0; g < kMaxGroup; ++g)
      for (int c = 0; c < kChunks; ++c) sums[g][c] = _mm512_setzero_ps();
    for_each_token(static_cast<const T*>(pool.v), pool, table, context_len, offset,
                   [&](int64_t t, const T* v) {
                     __m512 vf[kChunks];
                     for (int c = 0; c < kChunks; ++c) {
                       const __m256i raw = _mm256_loadu_si256(
                           reinterpret_cast<const __m256i*>(v + c * 16));
                       vf[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
                     }
                     for (int g = 0; g < group; ++g) {
                       const __m512 weight = _mm512_set1_ps(p[g * context_len + t]);
                       for (int c = 0; c < kChunks; ++c)
                         sums[g][c] = _mm512_fmadd_ps(weight, vf[c], sums[g][c]);
                     }
                   });
    for (int g = 0; g < group; ++g)
      for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + g * DIM + c * 16, sums[g][c]);
    return true;
  }
#endif
  (void)group, (void)pool, (void)table, (void)context_len, (void)offset, (void)p, (void)acc;
  return false;
}

// One (sequence, KV head): the `group` query heads that share that KV head. DIM > 0 fixes the
// head size at compile time (fully unrolled inner loops: ~2x faster); 0 reads it at run time.
template <typename T, int DIM>
void attend(const T* q, T* out, const Pool& pool, const int64_t* table, int64_t context_len,
            int64_t kv_head, int group, int runtime_dim, float scale, std::vector<float>& scores,
            std::vector<float>& acc, std::vector<float>& qf, std::vector<float>& row) {
  const int head_dim = DIM > 0 ? DIM : runtime_dim;
  scores.resize(static_cast<size_t>(group) * context_len);
  acc.assign(static_cast<size_t>(group) * head_dim, 0.0f);
  qf.resize(static_cast<size_t>(group) * head_dim);
  row.resize(head_dim);  // one K or V row in float32, converted once for all `group` heads
  float* r = row.data();
  for (int i = 0; i < group * head_dim; ++i) qf[i] = to_f32(q[i]) * scale;
  const int64_t offset = kv_head * pool.head_stride;
  const T* kc = static_cast<const T*>(pool.k);
  if (!bf16_scores<T, DIM>(q, group, pool, table, context_len, offset, scale, scores.data())) {
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
  }
  std::vector<float> inv_sum(group);
  for (int g = 0; g < group; ++g) {
    float* s = &scores[static_cast<size_t>(g) * context_len];
    const float peak = *std::max_element(s, s + context_len);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < context_len; ++t) {
      s[t] = exp_approx(s[t] - peak);
      sum += s[t];
    }
    inv_sum[g] = 1.0f / sum;
  }
  const T* vc = static_cast<const T*>(pool.v);
  if (!bf16_weighted_sum<T, DIM>(group, pool, table, context_len, offset, scores.data(),
                                 acc.data())) {
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
  }
  for (int g = 0; g < group; ++g)
    for (int d = 0; d < head_dim; ++d)
      store(acc[static_cast<size_t>(g) * head_dim + d] * inv_sum[g], &out[g * head_dim + d]);
}

template <typename T, int DIM>
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
      attend<T, DIM>(q + offset, out + offset, pool, tables + s * table_width, context_lens[s], h,
                group, head_dim, scale, scores, acc, qf, row);
    }
  }
}

// Below this many elements an elementwise kernel runs on the calling thread: waking the other
// threads costs more than the work (decode steps have a few rows).
constexpr int64_t kParallelMin = 1 << 16;

// x [rows, n] with row stride x_stride -> out [rows, n] contiguous. With a residual [rows, n]
// (contiguous): residual += x first (rounded to T), and the sum is what gets normalised, i.e.
// HF's `h = residual + x; out = norm(h)` with h written back into residual.
template <typename T>
void rms_norm(const T* x, int64_t x_stride, T* residual, const T* weight, T* out, int64_t rows,
              int64_t n, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = x + r * x_stride;
    if (residual != nullptr) {
      T* res = residual + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) store(to_f32(res[i]) + to_f32(src[i]), &res[i]);
      src = res;
    }
    float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < n; ++i) sum_sq += to_f32(src[i]) * to_f32(src[i]);
    const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
    T* o = out + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) store(to_f32(weight[i]) * rnd<T>(to_f32(src[i]) * inv), &o[i]);
  }
}

// x [rows, 2n] = gate | up -> out [rows, n] = silu(gate) * up, both contiguous.
template <typename T>
void silu_and_mul_row(const T* __restrict gate, const T* __restrict up, T* __restrict out, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    const float g = to_f32(gate[i]);
    const float silu = rnd<T>(g / (1.0f + exp_approx(-g)));
    store(silu * to_f32(up[i]), &out[i]);
  }
}

template <typename T>
void silu_and_mul(const T* x, T* out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r)
    silu_and_mul_row(x + r * 2 * n, x + r * 2 * n + n, out + r * n, static_cast<int>(n));
}

// RoPE with HF's rotate_half pairing (dim i with i + head_dim/2), in place on x [tokens, heads,
// head_dim] (token stride token_stride, heads contiguous); cos/sin [tokens, head_dim] contiguous.
// out_i = x_i cos_i - x_{i+h} sin_i, out_{i+h} = x_{i+h} cos_{i+h} + x_i sin_{i+h}.
template <typename T>
void rope(T* x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t head_dim,
          const T* cos, const T* sin, int num_threads) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens * heads * head_dim >= kParallelMin)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * head_dim;
    const T* s = sin + t * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      T* p = x + t * token_stride + h * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_f32(p[i]), x2 = to_f32(p[i + half]);
        const float lo = rnd<T>(rnd<T>(x1 * to_f32(c[i])) + rnd<T>(-x2 * to_f32(s[i])));
        const float hi =
            rnd<T>(rnd<T>(x2 * to_f32(c[i + half])) + rnd<T>(x1 * to_f32(s[i + half])));
        store(lo, &p[i]);
        store(hi, &p[i + half]);
      }
    }
  }
}

template <typename T>
int dispatch(const T* q, T* out, const Pool& pool, const int64_t* tables, int64_t table_width,
             const int64_t* context_lens, int64_t num_seqs, int num_heads, int num_kv_heads,
             int head_dim, float scale, int num_threads) {
  auto run = [&](auto dim) {
    decode<T, decltype(dim)::value>(q, out, pool, tables, table_width, context_lens, num_seqs,
                                    num_heads, num_kv_heads, head_dim, scale, num_threads);
  };
  if (head_dim == 64)
    run(std::integral_constant<int, 64>{});
  else if (head_dim == 128)
    run(std::integral_constant<int, 128>{});
  else
    run(std::integral_constant<int, 0>{});
  return 0;
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
  if (dtype == 0)
    return dispatch(static_cast<const float*>(q), static_cast<float*>(out), pool, tables,
                    table_width, context_lens, num_seqs, num_heads, num_kv_heads, head_dim, scale,
                    num_threads);
  if (dtype == 1)
    return dispatch(static_cast<const uint16_t*>(q), static_cast<uint16_t*>(out), pool, tables,
                    table_width, context_lens, num_seqs, num_heads, num_kv_heads, head_dim, scale,
                    num_threads);
  return -1;
}

int kvabi_rms_norm(int dtype, const void* x, int64_t x_stride, void* residual, const void* weight,
                   void* out, int64_t rows, int64_t n, float eps, int num_threads) {
  if (dtype == 0)
    rms_norm(static_cast<const float*>(x), x_stride, static_cast<float*>(residual),
             static_cast<const float*>(weight), static_cast<float*>(out), rows, n, eps,
             num_threads);
  else if (dtype == 1)
    rms_norm(static_cast<const uint16_t*>(x), x_stride, static_cast<uint16_t*>(residual),
             static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), rows, n, eps,
             num_threads);
  else
    return -1;
  return 0;
}

int kvabi_silu_and_mul(int dtype, const void* x, void* out, int64_t rows, int64_t n,
                       int num_threads) {
  if (dtype == 0)
    silu_and_mul(static_cast<const float*>(x), static_cast<float*>(out), rows, n, num_threads);
  else if (dtype == 1)
    silu_and_mul(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), rows, n,
                 num_threads);
  else
    return -1;
  return 0;
}

int kvabi_rope(int dtype, void* x, int64_t token_stride, int64_t tokens, int64_t heads,
               int64_t head_dim, const void* cos, const void* sin, int num_threads) {
  if (dtype == 0)
    rope(static_cast<float*>(x), token_stride, tokens, heads, head_dim,
         static_cast<const float*>(cos), static_cast<const float*>(sin), num_threads);
  else if (dtype == 1)
    rope(static_cast<uint16_t*>(x), token_stride, tokens, heads, head_dim,
         static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin), num_threads);
  else
    return -1;
  return 0;
}
}
