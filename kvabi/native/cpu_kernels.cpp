// kvabi's CPU kernels: paged decode attention, and the elementwise steps of a Llama layer fused
// (RMSNorm with the residual add, SiLU-and-mul, RoPE in place). torch runs each of the latter as
// 3-8 separate passes over memory, with slow bf16 paths; here each is one pass.
//
// Built and loaded by kvabi/native/cpu_kernels.py (g++ -O3 -march=native -fopenmp, plain C ABI,
// called through ctypes); tests/native/test_cpu_kernels.py compares each with its torch
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
#include <initializer_list>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__linux__)
#include <cerrno>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

#if defined(__AVX512F__)
// exp_approx on 16 lanes: the same range reduction and polynomial; 2^n by scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 big = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), big), big);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

// s[t] = exp(s[t] - top) for t < n; returns their sum (the softmax's denominator).
inline float exp_and_sum(float* s, int64_t n, float top) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_approx(s[t] - top);
    sum += s[t];
  }
  return sum;
}

struct Pool {
  const void* k;
  const void* v;
  int64_t block_stride, slot_stride, head_stride;  // same for K and V (one canonical view)
  int64_t block_size;
};

// Calls fn(t, row) for each token begin <= t < end with a pointer to its row at `offset`
// (block-wise, so there is no division per token).
template <typename T, typename Fn>
inline void for_each_token(const T* base, const Pool& pool, const int64_t* table, int64_t begin,
                           int64_t end, int64_t offset, Fn fn) {
  for (int64_t b = begin / pool.block_size, start = b * pool.block_size; start < end;
       start += pool.block_size, ++b) {
    const T* block = base + table[b] * pool.block_stride + offset;
    const int64_t first = std::max(begin - start, int64_t{0});
    const int64_t n = std::min(pool.block_size, end - start);
    for (int64_t j = first; j < n; ++j) fn(start + j, block + j * pool.slot_stride);
  }
}

// One part of a (sequence, KV head)'s keys [begin, end), before the softmax's normalisation:
// acc[g][d] = sum_t exp(s_gt - peak_g) v_t[d], peak[g] = max_t s_gt, sum[g] = sum_t exp(s_gt - peak_g).
struct AttendPart {
  float* acc;  // [group][dim]
  float* peak;  // [group]
  float* sum;  // [group]
};

using Bf16Attend = void (*)(const uint16_t*, const Pool&, const int64_t*, int64_t, int64_t,
                            int64_t, float, std::vector<float>&, const AttendPart&);

#if defined(__AVX512F__)
// One lane-wise reduction of each of 16 vectors, as one vector: out[j] = op over v[j]'s 16
// lanes (a transpose tree: 15 ops and 30 shuffles instead of 16 horizontal reductions).
template <typename Op>
inline __m512 reduce16(const __m512* v, Op op) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = op(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
              _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
              _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    y[i] = op(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
              _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xdd));
  return op(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
}
inline __m512 sum16(const __m512* v) {
  return reduce16(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}
inline __m512 max16(const __m512* v) {
  return reduce16(v, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
}

inline __m512 bf16x16_to_f32(const uint16_t* p) {  // exact: bf16 is float32's upper half
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

#if defined(__AVX512BF16__)

// One (sequence, KV head) of a bf16 cache, with the head size and the number of query heads per
// KV head fixed at compile time so that the accumulators can live in registers (up to 32: head
// size 128 with more than 3 query heads per KV head spills some), over the part [begin, end) of
// its keys (`decode` merges the parts). Same arithmetic as the generic `attend` (bf16 products are exact in float32, float32 sums, one rounding of
// the output); only the summation order differs.
//  - scores: 16 tokens at a time, 32 products per AVX512-BF16 instruction, the 16 dot products
//    summed together (sum16), the running maximum kept as a vector;
//  - softmax over the scores row;
//  - weighted sum of V: each V row is widened once for all GROUP heads.
template <int DIM, int GROUP>
void attend_bf16(const uint16_t* q, const Pool& pool, const int64_t* table, int64_t begin,
                 int64_t end, int64_t kv_head, float scale, std::vector<float>& buf,
                 const AttendPart& part) {
  constexpr int kDot = DIM / 32, kAcc = DIM / 16;
  const int64_t count = end - begin, stride = (count + 15) / 16 * 16;  // a scores row per head
  buf.resize(static_cast<size_t>(GROUP) * stride);
  float* scores = buf.data();
  const int64_t offset = kv_head * pool.head_stride;
  __m512 peak[GROUP];
  for (int g = 0; g < GROUP; ++g) peak[g] = _mm512_set1_ps(-INFINITY);
  const uint16_t* rows[16];
  int n = 0;
  int64_t t0 = 0;
  auto flush = [&]() {
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < GROUP; ++g) {
      __m512bh qv[kDot];
      for (int c = 0; c < kDot; ++c)
        qv[c] = (__m512bh)_mm512_loadu_si512(q + g * DIM + c * 32);
      __m512 dots[16];
      for (int j = 0; j < 16; ++j) {
        dots[j] = _mm512_setzero_ps();
        if (j < n)
          for (int c = 0; c < kDot; ++c)
            dots[j] = _mm512_dpbf16_ps(dots[j], qv[c],
                                       (__m512bh)_mm512_loadu_si512(rows[j] + c * 32));
      }
      const __m512 s = _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale));
      peak[g] = _mm512_mask_max_ps(peak[g], valid, peak[g], s);
      _mm512_storeu_ps(scores + g * stride + t0, s);
    }
    t0 += n;
    n = 0;
  };
  for_each_token(static_cast<const uint16_t*>(pool.k), pool, table, begin, end, offset,
                 [&](int64_t, const uint16_t* k) {
                   rows[n++] = k;
                   if (n == 16) flush();
                 });
  if (n > 0) flush();
  for (int g = 0; g < GROUP; ++g) {
    part.peak[g] = _mm512_reduce_max_ps(peak[g]);
    part.sum[g] = exp_and_sum(scores + g * stride, count, part.peak[g]);
  }

  __m512 acc[GROUP][kAcc];
  for (int g = 0; g < GROUP; ++g)
    for (int c = 0; c < kAcc; ++c) acc[g][c] = _mm512_setzero_ps();
  for_each_token(static_cast<const uint16_t*>(pool.v), pool, table, begin, end, offset,
                 [&](int64_t token, const uint16_t* v) {
                   const int64_t t = token - begin;
                   __m512 vf[kAcc];
                   for (int c = 0; c < kAcc; ++c) vf[c] = bf16x16_to_f32(v + c * 16);
                   for (int g = 0; g < GROUP; ++g) {
                     const __m512 w = _mm512_set1_ps(scores[g * stride + t]);
                     for (int c = 0; c < kAcc; ++c) acc[g][c] = _mm512_fmadd_ps(w, vf[c], acc[g][c]);
                   }
                 });
  for (int g = 0; g < GROUP; ++g)
    for (int c = 0; c < kAcc; ++c) _mm512_storeu_ps(part.acc + g * DIM + c * 16, acc[g][c]);
}

// The attend_bf16 instance for (DIM, group), or nullptr where there is none (group > 8).
template <int DIM, int... G>
Bf16Attend pick_bf16(int group, std::integer_sequence<int, G...>) {
  Bf16Attend fn = nullptr;
  ((group == G + 1 ? (fn = &attend_bf16<DIM, G + 1>, 0) : 0), ...);
  return fn;
}
#endif

// The bf16 fast path for this head size and group, or nullptr (the generic path runs).
template <int DIM>
Bf16Attend fast_attend(int group) {
#if defined(__AVX512BF16__)
  if constexpr (DIM == 64 || DIM == 128)
    return pick_bf16<DIM>(group, std::make_integer_sequence<int, 8>{});
#endif
  (void)group;
  return nullptr;
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
  for_each_token(static_cast<const T*>(pool.k), pool, table, 0, context_len, offset,
                 [&](int64_t t, const T* k) {
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
    float peak = -INFINITY;
#pragma omp simd reduction(max : peak)
    for (int64_t t = 0; t < context_len; ++t) peak = std::max(peak, s[t]);
    inv_sum[g] = 1.0f / exp_and_sum(s, context_len, peak);
  }
  for_each_token(static_cast<const T*>(pool.v), pool, table, 0, context_len, offset,
                 [&](int64_t t, const T* v) {
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

// How many parts `decode` splits each (sequence, KV head)'s keys into: with fewer items than a
// few per thread (batch 1 has as many as the model has KV heads: 3 for SmolLM2 on 2 threads),
// whole items leave threads idle; parts of at least kMinPart keys, merged after, balance them.
// The split depends only on the step's shape, so a step's result does not depend on timing.
constexpr int64_t kMinPart = 64, kMaxParts = 64;
inline int64_t attend_parts(int64_t work, int64_t longest, int num_threads) {
  if (num_threads < 2 || work >= 4 * num_threads) return 1;
  int64_t parts = 1;
  while (work * parts < 4 * num_threads && longest >= 2 * parts * kMinPart && parts < kMaxParts)
    parts *= 2;
  return parts;
}

// out[g] = the merged parts' softmax-weighted sum of V for query head g (bf16), where part i
// holds its keys' sums relative to its own peak: each is rescaled by exp(peak_i - peak). One
// part is the unsplit softmax, rounded as before: acc * (1 / sum).
inline void merge_parts(const float* parts, int64_t num_parts, int group, int dim, uint16_t* out) {
  const int64_t part_size = static_cast<int64_t>(group) * (dim + 2);
  float w[kMaxParts];
  for (int g = 0; g < group; ++g) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t i = 0; i < num_parts; ++i)
      top = std::max(top, parts[i * part_size + group * dim + g]);
    for (int64_t i = 0; i < num_parts; ++i) {
      const float* part = parts + i * part_size;
      w[i] = num_parts == 1 ? 1.0f : exp_approx(part[group * dim + g] - top);
      total += w[i] * part[group * dim + group + g];
    }
    const float inv = 1.0f / total;
    for (int d = 0; d < dim; ++d) {
      float value = 0.0f;
      for (int64_t i = 0; i < num_parts; ++i) value += w[i] * parts[i * part_size + g * dim + d];
      out[g * dim + d] = bf16_bits(value * inv);
    }
  }
}

template <typename T, int DIM>
void decode(const T* q, int64_t q_stride, T* out, const Pool& pool, const int64_t* tables,
            int64_t table_width, const int64_t* context_lens, int64_t num_seqs, int num_heads, int num_kv_heads,
            int head_dim, float scale, int num_threads) {
  const int group = num_heads / num_kv_heads;
  const int64_t work = num_seqs * num_kv_heads;
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (Bf16Attend fast = fast_attend<DIM>(group); fast != nullptr) {
      // bf16 fast path: every item in parts ([item][part]: acc [group][dim], peak, sum), merged
      const int64_t longest = *std::max_element(context_lens, context_lens + num_seqs);
      const int64_t parts = attend_parts(work, longest, num_threads);
      const int64_t part_size = static_cast<int64_t>(group) * (head_dim + 2);
      std::vector<float> partials(static_cast<size_t>(work * parts * part_size));
#pragma omp parallel num_threads(num_threads)
      {
        std::vector<float> scores;  // per thread, reused across its items
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < work * parts; ++job) {
          const int64_t item = job / parts, i = job % parts;
          const int64_t s = item / num_kv_heads, h = item % num_kv_heads, len = context_lens[s];
          const int64_t begin = len * i / parts, end = len * (i + 1) / parts;
          float* p = partials.data() + job * part_size;
          const AttendPart part{p, p + group * head_dim, p + group * head_dim + group};
          fast(q + s * q_stride + h * group * head_dim, pool, tables + s * table_width, begin, end,
               h, scale, scores, part);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < work; ++item) {
          const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
          merge_parts(partials.data() + item * parts * part_size, parts, group, head_dim,
                      out + (s * num_heads + h * group) * head_dim);
        }
      }
      return;
    }
  }
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores, acc, qf, row;  // per thread, reused across its items
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < work; ++item) {
      const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
      const T* qs = q + s * q_stride + h * group * head_dim;  // this KV head's query heads
      T* os = out + (s * num_heads + h * group) * head_dim;
      attend<T, DIM>(qs, os, pool, tables + s * table_width, context_lens[s], h, group, head_dim,
                     scale, scores, acc, qf, row);
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
  // an exact division per element: worth a second thread from a quarter of kParallelMin
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n >= kParallelMin / 4)

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

