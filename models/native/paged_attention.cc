// Paged decode attention for XLA:CPU, called through jax.ffi (see models/native_attention.py).
//
// One query token per slot against the pages its block table names, read in place from
// the whole [L, P, page_size, K, H] pool: no gathered copy of the context, no transpose,
// no padded width. XLA:CPU's code for the jnp reference spends most of a decode step
// gathering pages into a [B, S, K, H] copy; this reads each
// token's keys and values once, every kv head together (one contiguous K*H row each).
//
// Same semantics as models/attention.py:paged_attention: keys at index >= length are
// masked; float32 scores and softmax; a page id outside the pool is read as jnp's
// gather reads it (a negative one counted from the end, then clamped into the pool), so
// the kernel never reads outside the pool and always agrees with the reference.
//
// Two bodies: on a CPU with AVX-512 (head dims 32/64/128), one pass per slot with an
// online softmax and 16 scores summed at once (AttendSlots512); elsewhere, scores, then
// softmax, then values, in loops the compiler vectorizes (AttendSlotsT). Both ask for the
// next page row by row while computing this one (tests/test_native_attention.py builds
// the portable body on an AVX-512 machine too).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

using namespace jaxpd_native;  // NOLINT: this file's helpers

// The lines of one row of floats: a page's next row is asked for while this one is
// computed, spread over the page, where a burst of requests at a page's start would stall.
inline void PrefetchRow(const float* row, int64_t floats) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < floats * 4; i += 64) __builtin_prefetch(p + i);
}

// Calls visit(t, n, row) for every token t < len and query head n, `row` being the H
// values of n's kv head at t: pages in order, then the tokens of a page (no division
// per token or head), all kv heads of a token together (one contiguous K*H row).
template <typename Visit>
inline void WalkContext(const float* pool, const int32_t* table, int64_t len,
                        int64_t page_size, int64_t K, int64_t G, int64_t H, Visit&& visit) {
  for (int64_t t0 = 0; t0 < len; t0 += page_size) {
    const float* page = pool + static_cast<int64_t>(table[t0 / page_size]) * page_size * K * H;
    const float* next = t0 + page_size < len
        ? pool + static_cast<int64_t>(table[t0 / page_size + 1]) * page_size * K * H : nullptr;
    for (int64_t t = t0; t < std::min(len, t0 + page_size); ++t) {
      const float* rows = page + (t - t0) * K * H;
      if (next != nullptr) PrefetchRow(next + (t - t0) * K * H, K * H);
      for (int64_t k = 0; k < K; ++k)
        for (int64_t g = 0; g < G; ++g) visit(t, k * G + g, rows + k * H);
    }
  }
}

struct Problem {
  const float* q;            // [B, N, H]
  const float* k;            // this layer's [P, page_size, K, H]
  const float* v;
  const int32_t* tables;     // [B, W]
  const int32_t* lengths;    // [B]
  float* out;                // [B, N, H]
  int64_t N, H, P, page_size, K, W;
  float scale;
};