// ---- The packed bf16 GEMM without AMX: AVX512-BF16 dot products (AMD Zen 4, Intel without AMX) ----
// y [m, n] = x [m, k] @ W^T (+ bias) over the same packed weight as the AMX GEMM (amx_pack:
// per 16 columns, per 32 k, [16 k pairs][16 columns][2]): a 64-byte row of that tile is one
// k pair of 16 columns, the operand of one vdpbf16ps against the row's k pair broadcast. Sums in
// float32, the bias added in float32, one rounding to bf16 (as the AMX GEMM and oneDNN do; the
// order of the float32 sums differs, so a rare element lands one bf16 ulp from theirs). Each
// thread takes whole pairs of column tiles and runs every block of kDotRows rows of x through them,
// so a pair's weights come from memory once per call and from cache after (decode sizes only
// stream weights).
#if defined(__AVX512BF16__)
#ifndef KVABI_DOT_ROWS
#define KVABI_DOT_ROWS 8
#endif
#ifndef KVABI_DOT_TILES
#define KVABI_DOT_TILES 2
#endif
// rows per pass and column tiles per thread's item: R x T accumulators, T weights, 1 broadcast
constexpr int kDotRows = KVABI_DOT_ROWS, kDotTiles = KVABI_DOT_TILES;

inline void dot_emit(__m512 acc, const uint16_t* bias, uint16_t* y) {
  if (bias != nullptr) acc = _mm512_add_ps(acc, bf16x16_to_f32(bias));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(acc));
}

// R rows of x through T column tiles (tile t's weights at b + t * k_pairs * 32).
template <int R, int T>
void dot_rows(const uint16_t* x, int64_t ldx, const uint16_t* b, int64_t k_pairs,
              const uint16_t* bias, uint16_t* y, int64_t ldy) {
  __m512 acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    __m512bh w[T];
    for (int t = 0; t < T; ++t) w[t] = (__m512bh)_mm512_loadu_si512(b + (t * k_pairs + kp) * 32);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * kp, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < T; ++t) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], a, w[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      dot_emit(acc[t][r], bias == nullptr ? nullptr : bias + t * 16, y + r * ldy + t * 16);
}

template <int T, int... R>
void dot_block(int rows, std::integer_sequence<int, R...>, const uint16_t* x, int64_t ldx,
               const uint16_t* b, int64_t k_pairs, const uint16_t* bias, uint16_t* y,
               int64_t ldy) {
  ((rows == R + 1 ? dot_rows<R + 1, T>(x, ldx, b, k_pairs, bias, y, ldy) : void()), ...);
}

template <int... T>
void dot_tiles(int tiles, int rows, std::integer_sequence<int, T...>, const uint16_t* x,
               int64_t ldx, const uint16_t* b, int64_t k_pairs, const uint16_t* bias,
               uint16_t* y, int64_t ldy) {
  ((tiles == T + 1 ? dot_block<T + 1>(rows, std::make_integer_sequence<int, kDotRows>{}, x,
                                      ldx, b, k_pairs, bias, y, ldy)
                   : void()),
   ...);
}

void dot_linear(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias,
                uint16_t* y, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
  const int64_t col_tiles = n / 16, k_pairs = k / 2;
  const int64_t items = (col_tiles + kDotTiles - 1) / kDotTiles;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (items > 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t j = item * kDotTiles;
    const int tiles = static_cast<int>(std::min<int64_t>(kDotTiles, col_tiles - j));
    for (int64_t r0 = 0; r0 < m; r0 += kDotRows) {
      const int rows = static_cast<int>(std::min<int64_t>(m - r0, kDotRows));
      dot_tiles(tiles, rows, std::make_integer_sequence<int, kDotTiles>{}, x + r0 * ldx, ldx,
                w + j * k_pairs * 32, k_pairs, bias == nullptr ? nullptr : bias + j * 16,
                y + r0 * ldy + j * 16, ldy);
    }
  }
}
#define KVABI_HAVE_PACKED_GEMM 1
#endif

// ---- bf16 GEMM on AMX tiles: y[m, n] = x[m, k] @ W^T (+ bias) ----
// W is packed once (`CpuKernels.amx_pack`) into 1 KiB tiles in the order the kernel reads them:
// [n/16][k/32][16 pairs of k][16 columns of n][2], AMX's "VNNI" B layout, so each thread
// streams its columns' weights front to back. Products are exact in float32 and summed in
// float32 by the tile unit, rounded once to bf16 (the bias added in float32 first): the same
// arithmetic as the oneDNN AMX GEMM behind F.linear, with the same bits up to 32 rows (tests
// compare them; with more rows oneDNN blocks differently and a rare element rounds the other
// way). At decode sizes the GEMM only streams weights; prefetching a few tiles ahead and no
// per-call weight reorder make it ~2x oneDNN's packed GEMM called through torch.

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVABI_HAVE_AMX 1
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 = C of rows 0-15 for the two column tiles of a pair; 2, 3 = C of rows 16-31;
// 4, 5 = A (x) rows 0-15 and 16-31; 6, 7 = B (W) of the two column tiles.
inline void amx_configure(int rows) {
  TileConfig cfg;
  const int low = std::min(rows, 16), high = std::max(rows - 16, 1);
  for (int t : {0, 1, 4}) cfg.rows[t] = static_cast<uint8_t>(low);
  for (int t : {2, 3, 5}) cfg.rows[t] = static_cast<uint8_t>(high);
  for (int t : {6, 7}) cfg.rows[t] = 16;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// One 16x16 float32 C tile (in c, row stride 16) -> bf16 rows of y, + bias in float32.
inline void amx_emit(const float* c, int rows, uint16_t* y, int64_t ldy, const uint16_t* bias) {
  const __m512 b = bias == nullptr ? _mm512_setzero_ps() : bf16x16_to_f32(bias);
  for (int r = 0; r < rows; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + r * 16), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

constexpr int kPrefetchTiles = 4;  // B tiles fetched ahead of use (measured best of 2/4/8)

inline void prefetch_tile(const uint16_t* tile) {
  for (int line = 0; line < 16; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(tile) + line * 64, _MM_HINT_T0);
}

// Each thread takes whole pairs of column tiles and runs every 32-row chunk of x through them
// while their weights stay in its cache: the weights are read from memory once per call, x
// (small) from cache once per pair.
void amx_linear(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias,
                uint16_t* y, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
  const int64_t col_tiles = n / 16, k_steps = k / 32, pairs = (col_tiles + 1) / 2;
#pragma omp parallel num_threads(num_threads) if (pairs > 1)
  {
    alignas(64) float c[16 * 16];
    int configured = 0;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; ++p) {
      for (int64_t r0 = 0; r0 < m; r0 += 32) {
        const int rows = static_cast<int>(std::min<int64_t>(m - r0, 32));
        const int low = std::min(rows, 16);
        if (rows != configured) {
          amx_configure(rows);
          configured = rows;
        }
        const uint16_t* xa = x + r0 * ldx;
        uint16_t* ya = y + r0 * ldy;
        const int64_t j = 2 * p;
        const bool two = j + 1 < col_tiles;
        const uint16_t* b0 = w + j * k_steps * 512;
        const uint16_t* b1 = b0 + k_steps * 512;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kk = 0; kk < k_steps; ++kk) {
          if (kk + kPrefetchTiles < k_steps) {
            prefetch_tile(b0 + (kk + kPrefetchTiles) * 512);
            if (two) prefetch_tile(b1 + (kk + kPrefetchTiles) * 512);
          }
          _tile_loadd(4, xa + kk * 32, ldx * 2);
          if (rows > 16) _tile_loadd(5, xa + 16 * ldx + kk * 32, ldx * 2);
          _tile_loadd(6, b0 + kk * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (rows > 16) _tile_dpbf16ps(2, 5, 6);
          if (two) {
            _tile_loadd(7, b1 + kk * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (rows > 16) _tile_dpbf16ps(3, 5, 7);
          }
        }
        const uint16_t* bias0 = bias == nullptr ? nullptr : bias + j * 16;
        const uint16_t* bias1 = bias == nullptr ? nullptr : bias + j * 16 + 16;
        _tile_stored(0, c, 64);
        amx_emit(c, low, ya + j * 16, ldy, bias0);
        if (two) {
          _tile_stored(1, c, 64);
          amx_emit(c, low, ya + j * 16 + 16, ldy, bias1);
        }
        if (rows > 16) {
          _tile_stored(2, c, 64);
          amx_emit(c, rows - 16, ya + 16 * ldy + j * 16, ldy, bias0);
          if (two) {
            _tile_stored(3, c, 64);
            amx_emit(c, rows - 16, ya + 16 * ldy + j * 16 + 16, ldy, bias1);
          }
        }
      }
    }
    if (configured != 0) _tile_release();
  }
}


#endif  // KVABI_HAVE_AMX

// ---- Prefill attention (bf16) on AMX tiles or AVX512-BF16 dot products ----
// One sequence's chunk of queries against its keys: q [tq, num_heads, D] (row stride
// q_stride), k and v [tk, num_kv_heads, D] (row strides k_stride, v_stride), heads and D
// contiguous in a row; query i sits at position tk - tq + i and sees keys 0 .. tk - tq + i.
// out [tq, num_heads, D] contiguous. As torch's flash attention does for bf16: S = Q K^T with
// bf16 products summed in float32, scaled and soft-maxed in float32, P rounded to bf16 for
// O = P V (float32 sums), O divided by the row sum and rounded once. (The one difference: P is
// taken against the row's final maximum, not a running one.) K and V are first repacked per KV
// head into a pair-interleaved ("VNNI") order that both engines read: the AMX tiles take 16x16
// blocks of it whole, the dot products one 64-byte row (16 columns x a pair) at a time.
#if defined(__AVX512BF16__)
struct PrefillKV {
  int64_t key_blocks, key_pairs;
  int k_steps, dim_tiles;
  std::vector<uint16_t> kt;  // per KV head, per 16 keys, per 32 dims: [16 dim pairs][16 keys][2]
  std::vector<uint16_t> vt;  // per KV head, per 32 keys, per 16 dims: [16 key pairs][16 dims][2]
  const uint16_t* k_tiles(int64_t h, int64_t b) const {
    return kt.data() + (h * key_blocks + b) * k_steps * 512;
  }
  const uint16_t* v_tiles(int64_t h, int64_t kp) const {
    return vt.data() + (h * key_pairs + kp) * dim_tiles * 512;
  }
};

void prefill_pack(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride,
                  int64_t tk, int num_kv_heads, int dim, PrefillKV& kv, int num_threads) {
  const int64_t key_blocks = (tk + 15) / 16, key_pairs = (tk + 31) / 32;
  const int k_steps = dim / 32, dim_tiles = dim / 16;
  kv.key_blocks = key_blocks, kv.key_pairs = key_pairs, kv.k_steps = k_steps;
  kv.dim_tiles = dim_tiles;
  kv.kt.assign(static_cast<size_t>(num_kv_heads) * key_blocks * k_steps * 512, 0);
  kv.vt.assign(static_cast<size_t>(num_kv_heads) * key_pairs * dim_tiles * 512, 0);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t item = 0; item < num_kv_heads * key_pairs; ++item) {
    const int64_t h = item / key_pairs, kp = item % key_pairs;
    // K: each 16-key x 32-dim tile transposed as 16x16 pairs of dims (one gather per row)
    for (int64_t b = 2 * kp; b < std::min(2 * kp + 2, key_blocks); ++b) {
      const int64_t n0 = b * 16, valid = std::min<int64_t>(16, tk - n0);
      const __mmask16 rows = static_cast<__mmask16>((1u << valid) - 1);
      const __m512i index = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                                 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(static_cast<int>(k_stride / 2)));
      for (int st = 0; st < k_steps; ++st) {
        const int* base = reinterpret_cast<const int*>(k + n0 * k_stride + h * dim + st * 32);
        uint16_t* dst = kv.kt.data() + ((h * key_blocks + b) * k_steps + st) * 512;
        for (int pair = 0; pair < 16; ++pair)
          _mm512_storeu_si512(dst + pair * 32, _mm512_mask_i32gather_epi32(
                                                   _mm512_setzero_si512(), rows, index,
                                                   base + pair, 4));
      }
    }
    // V: the rows of keys 2i and 2i+1 interleaved, 16 dims at a time
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t n = kp * 32 + 2 * i;
      for (int t = 0; t < dim_tiles; ++t) {
        auto widen = [&](int64_t key) {
          if (key >= tk) return _mm512_setzero_si512();
          const uint16_t* row = v + key * v_stride + h * dim + t * 16;
          return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
        };
        const __m512i pairs = _mm512_or_si512(widen(n), _mm512_slli_epi32(widen(n + 1), 16));
        _mm512_storeu_si512(kv.vt.data() + ((h * key_pairs + kp) * dim_tiles + t) * 512 + i * 32, pairs);
      }
    }
  }
}

// Row r < rows of a 16-row block sees `first_seen + r` keys: p[r] = bf16(exp(scale * s[r] -
// max)) over those (0 after them, up to pairs * 32) and inv[r] = 1 / their sum; rows past
// `rows` get zeros.
void prefill_softmax(const float* s, int64_t s_ld, uint16_t* p, int64_t p_ld, int rows,
                     int64_t first_seen, int64_t pairs, float scale, float* inv) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int r = 0; r < 16; ++r) {
    uint16_t* pr = p + r * p_ld;
    const int64_t seen = r < rows ? first_seen + r : 0;
    const float* sr = s + r * s_ld;
    auto lanes = [&](int64_t j) {  // the keys j .. j + 15 this row sees
      const int64_t n = std::clamp<int64_t>(seen - j, 0, 16);
      return static_cast<__mmask16>((1u << n) - 1);
    };
    __m512 peak = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < seen; j += 16) {
      const __mmask16 m = lanes(j);
      peak = _mm512_mask_max_ps(peak, m, peak, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sr + j), vscale));
    }
    const __m512 top = _mm512_set1_ps(seen > 0 ? _mm512_reduce_max_ps(peak) : 0.0f);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs * 32; j += 16) {
      const __mmask16 m = lanes(j);
      const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, sr + j), vscale), top);
      const __m512 e = _mm512_maskz_mov_ps(m, exp16(x));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    inv[r] = seen > 0 ? 1.0f / _mm512_reduce_add_ps(sum) : 0.0f;
  }
}

// Each thread takes (head, 16-query block) items: S for the keys the block sees
// (Math::scores), the softmax, then O = P V (Math::values), which writes `rows` rows of out.
template <class Math>
void prefill(const uint16_t* q, int64_t q_stride, const PrefillKV& kv, uint16_t* out,
             int64_t tq, int64_t tk, int num_heads, int num_kv_heads, int dim, float scale,
             int num_threads) {
  const int group = num_heads / num_kv_heads;
  // one row of scores per query, as long as a P row: the softmax's masked loads stay inside
  const int64_t s_ld = kv.key_pairs * 32, p_ld = kv.key_pairs * 32;
  const int64_t q_blocks = (tq + 15) / 16, offset = tk - tq;
#pragma omp parallel num_threads(num_threads)
  {
    Math math;
    std::vector<float> s(static_cast<size_t>(16) * s_ld);
    std::vector<uint16_t> p(static_cast<size_t>(16) * p_ld);
    std::vector<uint16_t> qbuf(static_cast<size_t>(16) * dim);
    float inv[16];
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_heads * q_blocks; ++item) {
      const int64_t head = item / q_blocks, q0 = (item % q_blocks) * 16, kvh = head / group;
      const int rows = static_cast<int>(std::min<int64_t>(16, tq - q0));
      for (int r = 0; r < 16; ++r)
        for (int d = 0; d < dim; ++d)
          qbuf[r * dim + d] = r < rows ? q[(q0 + r) * q_stride + head * dim + d] : 0;
      const int64_t keys = offset + q0 + rows;  // keys the block's last row sees
      const int64_t blocks = (keys + 15) / 16, pairs = (keys + 31) / 32;
      math.scores(qbuf.data(), dim, kv, kvh, blocks, s.data(), s_ld);
      prefill_softmax(s.data(), s_ld, p.data(), p_ld, rows, offset + q0 + 1, pairs, scale, inv);
      math.values(p.data(), p_ld, kv, kvh, pairs, rows, inv,
                  out + (q0 * num_heads + head) * dim, int64_t{num_heads} * dim);
    }
  }
}

inline void emit_scaled(__m512 acc, float inv, uint16_t* o) {
  const __m512 row = _mm512_mul_ps(acc, _mm512_set1_ps(inv));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(row));
}

// S and O by vdpbf16ps: a 64-byte row of a K tile is 16 keys x one pair of dims, of a V tile
// 16 dims x one pair of keys; each is multiplied against the pair of every query row broadcast.
struct DotMath {
  void scores(const uint16_t* qbuf, int dim, const PrefillKV& kv, int64_t kvh, int64_t blocks,
              float* s, int64_t s_ld) const {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* kb = kv.k_tiles(kvh, b);
      __m512 acc[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      for (int st = 0; st < kv.k_steps; ++st)
        for (int pr = 0; pr < 16; ++pr) {
          const __m512bh w = (__m512bh)_mm512_loadu_si512(kb + st * 512 + pr * 32);
          const uint16_t* qp = qbuf + st * 32 + 2 * pr;
#pragma GCC unroll 16
          for (int r = 0; r < 16; ++r) {
            int32_t pair;
            std::memcpy(&pair, qp + r * dim, sizeof pair);
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), w);
          }
        }
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) _mm512_storeu_ps(s + r * s_ld + b * 16, acc[r]);
    }
  }
  void values(const uint16_t* p, int64_t p_ld, const PrefillKV& kv, int64_t kvh, int64_t pairs,
              int rows, const float* inv, uint16_t* out, int64_t out_ld) const {
    for (int t0 = 0; t0 < kv.dim_tiles; t0 += 2)  // dim_tiles is even (dim % 32 == 0)
      for (int r0 = 0; r0 < rows; r0 += 8) {
        __m512 acc[8][2];
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t kp = 0; kp < pairs; ++kp) {
          const uint16_t* vb = kv.v_tiles(kvh, kp) + t0 * 512;
          for (int i = 0; i < 16; ++i) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(vb + i * 32);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(vb + 512 + i * 32);
            const uint16_t* pp = p + r0 * p_ld + kp * 32 + 2 * i;
#pragma GCC unroll 8
            for (int r = 0; r < 8; ++r) {
              int32_t pair;
              std::memcpy(&pair, pp + r * p_ld, sizeof pair);
              const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
              acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
              acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
            }
          }
        }
        for (int r = 0; r < std::min(8, rows - r0); ++r)
          for (int t = 0; t < 2; ++t)
            emit_scaled(acc[r][t], inv[r0 + r], out + (r0 + r) * out_ld + (t0 + t) * 16);
      }
  }
};