// Slots [begin, end). Per slot, every kv head at once: one token's keys (or values) of
// all K heads are one contiguous K*H row, and a page is page_size such rows, so the
// context is read once, in order.
template <int64_t kH>
void AttendSlotsT(const Problem& pr, int64_t begin, int64_t end) {
  const int64_t H = kH > 0 ? kH : pr.H;
  const int64_t N = pr.N, page_size = pr.page_size, K = pr.K, W = pr.W, G = N / K;
  const int64_t T = W * page_size;
  std::vector<float> scores(static_cast<size_t>(N * T));   // [n, t]: softmax rows contiguous
  std::vector<float> acc(static_cast<size_t>(N * H));
  std::vector<int32_t> table(static_cast<size_t>(W));
  for (int64_t b = begin; b < end; ++b) {
    const int64_t len = std::min<int64_t>(pr.lengths[b], T);
    float* o = pr.out + b * N * H;
    if (len <= 0) {                                    // an empty slot: its output is unused
      std::fill(o, o + N * H, 0.0f);
      continue;
    }
    for (int64_t p = 0; p < W; ++p) {                  // as jnp's gather reads an index
      const int64_t id = pr.tables[b * W + p];
      table[p] = static_cast<int32_t>(std::clamp<int64_t>(id < 0 ? id + pr.P : id, 0,
                                                           pr.P - 1));
    }
    const float* qb = pr.q + b * N * H;
    WalkContext(pr.k, table.data(), len, page_size, K, G, H,
                [&](int64_t t, int64_t n, const float* key) {
      const float* qn = qb + n * H;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t h = 0; h < H; ++h) dot += qn[h] * key[h];
      scores[n * T + t] = dot * pr.scale;
    });
    for (int64_t n = 0; n < N; ++n) {
      float* row = scores.data() + n * T;
      float m = -INFINITY;
#pragma omp simd reduction(max : m)
      for (int64_t t = 0; t < len; ++t) m = std::max(m, row[t]);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < len; ++t) {
        row[t] = ExpNonPositive(row[t] - m);
        sum += row[t];
      }
      const float inv = 1.0f / sum;
#pragma omp simd
      for (int64_t t = 0; t < len; ++t) row[t] *= inv;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    WalkContext(pr.v, table.data(), len, page_size, K, G, H,
                [&](int64_t t, int64_t n, const float* val) {
      const float w = scores[n * T + t];
      float* a = acc.data() + n * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) a[h] += w * val[h];
    });
    std::copy(acc.begin(), acc.end(), o);
  }
}

#if defined(__AVX512F__)
// Sixteen 16-lane vectors in, one out: the sum of each input's lanes, token t's at lane
// lanes[t] (TokenLanes). A transpose-and-add tree: 15 adds and 30 shuffles, where 16
// horizontal sums take about 64 of each.
inline __m512 SumEach16(__m512 p[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)       // [p0[0:8] + p0[8:16], p1[0:8] + p1[8:16]]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)       // four tokens, four partial sums each
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)       // eight tokens, two partial sums each
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]),
                         _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x44), _mm512_shuffle_ps(c[0], c[1], 0xEE));
}

// idx[t] = the lane where SumEach16 leaves input t's sum, found by running it once.
inline __m512i TokenLanes() {
  __m512 p[16];
  for (int t = 0; t < 16; ++t) p[t] = _mm512_set1_ps(static_cast<float>(t));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, SumEach16(p));
  alignas(64) int32_t idx[16];
  for (int j = 0; j < 16; ++j) idx[static_cast<int>(lanes[j]) / 16] = j;
  return _mm512_load_si512(idx);
}