#if defined(KVABI_HAVE_AMX)
// S and O on tiles: 16 queries x 16 keys (S) and 16 queries x 16 dims (O) per C tile.
struct AmxMath {
  AmxMath() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
  }
  ~AmxMath() { _tile_release(); }
  AmxMath(const AmxMath&) = delete;
  AmxMath& operator=(const AmxMath&) = delete;
  void scores(const uint16_t* qbuf, int dim, const PrefillKV& kv, int64_t kvh, int64_t blocks,
              float* s, int64_t s_ld) const {
    for (int64_t b = 0; b < blocks; ++b) {
      _tile_zero(6);
      for (int st = 0; st < kv.k_steps; ++st) {
        _tile_loadd(4, qbuf + st * 32, dim * 2);
        _tile_loadd(5, kv.k_tiles(kvh, b) + st * 512, 64);
        _tile_dpbf16ps(6, 4, 5);
      }
      _tile_stored(6, s + b * 16, s_ld * 4);
    }
  }
  void values(const uint16_t* p, int64_t p_ld, const PrefillKV& kv, int64_t kvh, int64_t pairs,
              int rows, const float* inv, uint16_t* out, int64_t out_ld) const {
    alignas(64) float c[16 * 16];
    for (int t0 = 0; t0 < kv.dim_tiles; t0 += 4) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint16_t* vbase = kv.v_tiles(kvh, 0) + t0 * 512;
      for (int64_t b = 0; b < pairs; ++b) {
        const uint16_t* vb = vbase + b * kv.dim_tiles * 512;
        _tile_loadd(4, p + b * 32, p_ld * 2);
        _tile_loadd(5, vb, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (t0 + 1 < kv.dim_tiles) {
          _tile_loadd(5, vb + 512, 64);
          _tile_dpbf16ps(1, 4, 5);
        }
        if (t0 + 2 < kv.dim_tiles) {
          _tile_loadd(5, vb + 1024, 64);
          _tile_dpbf16ps(2, 4, 5);
        }
        if (t0 + 3 < kv.dim_tiles) {
          _tile_loadd(5, vb + 1536, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      for (int t = 0; t < 4 && t0 + t < kv.dim_tiles; ++t) {
        if (t == 0) _tile_stored(0, c, 64);
        if (t == 1) _tile_stored(1, c, 64);
        if (t == 2) _tile_stored(2, c, 64);
        if (t == 3) _tile_stored(3, c, 64);
        for (int r = 0; r < rows; ++r) {
          emit_scaled(_mm512_loadu_ps(c + r * 16), inv[r], out + r * out_ld + (t0 + t) * 16);
        }
      }
    }
  }
};
#endif  // KVABI_HAVE_AMX
#endif  // __AVX512BF16__

// The packed GEMM the process runs: 2 AMX tiles, 1 AVX512-BF16 dot products, 0 none (see
// kvabi_gemm_init).
int g_gemm = 0;

#if defined(KVABI_HAVE_PACKED_GEMM)
inline void linear(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias,
                   uint16_t* y, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
#if defined(KVABI_HAVE_AMX)
  if (g_gemm == 2) return amx_linear(x, ldx, w, bias, y, ldy, m, n, k, num_threads);
#endif
  dot_linear(x, ldx, w, bias, y, ldy, m, n, k, num_threads);
}

// ---- A whole decode step's layers in one call (bf16, the packed GEMM) ----
// The same sequence of operations as LlamaModel's per-layer forward with the kernels and packed
// GEMMs (kvabi/models/llama.py), each with the same arithmetic and roundings, but without a
// return to Python between them: that per-op dispatch cost about as much as the step's GEMMs.
struct DecodeLayer {
  const uint16_t* input_norm;  // [hidden]
  const uint16_t* post_norm;   // [hidden]
  const uint16_t* qkv;         // AMX-packed [q + 2 kv, hidden]
  const uint16_t* qkv_bias;    // [q + 2 kv] or null
  const uint16_t* o;           // AMX-packed [hidden, q]
  const uint16_t* o_bias;
  const uint16_t* gate_up;     // AMX-packed [2 inter, hidden]
  const uint16_t* gate_up_bias;
  const uint16_t* down;        // AMX-packed [hidden, inter]
  const uint16_t* down_bias;
  uint16_t* k_cache;           // this layer's pools (strides in DecodeShape)
  uint16_t* v_cache;
};

struct DecodeShape {
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
  int64_t block_stride, slot_stride, head_stride, block_size;  // K and V pools alike
  float eps;
};

void decode_layers(const DecodeLayer* layers, int64_t num_layers, const DecodeShape& d,
                   uint16_t* x, int64_t rows, const uint16_t* cos, const uint16_t* sin,
                   const int64_t* slot_blocks, const int64_t* slot_offsets,
                   const int64_t* tables, int64_t table_width, const int64_t* context_lens,
                   int num_threads) {
  const int64_t q_size = d.num_heads * d.head_dim, kv_size = d.num_kv_heads * d.head_dim;
  const int64_t qkv_size = q_size + 2 * kv_size, inter = d.intermediate, hidden = d.hidden;
  std::vector<uint16_t> h(rows * hidden), qkv(rows * qkv_size), attn(rows * q_size),
      proj(rows * hidden), gate_up(rows * 2 * inter), act(rows * inter);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.head_dim));
  for (int64_t l = 0; l < num_layers; ++l) {
    const DecodeLayer& w = layers[l];
    rms_norm<uint16_t>(x, hidden, nullptr, w.input_norm, h.data(), rows, hidden, d.eps,
                       num_threads);
    linear(h.data(), hidden, w.qkv, w.qkv_bias, qkv.data(), qkv_size, rows, qkv_size, hidden,
               num_threads);
    rope<uint16_t>(qkv.data(), qkv_size, rows, d.num_heads + d.num_kv_heads, d.head_dim, cos, sin,
                   num_threads);
    for (int64_t r = 0; r < rows; ++r) {  // the new token's K and V into its slot
      const int64_t base = slot_blocks[r] * d.block_stride + slot_offsets[r] * d.slot_stride;
      for (int64_t kh = 0; kh < d.num_kv_heads; ++kh) {
        const uint16_t* k = qkv.data() + r * qkv_size + q_size + kh * d.head_dim;
        std::memcpy(w.k_cache + base + kh * d.head_stride, k, d.head_dim * sizeof(uint16_t));
        std::memcpy(w.v_cache + base + kh * d.head_stride, k + kv_size,
                    d.head_dim * sizeof(uint16_t));
      }
    }
    const Pool pool{w.k_cache, w.v_cache, d.block_stride, d.slot_stride, d.head_stride,
                    d.block_size};
    auto attend_all = [&](auto dim) {
      decode<uint16_t, decltype(dim)::value>(qkv.data(), qkv_size, attn.data(), pool, tables,
                                             table_width, context_lens, rows,
                                             static_cast<int>(d.num_heads),
                                             static_cast<int>(d.num_kv_heads),
                                             static_cast<int>(d.head_dim), scale, num_threads);
    };
    if (d.head_dim == 64)
      attend_all(std::integral_constant<int, 64>{});
    else if (d.head_dim == 128)
      attend_all(std::integral_constant<int, 128>{});
    else
      attend_all(std::integral_constant<int, 0>{});
    linear(attn.data(), q_size, w.o, w.o_bias, proj.data(), hidden, rows, hidden, q_size,
               num_threads);
    // x += attention output; h = norm(x)
    rms_norm<uint16_t>(proj.data(), hidden, x, w.post_norm, h.data(), rows, hidden, d.eps,
                       num_threads);
    linear(h.data(), hidden, w.gate_up, w.gate_up_bias, gate_up.data(), 2 * inter, rows,
               2 * inter, hidden, num_threads);
    silu_and_mul<uint16_t>(gate_up.data(), act.data(), rows, inter, num_threads);
    linear(act.data(), inter, w.down, w.down_bias, proj.data(), hidden, rows, hidden, inter,
               num_threads);
    for (int64_t i = 0; i < rows * hidden; ++i)  // x += MLP output, rounded as torch's add_
      x[i] = bf16_bits(to_f32(x[i]) + to_f32(proj[i]));
  }
}
#endif

// Calls run(std::integral_constant<int, DIM>) with the head size fixed at compile time where
// there is an instance for it (64, 128), else DIM = 0 (read at run time).
template <typename Fn>
void with_dim(int head_dim, Fn run) {
  if (head_dim == 64)
    run(std::integral_constant<int, 64>{});
  else if (head_dim == 128)
    run(std::integral_constant<int, 128>{});
  else
    run(std::integral_constant<int, 0>{});
}

template <typename T>
int dispatch(const T* q, T* out, const Pool& pool, const int64_t* tables, int64_t table_width,
             const int64_t* context_lens, int64_t num_seqs, int num_heads, int num_kv_heads,
             int head_dim, float scale, int num_threads) {
  with_dim(head_dim, [&](auto dim) {
    decode<T, decltype(dim)::value>(q, int64_t{num_heads} * head_dim, out, pool, tables,
                                    table_width, context_lens, num_seqs,
                                    num_heads, num_kv_heads, head_dim, scale, num_threads);
  });
  return 0;
}

// The loop kvabi_paged_decode runs for (dtype, head_dim, group = heads per KV head), by the
// same choices `dispatch` and `decode` make: 2 the AVX512-BF16 instance (bf16), 1 the generic
// loop with the head size fixed at compile time, 0 the generic loop reading it at run time.
int paged_decode_variant(int dtype, int head_dim, int group) {
  int variant = 0;
  with_dim(head_dim, [&](auto dim) {
    constexpr int kDim = decltype(dim)::value;
    if constexpr (kDim > 0) variant = dtype == 1 && fast_attend<kDim>(group) != nullptr ? 2 : 1;
  });
  return variant;
}

// MLA decode over vLLM's fp8_ds_mla records, read in place through the block tables. A record
// (656 bytes) holds 512 fp8 e4m3 latent values, 4 float32 scales (one per 128-value tile) and
// 64 bf16 RoPE values (kvabi/abi/ds_mla_record.py). Absorbed attention, one key head:
//   q      [num_seqs, num_heads, 576] float32, contiguous (q_nope through W_UK, then q_pe)
//   out    [num_seqs, num_heads, 512] float32
//   score(t) = scale * (sum_i tile_scale_i * sum_{j in tile i} q[j] e4m3(r[j]) + q_pe . rope)
//   out = sum_t softmax(score)_t * latent_t, latent_t[j] = e4m3(r[j]) * tile_scale[j / 128]
// Each tile is dequantised on the fly (its scale applied once per tile, not per value).
// An e4m3fn byte's value, in arithmetic the compiler vectorizes: a normal one's
// exponent rebased into float32's; a subnormal one, m * 2^-9, as 2^-6 (1 + m/8) - 2^-6 (exact;
// an integer-to-float conversion there kept the loop scalar, 10x slower); the sign bit last.
inline float e4m3_value(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  const float normal = __builtin_bit_cast(float, ((e + 120u) << 23) | (m << 20));
  const float low = __builtin_bit_cast(float, (121u << 23) | (m << 20)) - 0x1p-6f;
  const float v = (b & 0x7fu) == 0x7fu ? __builtin_nanf("") : (e == 0 ? low : normal);
  return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, v) | ((b & 0x80u) << 24));
}

struct E4m3Table {  // e4m3_value of every byte, for loops that look a byte up
  float value[256];
  E4m3Table() {
    for (uint32_t b = 0; b < 256; ++b) value[b] = e4m3_value(b);
  }
};
const E4m3Table kE4m3;

constexpr int kDsLatent = 512, kDsTile = 128, kDsRope = 64, kDsScales = 512, kDsRopeAt = 528;

void mla_decode_records(const float* q, float* out, const uint8_t* records,
                        int64_t block_stride, int64_t slot_stride, int64_t block_size,
                        const int64_t* tables, int64_t table_width, const int64_t* lens,
                        int64_t num_seqs, int num_heads, float scale, int num_threads) {
  const int64_t q_width = kDsLatent + kDsRope;
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads)
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int h = 0; h < num_heads; ++h) {
      const float* qh = q + (s * num_heads + h) * q_width;
      float* o = out + (s * num_heads + h) * kDsLatent;
      const int64_t len = lens[s];
      const int64_t* table = tables + s * table_width;
      auto record = [&](int64_t t) {
        return records + table[t / block_size] * block_stride + (t % block_size) * slot_stride;
      };
      std::vector<float> scores(len);
      float top = -INFINITY;
      for (int64_t t = 0; t < len; ++t) {
        const uint8_t* r = record(t);
        float tile_scale[4];
        std::memcpy(tile_scale, r + kDsScales, sizeof tile_scale);
        float acc = 0.0f;
        for (int i = 0; i < 4; ++i) {
          float part = 0.0f;
#pragma omp simd reduction(+ : part)
          for (int j = 0; j < kDsTile; ++j) part += qh[i * kDsTile + j] * kE4m3.value[r[i * kDsTile + j]];
          acc += tile_scale[i] * part;
        }
        uint16_t rope[kDsRope];
        std::memcpy(rope, r + kDsRopeAt, sizeof rope);
        for (int j = 0; j < kDsRope; ++j) acc += qh[kDsLatent + j] * to_f32(rope[j]);
        scores[t] = acc * scale;
        top = std::max(top, scores[t]);
      }
      float sum = 0.0f;
      for (int64_t t = 0; t < len; ++t) sum += (scores[t] = std::exp(scores[t] - top));
      std::fill(o, o + kDsLatent, 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const uint8_t* r = record(t);
        float tile_scale[4];
        std::memcpy(tile_scale, r + kDsScales, sizeof tile_scale);
        for (int i = 0; i < 4; ++i) {
          const float w = scores[t] / sum * tile_scale[i];
#pragma omp simd
          for (int j = 0; j < kDsTile; ++j) o[i * kDsTile + j] += w * kE4m3.value[r[i * kDsTile + j]];
        }
      }
    }
  }
}


// ---- Strided copies of whole views in one call (conversions between layouts) ----
// Each copy: dst and src byte addresses, `nd` outer dims (up to kCopyDims) of one shape with
// their byte strides in each, and an innermost row contiguous in both, moved by `op`:
//   kCopyBytes     `row` bytes as they are;
//   kBf16ToE4m3    `row` bf16 values -> fp8 e4m3fn bytes of x / scale, saturated at +-448, as
//                  torch's `(x / scale).clamp(-448, 448).to(float8_e4m3fn)` on a bf16 x (the
//                  quotient rounded to bf16 first; e4m3 by round to nearest even);
//   kBf16ToInt8Row `row` bf16 values -> `row` int8 and the row's float32 scale after them, as
//                  kvabi's per-token-head codec in bf16 (codec.py): scale = bf16(amax / 127)
//                  (1 for an all-zero row), q = round-half-even(bf16(x / scale)) in +-127;
//   kBf16ToF32     `row` bf16 values -> float32 (exact);
//   kInt8RowToBf16 the reverse of kBf16ToInt8Row: `row` int8 values and their float32 scale
//                  after them -> bf16 of q * scale (codec.py's decode in float32, then torch's
//                  cast: nearest even);
//   kE4m3ToBf16    the reverse of kBf16ToE4m3: `row` fp8 e4m3fn bytes -> bf16 of e4m3 * scale.
// A NaN stays a NaN (its bf16 bits may differ from torch's, whose own vector and scalar casts
// differ there too).
// All the copies' (copy, index along its first dim) items are shared out over the threads in
// one parallel region; within an item the other dims advance the pointers (no division per row).
constexpr int kCopyDims = 5;
enum RowOp : int64_t {
  kCopyBytes = 0,
  kBf16ToE4m3 = 1,
  kBf16ToInt8Row = 2,
  kBf16ToF32 = 3,
  kInt8RowToBf16 = 4,
  kE4m3ToBf16 = 5,
};
struct CopySpec {
  int64_t dst, src, nd, shape[kCopyDims], dst_stride[kCopyDims], src_stride[kCopyDims], row;
  int64_t op;
  float scale;  // kBf16ToE4m3's divisor
  int32_t pad;
};

inline void copy_row(char* d, const char* s, int64_t row) {
#if defined(__AVX512F__)
  if (row % 64 == 0) {
    for (int64_t b = 0; b < row; b += 64)
      _mm512_storeu_si512(d + b, _mm512_loadu_si512(s + b));
    return;
  }
#endif
  std::memcpy(d, s, row);
}

// |a| <= 448 (or NaN) -> the e4m3fn bits of its magnitude, round to nearest even; branch-free
// so that the row loop vectorizes.
inline uint32_t e4m3_magnitude(float a) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, a);
  const uint32_t rounded = bits + 0x7ffffu + ((bits >> 20) & 1u);  // 3 mantissa bits kept
  const uint32_t normal = ((((rounded >> 23) - 120u) << 3) | ((rounded >> 20) & 7u)) & 0x7fu;
  // below 2^-6: multiples of 2^-9, rounded to nearest even by the 1.5 * 2^23 trick
  const uint32_t sub = static_cast<uint32_t>((a * 512.0f + 12582912.0f) - 12582912.0f);
  const uint32_t q = a < 0.015625f ? sub : normal;
  return a != a ? 0x7fu : q;
}

void bf16_to_e4m3_row(uint8_t* d, const uint16_t* s, int64_t n, float scale) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float x = to_f32(s[i]);
    if (scale != 1.0f) x = rnd<uint16_t>(x / scale);
    x = std::min(std::max(x, -448.0f), 448.0f);
    const uint32_t sign = (__builtin_bit_cast(uint32_t, x) >> 24) & 0x80u;
    d[i] = static_cast<uint8_t>(sign | e4m3_magnitude(std::fabs(x)));
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// rnd<uint16_t> of 16 lanes: round to nearest even, a NaN quieted (as bf16_bits)
inline __m512 rnd_bf16x16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x), high = _mm512_set1_epi32(0xffff0000);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb);
  const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, bias), high);
  const __m512i quiet = _mm512_or_si512(_mm512_and_si512(bits, high), _mm512_set1_epi32(0x400000));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

// A row of n (% 16 == 0) bf16 values -> int8 round-half-even(bf16(x / scale)) in +-127, then
// the scale after them (kvabi's per_token_head codec).
inline void quantise_int8_row16(int8_t* d, const uint16_t* s, int64_t n, float scale) {
  const __m512 vs = _mm512_set1_ps(scale), magic = _mm512_set1_ps(12582912.0f);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 q = rnd_bf16x16(_mm512_div_ps(bf16x16_to_f32(s + i), vs));
    const __m512 r = _mm512_sub_ps(_mm512_add_ps(q, magic), magic);  // round half to even
    const __m512 c = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(c)));
  }
  std::memcpy(d + n, &scale, sizeof scale);
}

// bf16_to_int8_row for rows of 16k values, 16 lanes at a time (the same arithmetic: the
// compiler's loops spent more on the row's reduction and scale than on its values)
void bf16_to_int8_row16(int8_t* d, const uint16_t* s, int64_t n) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16)  // max(x, amax): a NaN value is skipped, as std::max does
    amax = _mm512_max_ps(_mm512_abs_ps(bf16x16_to_f32(s + i)), amax);
  const float a = _mm512_reduce_max_ps(amax);
  quantise_int8_row16(d, s, n, a > 0.0f ? rnd<uint16_t>(a / 127.0f) : 1.0f);
}