// AVX-512: one pass over the context, 16 tokens at a time, a page's keys and values
// together: 16 scores per head by SumEach16, an online softmax (a running max and sum per
// head, the accumulator rescaled when the max grows), values added into per-head
// accumulators held as kH / 16 vectors. The next page is asked for a slice per head, so
// the requests spread over the page's work (a burst of requests at a page's start
// stalls the core).
template <int64_t kH>
void AttendSlots512(const Problem& pr, int64_t begin, int64_t end) {
  constexpr int64_t V = kH / 16;
  const int64_t N = pr.N, page_size = pr.page_size, K = pr.K, W = pr.W, G = N / K;
  const int64_t T = W * page_size, KH = K * kH;
  static const __m512i lanes = TokenLanes();
  std::vector<__m512> q(static_cast<size_t>(N * V)), acc(static_cast<size_t>(N * V));
  std::vector<float> m(N), l(N);
  std::vector<float> wts(static_cast<size_t>(N * 16));
  std::vector<int32_t> table(static_cast<size_t>(W));
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t len = std::min<int64_t>(pr.lengths[b], T);
    float* o = pr.out + b * N * kH;
    if (len <= 0) {
      std::fill(o, o + N * kH, 0.0f);
      continue;
    }
    for (int64_t p = 0; p < W; ++p) {
      const int64_t id = pr.tables[b * W + p];
      table[p] = static_cast<int32_t>(std::clamp<int64_t>(id < 0 ? id + pr.P : id, 0,
                                                           pr.P - 1));
    }
    const __m512 scale = _mm512_set1_ps(pr.scale);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 0; j < V; ++j) {
        q[n * V + j] = _mm512_mul_ps(_mm512_loadu_ps(pr.q + (b * N + n) * kH + 16 * j), scale);
        acc[n * V + j] = _mm512_setzero_ps();
      }
      m[n] = -INFINITY;
      l[n] = 0.0f;
    }
    for (int64_t t0 = 0; t0 < len; t0 += page_size) {
      const int64_t page_off = static_cast<int64_t>(table[t0 / page_size]) * page_size * KH;
      const char* next_k = nullptr;
      const char* next_v = nullptr;
      if (t0 + page_size < len) {
        const int64_t next = static_cast<int64_t>(table[t0 / page_size + 1]) * page_size * KH;
        next_k = reinterpret_cast<const char*>(pr.k + next);
        next_v = reinterpret_cast<const char*>(pr.v + next);
      }
      const int64_t page_bytes = page_size * KH * 4;
      const int64_t chunks = (page_size + 15) / 16;
      const int64_t step_bytes = ((page_bytes + chunks * N - 1) / (chunks * N) + 63) / 64 * 64;
      int64_t fetched = 0;
      for (int64_t c0 = 0; c0 < page_size && t0 + c0 < len; c0 += 16) {
        const int64_t c = std::min<int64_t>({16, page_size - c0, len - t0 - c0});
        const float* keys = pr.k + page_off + c0 * KH;
        const float* vals = pr.v + page_off + c0 * KH;
        const __mmask16 live = static_cast<__mmask16>((1u << c) - 1u);
        for (int64_t n = 0; n < N; ++n) {
          const float* kn = keys + (n / G) * kH;
          if (next_k != nullptr) {
            for (int64_t i = fetched; i < std::min(page_bytes, fetched + step_bytes); i += 64) {
              __builtin_prefetch(next_k + i);
              __builtin_prefetch(next_v + i);
            }
            fetched += step_bytes;
          }
          __m512 part[16];
          for (int64_t t = 0; t < 16; ++t) {
            if (t >= c) { part[t] = _mm512_setzero_ps(); continue; }
            __m512 s = _mm512_mul_ps(q[n * V], _mm512_loadu_ps(kn + t * KH));
            for (int64_t j = 1; j < V; ++j)
              s = _mm512_fmadd_ps(q[n * V + j], _mm512_loadu_ps(kn + t * KH + 16 * j), s);
            part[t] = s;
          }
          const __m512 s = _mm512_mask_blend_ps(
              live, neg_inf, _mm512_permutexvar_ps(lanes, SumEach16(part)));
          const float m_new = std::max(m[n], _mm512_reduce_max_ps(s));
          const float corr = ExpNonPositive(m[n] - m_new);
          const __m512 pw =
              _mm512_maskz_mov_ps(live, Exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
          l[n] = l[n] * corr + _mm512_reduce_add_ps(pw);
          m[n] = m_new;
          _mm512_storeu_ps(wts.data() + n * 16, pw);
          const __m512 cv = _mm512_set1_ps(corr);
          for (int64_t j = 0; j < V; ++j) acc[n * V + j] = _mm512_mul_ps(acc[n * V + j], cv);
        }
        for (int64_t n = 0; n < N; ++n) {
          const float* vn = vals + (n / G) * kH;
          const float* wn = wts.data() + n * 16;
          __m512 a[V];
          for (int64_t j = 0; j < V; ++j) a[j] = acc[n * V + j];
          for (int64_t t = 0; t < c; ++t) {
            const __m512 wt = _mm512_set1_ps(wn[t]);
            for (int64_t j = 0; j < V; ++j)
              a[j] = _mm512_fmadd_ps(wt, _mm512_loadu_ps(vn + t * KH + 16 * j), a[j]);
          }
          for (int64_t j = 0; j < V; ++j) acc[n * V + j] = a[j];
        }
      }
    }
    for (int64_t n = 0; n < N; ++n) {
      const __m512 inv = _mm512_set1_ps(1.0f / l[n]);
      for (int64_t j = 0; j < V; ++j)
        _mm512_storeu_ps(o + n * kH + 16 * j, _mm512_mul_ps(acc[n * V + j], inv));
    }
  }
}
#endif