// bf16_to_int8_row16 on 16 rows at once (d[r], s[r]; n % 16 == 0), the same arithmetic: the
// 16 rows' maxima reduced together (max16) and their scales in one vector, instead of a
// horizontal reduction and a scalar division per row (1.6x on 64-value rows).
void bf16_to_int8_rows16(int8_t* const* d, const uint16_t* const* s, int64_t n) {
  __m512 peaks[16];
  for (int r = 0; r < 16; ++r) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16)
      amax = _mm512_max_ps(_mm512_abs_ps(bf16x16_to_f32(s[r] + i)), amax);
    peaks[r] = amax;
  }
  const __m512 a = max16(peaks);
  const __mmask16 positive = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __m512 quotient = rnd_bf16x16(_mm512_div_ps(a, _mm512_set1_ps(127.0f)));
  alignas(64) float scales[16];
  _mm512_store_ps(scales, _mm512_mask_blend_ps(positive, _mm512_set1_ps(1.0f), quotient));
  for (int r = 0; r < 16; ++r) quantise_int8_row16(d[r], s[r], n, scales[r]);
}
#define KVABI_HAVE_INT8_ROWS16 1
#endif

void bf16_to_int8_row(int8_t* d, const uint16_t* s, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (n % 16 == 0) return bf16_to_int8_row16(d, s, n);
#endif
  float amax = 0.0f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(to_f32(s[i])));
  const float scale = amax > 0.0f ? rnd<uint16_t>(amax / 127.0f) : 1.0f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float q = rnd<uint16_t>(to_f32(s[i]) / scale);
    const float r = (q + 12582912.0f) - 12582912.0f;  // round half to even (|q| < 2^22)
    d[i] = static_cast<int8_t>(std::min(std::max(r, -127.0f), 127.0f));
  }
  std::memcpy(d + n, &scale, sizeof scale);
}

void bf16_to_f32_row(float* d, const uint16_t* s, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = to_f32(s[i]);
}

void int8_row_to_bf16(uint16_t* d, const int8_t* s, int64_t n) {
  float scale;
  std::memcpy(&scale, s + n, sizeof scale);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = bf16_bits(static_cast<float>(s[i]) * scale);
}

void e4m3_row_to_bf16(uint16_t* d, const uint8_t* s, int64_t n, float scale) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = bf16_bits(e4m3_value(s[i]) * scale);
}

inline void move_row(char* d, const char* s, const CopySpec& sp) {
  if (sp.op == kCopyBytes)
    copy_row(d, s, sp.row);
  else if (sp.op == kBf16ToF32)
    bf16_to_f32_row(reinterpret_cast<float*>(d), reinterpret_cast<const uint16_t*>(s), sp.row);
  else if (sp.op == kBf16ToE4m3)
    bf16_to_e4m3_row(reinterpret_cast<uint8_t*>(d), reinterpret_cast<const uint16_t*>(s), sp.row,
                     sp.scale);
  else if (sp.op == kInt8RowToBf16)
    int8_row_to_bf16(reinterpret_cast<uint16_t*>(d), reinterpret_cast<const int8_t*>(s), sp.row);
  else  // kE4m3ToBf16 (kBf16ToInt8Row rows go through Int8Rows)
    e4m3_row_to_bf16(reinterpret_cast<uint16_t*>(d), reinterpret_cast<const uint8_t*>(s), sp.row,
                     sp.scale);
}

// int8 rows waiting to be quantised 16 at a time (bf16_to_int8_rows16), across the copies'
// items a thread takes; the last few, or rows of another length, one by one.
struct Int8Rows {
  int8_t* d[16];
  const uint16_t* s[16];
  int pending = 0;
  int64_t n = 0;
  void add(char* dst, const char* src, int64_t values) {
    if (pending > 0 && values != n) flush();
    n = values;
    d[pending] = reinterpret_cast<int8_t*>(dst);
    s[pending] = reinterpret_cast<const uint16_t*>(src);
    if (++pending == 16) {
#if defined(KVABI_HAVE_INT8_ROWS16)
      if (n % 16 == 0) {
        bf16_to_int8_rows16(d, s, n);
        pending = 0;
        return;
      }
#endif
      flush();
    }
  }
  void flush() {
    for (int r = 0; r < pending; ++r) bf16_to_int8_row(d[r], s[r], n);
    pending = 0;
  }
};

void copy_views(const CopySpec* specs, int64_t count, int num_threads) {
  std::vector<int64_t> first(count + 1, 0);  // the item where each copy's items begin
  for (int64_t c = 0; c < count; ++c) first[c + 1] = first[c] + specs[c].shape[0];
#pragma omp parallel num_threads(num_threads) if (first[count] > 1)
  {
    Int8Rows int8_rows;  // a static schedule gives each thread one run of consecutive items
#pragma omp for schedule(static)
    for (int64_t item = 0; item < first[count]; ++item) {
      const int64_t c = std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1;
      const CopySpec& sp = specs[c];
      const int64_t i0 = item - first[c];
      char* d = reinterpret_cast<char*>(sp.dst) + i0 * sp.dst_stride[0];
      const char* s = reinterpret_cast<const char*>(sp.src) + i0 * sp.src_stride[0];
      int64_t idx[kCopyDims] = {};
      int64_t rows = 1;
      for (int i = 1; i < sp.nd; ++i) rows *= sp.shape[i];
      for (int64_t r = 0; r < rows; ++r) {
        if (sp.op == kBf16ToInt8Row)
          int8_rows.add(d, s, sp.row);
        else
          move_row(d, s, sp);
        for (int i = static_cast<int>(sp.nd) - 1; i >= 1; --i) {  // odometer over dims 1..nd-1
          d += sp.dst_stride[i];
          s += sp.src_stride[i];
          if (++idx[i] < sp.shape[i]) break;
          d -= sp.dst_stride[i] * sp.shape[i];
          s -= sp.src_stride[i] * sp.shape[i];
          idx[i] = 0;
        }
      }
    }
    int8_rows.flush();
  }
}
}  // namespace

extern "C" {
// specs: `count` CopySpec (see copy_views). Returns 0, -1 for a spec it cannot take.
int kvabi_copy_views(const void* specs, int64_t count, int num_threads) {
  const auto* sp = static_cast<const CopySpec*>(specs);
  for (int64_t c = 0; c < count; ++c)
    if (sp[c].nd < 1 || sp[c].nd > kCopyDims || sp[c].row < 1 || sp[c].op < 0 || sp[c].op > 5)
      return -1;
  copy_views(sp, count, num_threads);
  return 0;
}

// MLA decode over fp8_ds_mla records (above); returns 0.
int kvabi_mla_decode_records(const void* q, void* out, const void* records, int64_t block_stride,
                             int64_t slot_stride, int64_t block_size, const int64_t* tables,
                             int64_t table_width, const int64_t* lens, int64_t num_seqs,
                             int num_heads, float scale, int num_threads) {
  mla_decode_records(static_cast<const float*>(q), static_cast<float*>(out),
                     static_cast<const uint8_t*>(records), block_stride, slot_stride, block_size,
                     tables, table_width, lens, num_seqs, num_heads, scale, num_threads);
  return 0;
}

int kvabi_paged_decode_variant(int dtype, int head_dim, int group) {
  return paged_decode_variant(dtype, head_dim, group);
}

// How many parts the bf16 decode splits each (sequence, KV head)'s keys into (attend_parts).
int64_t kvabi_attend_parts(int64_t work, int64_t longest, int num_threads) {
  return attend_parts(work, longest, num_threads);
}

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
// Chooses the packed GEMM this process runs and returns it: 2 the AMX tiles where built with
// them, allowed (allow_amx) and granted the tile state (Linux asks each process to request it),
// else 1 the AVX512-BF16 dot products where built with them, else 0 (none).
int kvabi_gemm_init(int allow_amx) {
  g_gemm = 0;
#if defined(KVABI_HAVE_PACKED_GEMM)
  g_gemm = 1;
#endif
#if defined(KVABI_HAVE_AMX) && defined(__linux__)
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (allow_amx && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0) g_gemm = 2;
#endif
  (void)allow_amx;
  return g_gemm;
}

// bf16 only: x [m, k] (row stride ldx), w packed (see amx_linear), bias [n] or null, y [m, n]
// (row stride ldy); k % 32 == 0, n % 16 == 0. Returns 0, -1 for bad sizes, -2 without a packed
// GEMM (kvabi_gemm_init).
int kvabi_packed_linear(const void* x, int64_t ldx, const void* w, const void* bias, void* y,
                        int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
  if (k % 32 != 0 || n % 16 != 0 || m < 0) return -1;
#if defined(KVABI_HAVE_PACKED_GEMM)
  if (g_gemm == 0) return -2;
  linear(static_cast<const uint16_t*>(x), ldx, static_cast<const uint16_t*>(w),
         static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), ldy, m, n, k, num_threads);
  return 0;
#else
  (void)x, (void)ldx, (void)w, (void)bias, (void)y, (void)ldy, (void)num_threads;
  return -2;
#endif
}
// The decode step's layers (see decode_layers); layers: num_layers DecodeLayer, shape: one
// DecodeShape. Returns 0, -1 for sizes the packed GEMM cannot take, -2 without one.
int kvabi_decode_layers(const void* layers, int64_t num_layers, const void* shape, void* x,
                        int64_t rows, const void* cos, const void* sin,
                        const int64_t* slot_blocks, const int64_t* slot_offsets,
                        const int64_t* tables, int64_t table_width, const int64_t* context_lens,
                        int num_threads) {
#if defined(KVABI_HAVE_PACKED_GEMM)
  if (g_gemm == 0) return -2;
  const DecodeShape& d = *static_cast<const DecodeShape*>(shape);
  const int64_t q_size = d.num_heads * d.head_dim, kv_size = d.num_kv_heads * d.head_dim;
  if (d.num_kv_heads < 1 || d.hidden % 32 || q_size % 32 || d.intermediate % 32 ||
      kv_size % 16 || d.num_heads % d.num_kv_heads)
    return -1;
  decode_layers(static_cast<const DecodeLayer*>(layers), num_layers, d,
                static_cast<uint16_t*>(x), rows, static_cast<const uint16_t*>(cos),
                static_cast<const uint16_t*>(sin), slot_blocks, slot_offsets, tables, table_width,
                context_lens, num_threads);
  return 0;
#else
  (void)layers, (void)num_layers, (void)shape, (void)x, (void)rows, (void)cos, (void)sin;
  (void)slot_blocks, (void)slot_offsets, (void)tables, (void)table_width, (void)context_lens;
  (void)num_threads;
  return -2;
#endif
}
// bf16 causal attention of one sequence's chunk (see amx_prefill): head_dim % 32 == 0,
// num_heads % num_kv_heads == 0, 0 < tq <= tk. Returns 0, -1 for such sizes, -2 without AMX.
int kvabi_prefill_attention(const void* q, int64_t q_stride, const void* k, int64_t k_stride,
                            const void* v, int64_t v_stride, void* out, int64_t tq, int64_t tk,
                            int num_heads, int num_kv_heads, int head_dim, float scale,
                            int num_threads) {
  if (head_dim % 32 || num_kv_heads < 1 || num_heads % num_kv_heads || tq < 1 || tq > tk ||
      k_stride % 2)  // K rows are gathered as pairs of bf16
    return -1;
#if defined(__AVX512BF16__)
  if (g_gemm == 0) return -2;
  PrefillKV kv;
  prefill_pack(static_cast<const uint16_t*>(k), k_stride, static_cast<const uint16_t*>(v),
               v_stride, tk, num_kv_heads, head_dim, kv, num_threads);
  const auto* qq = static_cast<const uint16_t*>(q);
  auto* o = static_cast<uint16_t*>(out);
#if defined(KVABI_HAVE_AMX)
  if (g_gemm == 2) {
    prefill<AmxMath>(qq, q_stride, kv, o, tq, tk, num_heads, num_kv_heads, head_dim, scale,
                     num_threads);
    return 0;
  }
#endif
  prefill<DotMath>(qq, q_stride, kv, o, tq, tk, num_heads, num_kv_heads, head_dim, scale,
                   num_threads);
  return 0;
#else
  (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)out;
  (void)scale, (void)num_threads;
  return -2;
#endif
}

}