// The head dims of common models known at compile time, so the inner loops unroll
// (12% on the portable kernel at H = 32); any other H runs the portable general loop.
void AttendSlots(const Problem& pr, int64_t begin, int64_t end) {
  switch (pr.H) {
#if defined(__AVX512F__)
    case 32: return AttendSlots512<32>(pr, begin, end);
    case 64: return AttendSlots512<64>(pr, begin, end);
    case 128: return AttendSlots512<128>(pr, begin, end);
#else
    case 32: return AttendSlotsT<32>(pr, begin, end);
    case 64: return AttendSlotsT<64>(pr, begin, end);
    case 128: return AttendSlotsT<128>(pr, begin, end);
#endif
    default: return AttendSlotsT<0>(pr, begin, end);
  }
}

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q_BNH,
                       ffi::Buffer<ffi::F32> k_pool, ffi::Buffer<ffi::F32> v_pool,
                       ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> lengths,
                       ffi::Buffer<ffi::S32> layer_index, ffi::ResultBuffer<ffi::F32> out_BNH) {
  const auto qd = q_BNH.dimensions();
  const auto pd = k_pool.dimensions();
  const auto td = block_tables.dimensions();
  if (qd.size() != 3 || pd.size() != 5 || td.size() != 2 || lengths.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("paged_decode: q [B,N,H], pools [L,P,page_size,K,H], "
                                       "block_tables [B,W], lengths [B]");
  // The layer is an operand, not an attribute: a scan over layers passes its counter.
  if (layer_index.element_count() != 1)
    return ffi::Error::InvalidArgument("paged_decode: layer must be one int32");
  const int64_t layer = layer_index.typed_data()[0];
  const int64_t B = qd[0], N = qd[1], H = qd[2];
  const int64_t L = pd[0], P = pd[1], page_size = pd[2], K = pd[3];
  if (pd[4] != H || td[0] != B || lengths.dimensions()[0] != B || K == 0 || N % K != 0 ||
      P < 1 || page_size < 1 || layer < 0 || layer >= L ||
      !std::equal(pd.begin(), pd.end(), v_pool.dimensions().begin(), v_pool.dimensions().end()))
    return ffi::Error::InvalidArgument("paged_decode: inconsistent shapes or layer");
  const int64_t layer_size = P * page_size * K * H;
  const Problem pr{q_BNH.typed_data(), k_pool.typed_data() + layer * layer_size,
                   v_pool.typed_data() + layer * layer_size, block_tables.typed_data(),
                   lengths.typed_data(), out_BNH->typed_data(), N, H, P, page_size, K, td[1],
                   1.0f / std::sqrt(static_cast<float>(H))};
  // Two chunks of slots per thread: a thread that finishes early takes another.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunk = std::max<int64_t>(1, (B + 2 * threads - 1) / (2 * threads));
  RunTasks(pool, B == 0 ? 0 : (B + chunk - 1) / chunk, [pr, chunk, B](int64_t c) {
    AttendSlots(pr, c * chunk, std::min(B, (c + 1) * chunk));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpdPagedDecodeF32, PagedDecode,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // q [B, N, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // k pool [L,P,S,K,H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // v pool
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // block tables [B,W]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // lengths [B]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // layer []
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // out [B, N, H]