namespace {
// XXH3-64 with seed 0 (the ABI's checksum, docs/ABI.md), written from xxHash's published
// specification (doc/xxhash_spec.md): small (0-16 bytes), medium (17-240) and large inputs.
// tests/native/test_xxh3.py compares it with the `xxhash` package at every length up to a few
// blocks and on entries. Used to checksum tier entries without the GIL, many at once.
constexpr uint64_t kP32_1 = 0x9E3779B1ULL, kP32_2 = 0x85EBCA77ULL, kP32_3 = 0xC2B2AE3DULL;
constexpr uint64_t kP64_1 = 0x9E3779B185EBCA87ULL, kP64_2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kP64_3 = 0x165667B19E3779F9ULL, kP64_4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t kP64_5 = 0x27D4EB2F165667C5ULL, kMx1 = 0x165667919E3779F9ULL;
constexpr uint64_t kMx2 = 0x9FB21C651E98DF25ULL;
constexpr int64_t kSecretLen = 192, kStripe = 64, kStripesPerBlock = (kSecretLen - 64) / 8;
constexpr int64_t kBlock = kStripe * kStripesPerBlock;  // 1024
alignas(64) constexpr uint8_t kSecret[kSecretLen] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

inline uint64_t rd64(const uint8_t* p) {  // little-endian (x86)
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t fold128(uint64_t a, uint64_t b) {
  const unsigned __int128 m = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(m) ^ static_cast<uint64_t>(m >> 64);
}
inline uint64_t avalanche3(uint64_t x) {
  x ^= x >> 37;
  x *= kMx1;
  return x ^ (x >> 32);
}
inline uint64_t avalanche64(uint64_t x) {
  x ^= x >> 33;
  x *= kP64_2;
  x ^= x >> 29;
  x *= kP64_3;
  return x ^ (x >> 32);
}
inline uint64_t mix16(const uint8_t* d, const uint8_t* s) {
  return fold128(rd64(d) ^ rd64(s), rd64(d + 8) ^ rd64(s + 8));
}

uint64_t xxh3_short(const uint8_t* in, uint64_t len) {  // 0-240 bytes
  const uint8_t* S = kSecret;
  if (len == 0) return avalanche64(rd64(S + 56) ^ rd64(S + 64));
  if (len <= 3) {
    const uint32_t c = static_cast<uint32_t>(in[len - 1]) | static_cast<uint32_t>(len << 8) |
                       (static_cast<uint32_t>(in[0]) << 16) |
                       (static_cast<uint32_t>(in[len >> 1]) << 24);
    return avalanche64(static_cast<uint64_t>(rd32(S) ^ rd32(S + 4)) ^ c);
  }
  if (len <= 8) {
    const uint64_t c = rd32(in + len - 4) | (static_cast<uint64_t>(rd32(in)) << 32);
    uint64_t v = (rd64(S + 8) ^ rd64(S + 16)) ^ c;
    v ^= rotl64(v, 49) ^ rotl64(v, 24);
    v *= kMx2;
    v ^= (v >> 35) + len;
    v *= kMx2;
    return v ^ (v >> 28);
  }
  if (len <= 16) {
    const uint64_t lo = (rd64(S + 24) ^ rd64(S + 32)) ^ rd64(in);
    const uint64_t hi = (rd64(S + 40) ^ rd64(S + 48)) ^ rd64(in + len - 8);
    return avalanche3(len + __builtin_bswap64(lo) + hi + fold128(lo, hi));
  }
  uint64_t acc = len * kP64_1;
  if (len <= 128) {
    const uint64_t rounds = ((len - 1) >> 5) + 1;
    for (uint64_t i = 0; i < rounds; ++i) {
      acc += mix16(in + 16 * i, S + 32 * i);
      acc += mix16(in + len - 16 * i - 16, S + 32 * i + 16);
    }
    return avalanche3(acc);
  }
  for (uint64_t i = 0; i < 8; ++i) acc += mix16(in + 16 * i, S + 16 * i);
  acc = avalanche3(acc);
  for (uint64_t i = 8; i < (len >> 4); ++i) acc += mix16(in + 16 * i, S + 16 * (i - 8) + 3);
  acc += mix16(in + len - 16, S + 119);
  return avalanche3(acc);
}

struct Xxh3Acc {
  alignas(64) uint64_t a[8] = {kP32_3, kP64_1, kP64_2, kP64_3, kP64_4, kP32_2, kP64_5, kP32_1};

  // `count` stripes from `in`, stripe n with the secret at `secret + 8 * n`: lane i gets
  // lo32(x) * hi32(x) of x = input ^ secret, lane i ^ 1 the input's lane i
  void stripes(const uint8_t* in, int64_t count, const uint8_t* secret) {
#if defined(__AVX512F__)
    __m512i acc = _mm512_load_si512(a);
    for (int64_t n = 0; n < count; ++n) {
      const __m512i v = _mm512_loadu_si512(in + n * kStripe);
      const __m512i x = _mm512_xor_si512(v, _mm512_loadu_si512(secret + 8 * n));
      const __m512i product = _mm512_mul_epu32(x, _mm512_srli_epi64(x, 32));
      acc = _mm512_add_epi64(acc, _mm512_add_epi64(product, _mm512_shuffle_epi32(v, _MM_PERM_BADC)));
    }
    _mm512_store_si512(a, acc);
#elif defined(__AVX2__)
    __m256i acc0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(a));
    __m256i acc1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(a + 4));
    for (int64_t n = 0; n < count; ++n) {
      const uint8_t* p = in + n * kStripe;
      const uint8_t* k = secret + 8 * n;
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
      const __m256i x0 = _mm256_xor_si256(v0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k)));
      const __m256i x1 = _mm256_xor_si256(v1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + 32)));
      acc0 = _mm256_add_epi64(acc0, _mm256_add_epi64(_mm256_mul_epu32(x0, _mm256_srli_epi64(x0, 32)),
                                                     _mm256_shuffle_epi32(v0, 0x4E)));
      acc1 = _mm256_add_epi64(acc1, _mm256_add_epi64(_mm256_mul_epu32(x1, _mm256_srli_epi64(x1, 32)),
                                                     _mm256_shuffle_epi32(v1, 0x4E)));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(a), acc0);
    _mm256_store_si256(reinterpret_cast<__m256i*>(a + 4), acc1);
#else
    for (int64_t n = 0; n < count; ++n) accumulate(in + n * kStripe, secret + 8 * n);
#endif
  }
  void accumulate(const uint8_t* stripe, const uint8_t* secret) {
    for (int i = 0; i < 8; ++i) {
      const uint64_t v = rd64(stripe + 8 * i), x = v ^ rd64(secret + 8 * i);
      a[i ^ 1] += v;
      a[i] += (x & 0xFFFFFFFFULL) * (x >> 32);
    }
  }
  void round(const uint8_t* block) {
    stripes(block, kStripesPerBlock, kSecret);
    for (int i = 0; i < 8; ++i) {
      a[i] ^= a[i] >> 47;
      a[i] ^= rd64(kSecret + kSecretLen - 64 + 8 * i);
      a[i] *= kP32_1;
    }
  }
  // The rest of the input after whole rounds: `len` (1..1024) bytes at `rest`; the input's
  // last 64 bytes at `last`; `total` its length.
  uint64_t finish(const uint8_t* rest, int64_t len, const uint8_t* last, uint64_t total) {
    stripes(rest, (len - 1) / kStripe, kSecret);
    stripes(last, 1, kSecret + kSecretLen - 71);
    uint64_t r = total * kP64_1;
    for (int i = 0; i < 4; ++i)
      r += fold128(a[2 * i] ^ rd64(kSecret + 11 + 16 * i), a[2 * i + 1] ^ rd64(kSecret + 19 + 16 * i));
    return avalanche3(r);
  }
};

uint64_t xxh3_64(const uint8_t* in, int64_t len) {
  if (len <= 240) return xxh3_short(in, static_cast<uint64_t>(len));
  Xxh3Acc acc;
  int64_t at = 0;
  for (; len - at > kBlock; at += kBlock) acc.round(in + at);
  return acc.finish(in + at, len - at, in + len - kStripe, static_cast<uint64_t>(len));
}

// XXH3-64 of `a` (at most 1024 bytes) followed by `b`, without joining them (a section's
// checksum covers its header's first bytes, then its payload).
uint64_t xxh3_64_pair(const uint8_t* a, int64_t alen, const uint8_t* b, int64_t blen) {
  const int64_t total = alen + blen;
  if (total <= 2 * kBlock) {
    uint8_t joined[2 * kBlock];
    std::memcpy(joined, a, alen);
    std::memcpy(joined + alen, b, blen);
    return xxh3_64(joined, total);
  }
  alignas(64) uint8_t first[kBlock];  // the first round's block: all of `a`, then `b`'s start
  std::memcpy(first, a, alen);
  std::memcpy(first + alen, b, kBlock - alen);
  Xxh3Acc acc;
  acc.round(first);
  const uint8_t* in = b + (kBlock - alen);  // the input from byte kBlock on
  const int64_t len = total - kBlock;       // > kBlock
  int64_t at = 0;
  for (; len - at > kBlock; at += kBlock) acc.round(in + at);
  return acc.finish(in + at, len - at, b + blen - kStripe, static_cast<uint64_t>(total));
}

// Where a tier entry's checksums lie (kvabi/wire/entries.py `EntryShape`): the meta checksum
// over bytes [0, meta_len); section j's over its `head_len` header bytes at heads[j], then its
// payload_lens[j] payload bytes at payloads[j]; the end checksum over the section checksums.
struct EntrySpans {
  int64_t meta_len, sections, head_len;
  const int64_t *heads, *payloads, *payload_lens;
};

bool spans_fit(const EntrySpans& sp, int64_t size) {
  if (sp.sections < 0 || sp.head_len < 0 || sp.head_len > kBlock || sp.meta_len < 0 ||
      sp.meta_len > size)
    return false;
  for (int64_t j = 0; j < sp.sections; ++j)
    if (sp.heads[j] < 0 || sp.heads[j] + sp.head_len > size || sp.payloads[j] < 0 ||
        sp.payload_lens[j] < 0 || sp.payloads[j] + sp.payload_lens[j] > size)
      return false;
  return true;
}

// checksum j of an entry's row: 0 the meta, 1 + k section k's
inline uint64_t span_checksum(const uint8_t* row, const EntrySpans& sp, int64_t j) {
  if (j == 0) return xxh3_64(row, sp.meta_len);
  return xxh3_64_pair(row + sp.heads[j - 1], sp.head_len, row + sp.payloads[j - 1],
                      sp.payload_lens[j - 1]);
}

// the end checksum, over the little-endian section checksums sums[1..sections]
inline void seal_sum(uint64_t* sums, int64_t sections) {
  sums[sections + 1] = xxh3_64(reinterpret_cast<const uint8_t*>(sums + 1), 8 * sections);
}
}  // namespace

extern "C" {
// XXH3-64 (seed 0) of `len` bytes; for tests/native/test_xxh3.py.
uint64_t kvabi_xxh3_64(const void* data, int64_t len) {
  return xxh3_64(static_cast<const uint8_t*>(data), len);
}

// The checksums of `n` tier entries (kvabi/wire/entries.py), row i at rows + i * size: per
// entry, out[i][0] over bytes [0, meta_len), out[i][1 + j] over section j's `head_len` header
// bytes at heads[j] then its payload_lens[j] bytes at payloads[j], out[i][sections + 1] over
// those section checksums (little-endian u64 each). Items shared out over `num_threads`.
int kvabi_entry_checksums(const uint8_t* rows, int64_t n, int64_t size, const EntrySpans* spans,
                          uint64_t* out, int num_threads) {
  if (n < 0 || !spans_fit(*spans, size)) return -1;
  const int64_t sections = spans->sections, width = sections + 2, items = n * (sections + 1);
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 4) if (items > 8)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t i = item / (sections + 1), j = item % (sections + 1);
    out[i * width + j] = span_checksum(rows + i * size, *spans, j);
  }
  for (int64_t i = 0; i < n; ++i) seal_sum(out + i * width, sections);
  return 0;
}

#if defined(__linux__)
// The disk tier's bulk read (kvabi/cache/disk_tier.py), called without the GIL: file i of
// `count` (NUL-terminated paths) read into dst + i * size, at most `size` bytes, and stamped
// with `now_ns` (access and modification time: the tier's LRU order lives in them). got[i]:
// the bytes read, or -errno where the file could not be opened or read. With `spans`, a file
// read whole is checksummed as an entry (kvabi_entry_checksums) into sums[i] at once, while
// its bytes are still in this core's cache. Files are shared out over `num_threads` threads;
// every file is attempted (the caller takes the leading ones).
int kvabi_read_files(const char* const* paths, int64_t count, uint8_t* dst, int64_t size,
                     int64_t now_ns, int64_t* got, const EntrySpans* spans, uint64_t* sums,
                     int num_threads) {
  if (count < 0 || size < 1 || (spans != nullptr && !spans_fit(*spans, size))) return -1;
  const struct timespec now[2] = {{now_ns / 1000000000, now_ns % 1000000000},
                                  {now_ns / 1000000000, now_ns % 1000000000}};
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (count > 1)
  for (int64_t i = 0; i < count; ++i) {
    const int fd = open(paths[i], O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      got[i] = -errno;
      continue;
    }
    uint8_t* out = dst + i * size;
    int64_t n = 0;
    while (n < size) {
      const ssize_t r = read(fd, out + n, static_cast<size_t>(size - n));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        n = r < 0 ? -errno : n;
        break;
      }
      n += r;
    }
    if (n >= 0) futimens(fd, now);
    close(fd);
    got[i] = n;
    if (spans != nullptr && n == size) {
      uint64_t* row_sums = sums + i * (spans->sections + 2);
      for (int64_t j = 0; j <= spans->sections; ++j) row_sums[j] = span_checksum(out, *spans, j);
      seal_sum(row_sums, spans->sections);
    }
  }
  return 0;
}
#endif
}

namespace {
// Transposing copies of 2-byte elements (kvabi/abi/view_copy.py `transpose_spec`): for every
// index of the outer dims, a tile of `rows` x `cols` elements where element (r, c) lies at
// src + r * src_row_stride + 2c (the source's columns contiguous) and at dst + 2r +
// c * dst_col_stride (the destination's rows contiguous): vLLM's CPU K^T [D][N] against
// token-major blocks, in either direction.
constexpr int kTransposeDims = 4;
struct TransposeSpec {
  int64_t dst, src, nd, shape[kTransposeDims], dst_stride[kTransposeDims],
      src_stride[kTransposeDims];
  int64_t rows, cols, src_row_stride, dst_col_stride;
};

inline void transpose_scalar(const uint8_t* s, uint8_t* d, const TransposeSpec& sp, int64_t r0,
                             int64_t r1, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t r = r0; r < r1; ++r)
      std::memcpy(d + 2 * r + c * sp.dst_col_stride, s + r * sp.src_row_stride + 2 * c, 2);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 rows x up to 32 columns (`cols` 16 or 32): the rows' 16 dwords (column pairs) transposed
// as a 16 x 16 dword matrix, each result split into its column pair's two rows of 16.
inline void transpose_tile16(const uint8_t* s, int64_t s_row, uint8_t* d, int64_t d_col, int cols) {
  const __mmask16 mask = cols == 32 ? 0xFFFF : 0x00FF;
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_epi32(mask, s + i * s_row);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
  for (int j = 0; j < cols / 2; ++j) {  // r[j]: column pair j of the 16 rows
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 2 * j * d_col), _mm512_cvtepi32_epi16(r[j]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + (2 * j + 1) * d_col),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(r[j], 16)));
  }
}
#endif

void transpose_tile(const uint8_t* s, uint8_t* d, const TransposeSpec& sp) {
  int64_t r = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (; r + 16 <= sp.rows; r += 16) {
    int64_t c = 0;
    for (; c + 16 <= sp.cols; c += c + 32 <= sp.cols ? 32 : 16)
      transpose_tile16(s + r * sp.src_row_stride + 2 * c, sp.src_row_stride,
                       d + 2 * r + c * sp.dst_col_stride, sp.dst_col_stride,
                       c + 32 <= sp.cols ? 32 : 16);
    transpose_scalar(s, d, sp, r, r + 16, c, sp.cols);
  }
#endif
  transpose_scalar(s, d, sp, r, sp.rows, 0, sp.cols);
}

void transpose_views(const TransposeSpec* specs, int64_t count, int num_threads) {
  std::vector<int64_t> first(count + 1, 0);  // the item where each copy's outer indices begin
  for (int64_t c = 0; c < count; ++c) {
    int64_t n = 1;
    for (int i = 0; i < specs[c].nd; ++i) n *= specs[c].shape[i];
    first[c + 1] = first[c] + n;
  }
#pragma omp parallel for num_threads(num_threads) schedule(static) if (first[count] > 1)
  for (int64_t item = 0; item < first[count]; ++item) {
    const int64_t c = std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1;
    const TransposeSpec& sp = specs[c];
    int64_t rest = item - first[c], d = sp.dst, s = sp.src;
    for (int i = static_cast<int>(sp.nd) - 1; i >= 0; --i) {
      const int64_t at = rest % sp.shape[i];
      rest /= sp.shape[i];
      d += at * sp.dst_stride[i];
      s += at * sp.src_stride[i];
    }
    transpose_tile(reinterpret_cast<const uint8_t*>(s), reinterpret_cast<uint8_t*>(d), sp);
  }
}
}  // namespace

extern "C" {
// specs: `count` TransposeSpec (see transpose_views). Returns 0, -1 for a spec it cannot take.
int kvabi_transpose_views(const void* specs, int64_t count, int num_threads) {
  const auto* sp = static_cast<const TransposeSpec*>(specs);
  for (int64_t c = 0; c < count; ++c)
    if (sp[c].nd < 0 || sp[c].nd > kTransposeDims || sp[c].rows < 1 || sp[c].cols < 1)
      return -1;
  transpose_views(sp, count, num_threads);
  return 0;
}

// 1 where the transposing copies run 16 x 32 tiles in AVX-512 registers, 0 where element by
// element (a build without AVX-512 BW).
int kvabi_transpose_is_vectorized() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return 1;
#else
  return 0;
#endif
}
}
