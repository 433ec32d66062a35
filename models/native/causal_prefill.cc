// Causal attention over a whole prompt for XLA:CPU, called through jax.ffi (see
// models/native_attention.py): the `prefix`-less `models/attention.py:causal_attention`,
// q [B, T, N, H] against k, v [B, T, K, H] (N = K * G query heads) -> [B, T, N, H];
// and the same after a cached prefix read in place from the paged pool (a prefill with
// context, `Llama.extend`): row b's queries first see the prefix_len[b] keys of the
// pages prefix_tables[b] in layer `layer` of the [L, P, page_size, K, H] pools, then
// their own causal keys, in one online softmax. Only a row's real prefix is read (no
// gathered copy, no padded width, no score matrix). A page id outside the pool is read
// as jnp's gather reads it (negative from the end, then clamped), so the kernel never
// reads outside the pool and agrees with the reference.
//
// Flash-attention's order on a CPU, as two small matrix products per block of 64 keys:
// a task takes 16-64 query positions of one kv head and stacks the G query heads
// sharing it as the rows of one tile (so each key and value vector read serves all);
// for each key block it computes the rows' scores in register tiles (6 rows x 64 keys),
// takes each row's online-softmax step over the whole block there (one max, one
// rescale, a vectorized exp), then adds the probabilities times the values into the
// rows' accumulators in register tiles (24 vectors: 6 rows at head dim 64), never a
// [T, T] score matrix. Each task reads only the keys up to its own last position, and
// the causal mask costs lane compares only on the block that crosses a row's position.
// Keys are first transposed into blocks of [H, 16] so that 16 scores are one vector per
// head dim. Built for AVX-512 only: on other CPUs the library has no such symbol and
// prefill stays on the jnp reference (XLA:CPU's own code for it).
// Float32 scores and softmax; keys after a row's position are masked, as the reference's
// causal mask does (padding sits after the real tokens, so no row sees it).
#if defined(__AVX512F__)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "common.h"

namespace {

using namespace jaxpd_native;  // NOLINT: this file's helpers

struct Free {
  void operator()(float* p) const { std::free(p); }
};

// Keys per block. A task's query positions (`Prompt::tile`) divide it, so a task's last
// key block starts at or before its first position: every row sees a key of every block.
constexpr int64_t kKeys = 64;
constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.693147180559945309f;

// 2^x for the lanes that are kept (x <= 0 there; others may be anything, even inf or
// nan, and are masked off by the caller): x = n + y with |y| <= 1/2, 2^y = e^(y ln2) by
// its Taylor series to the 6th power (relative error below 3e-7), scaled by 2^n.
inline __m512 Exp2(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 y = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.54035304e-4f);                 // ln2^6 / 6!
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.33335581e-3f));  // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(9.61812911e-3f));  // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(5.55041087e-2f));  // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(2.40226507e-1f));  // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(kLn2));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

constexpr int64_t RoundUp(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

template <typename T>
void* RoundUpPointer(T* p) {
  return reinterpret_cast<void*>(RoundUp(reinterpret_cast<intptr_t>(p), 64));
}

using Buffer = std::unique_ptr<float[], Free>;

float* Allocate(Buffer& buffer, int64_t floats) {
  const size_t bytes = static_cast<size_t>(RoundUp(std::max<int64_t>(floats, 16), 16)) *
                       sizeof(float);
  buffer.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
  return buffer.get();
}

struct Prompt {
  const float* q;   // [B, T, N, H]
  const float* k;   // [B, T, K, H]
  const float* v;
  float* out;       // [B, T, N, H]
  float* kt;        // [B, K, T / 16 (rounded up), H, 16]: keys transposed per block of 16
  int64_t B, T, N, K, H, blocks;
  // Query positions per task: about 100 rows with the G heads stacked, so that a key
  // and value block read from beyond L2 (a long prompt's) serves many rows.
  int64_t tile;
  float scale;       // the softmax's 1 / sqrt(H), times log2(e): scores in powers of 2
  // The cached prefix (all null / 0 without one): this layer's [P, page_size, K, H]
  // pools, each row's [W] page ids and prefix length (at most W * page_size).
  const float* kp = nullptr;
  const float* vp = nullptr;
  const int32_t* tables = nullptr;
  const int32_t* plen = nullptr;
  float* pkt = nullptr;   // [B, K, pblocks, H, 16]: prefix keys transposed per block of 16
  int64_t P = 0, page_size = 1, W = 0, pblocks = 0;

  int64_t PrefixLen(int64_t b) const {
    return plen == nullptr ? 0 : std::clamp<int64_t>(plen[b], 0, W * page_size);
  }
  // Row j of kv head kh of row b's prefix in a pool (`kp` or `vp`).
  const float* PrefixRow(const float* pool, int64_t b, int64_t j, int64_t kh) const {
    int64_t page = tables[b * W + j / page_size];
    if (page < 0) page += P;
    page = std::clamp<int64_t>(page, 0, P - 1);
    return pool + ((page * page_size + j % page_size) * K + kh) * H;
  }
};

template <int64_t kH>
void TransposeKeys(const Prompt& pr, int64_t b, int64_t kh) {
  for (int64_t kb = 0; kb < pr.blocks; ++kb) {
    float* dst = pr.kt + ((b * pr.K + kh) * pr.blocks + kb) * kH * 16;
    for (int64_t jj = 0; jj < 16; ++jj) {
      const int64_t j = kb * 16 + jj;
      const float* src = pr.k + ((b * pr.T + std::min(j, pr.T - 1)) * pr.K + kh) * kH;
      for (int64_t h = 0; h < kH; ++h) dst[h * 16 + jj] = src[h];
    }
  }
  const int64_t plen = pr.PrefixLen(b);
  for (int64_t kb = 0; kb * 16 < RoundUp(plen, kKeys); ++kb) {
    float* dst = pr.pkt + ((b * pr.K + kh) * pr.pblocks + kb) * kH * 16;
    for (int64_t jj = 0; jj < 16; ++jj) {
      const float* src = pr.PrefixRow(pr.kp, b, std::min(kb * 16 + jj, plen - 1), kh);
      for (int64_t h = 0; h < kH; ++h) dst[h * 16 + jj] = src[h];
    }
  }
}

// What one task keeps of its rows between key blocks: the scaled queries, each row's
// running max, sum and accumulated values, and the current block's probabilities.
struct Rows {
  const float* q;     // [rows, H]: the queries times the softmax's scale
  float* p;           // [rows, kKeys]: this key block's probabilities
  float* o;           // [rows, H]: values weighted so far (not yet divided by l)
  float* m;           // [rows] running max of the scores (in powers of 2)
  float* l;           // [rows, 16] running sum of 2^(score - m), per lane till the end
  float* corr;        // [rows] this block's rescale of o and l
  const int32_t* limit;   // [rows] keys of this block a row sees: lanes < limit
};

// Scores of kR rows r0.. against one block of kKeys transposed keys `kt`, held in
// registers (kR x 4 vectors), then each row's softmax step over the whole block: new
// max, rescale factor, masked probabilities stored to rows.p. Without kMasked every
// row sees every key of the block (no lane compares).
template <int64_t kH, int64_t kR, bool kMasked>
inline void ScoreTile(const Rows& rows, int64_t r0, const float* kt) {
  static_assert(kKeys == 64, "four vectors of 16 keys per row");
  __m512 s[kR][4];
  for (int64_t u = 0; u < kR; ++u)
    for (int64_t c = 0; c < 4; ++c) s[u][c] = _mm512_setzero_ps();
  const float* q = rows.q + r0 * kH;
  for (int64_t h = 0; h < kH; ++h) {
    __m512 kv[4];
    for (int64_t c = 0; c < 4; ++c) kv[c] = _mm512_load_ps(kt + c * kH * 16 + h * 16);
    for (int64_t u = 0; u < kR; ++u) {
      const __m512 qv = _mm512_set1_ps(q[u * kH + h]);
      for (int64_t c = 0; c < 4; ++c) s[u][c] = _mm512_fmadd_ps(qv, kv[c], s[u][c]);
    }
  }
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t u = 0; u < kR; ++u) {
    const int64_t r = r0 + u;
    __mmask16 live[4];
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < 4; ++c) {
      live[c] = kMasked ? _mm512_cmplt_epi32_mask(
                              lane, _mm512_set1_epi32(rows.limit[r] - 16 * static_cast<int32_t>(c)))
                        : static_cast<__mmask16>(0xffff);
      mx = _mm512_mask_max_ps(mx, live[c], mx, s[u][c]);
    }
    const float m_new = std::max(rows.m[r], _mm512_reduce_max_ps(mx));
    float* p = rows.p + r * kKeys;
    if (m_new == -INFINITY) {   // nothing seen yet (no such row is scheduled; kept safe)
      rows.corr[r] = 1.0f;
      for (int64_t c = 0; c < 4; ++c) _mm512_store_ps(p + 16 * c, _mm512_setzero_ps());
      continue;
    }
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < 4; ++c) {
      const __m512 pc = _mm512_maskz_mov_ps(live[c], Exp2(_mm512_sub_ps(s[u][c], mv)));
      sum = _mm512_add_ps(sum, pc);
      _mm512_store_ps(p + 16 * c, pc);
    }
    const float corr = ExpNonPositive((rows.m[r] - m_new) * kLn2);
    rows.corr[r] = corr;
    _mm512_store_ps(rows.l + r * 16, _mm512_fmadd_ps(_mm512_load_ps(rows.l + r * 16),
                                                     _mm512_set1_ps(corr), sum));
    rows.m[r] = m_new;
  }
}

// o = o * corr + p v for kR rows r0.. over `keys` value rows, kR x kV vectors in
// registers, each value vector loaded once for all kR rows.
template <int64_t kV, int64_t kR>
inline void ValueTile(const Rows& rows, int64_t r0, const float* const* vrows, int64_t keys) {
  constexpr int64_t kH = kV * 16;
  __m512 acc[kR][kV];
  for (int64_t u = 0; u < kR; ++u) {
    const __m512 c = _mm512_set1_ps(rows.corr[r0 + u]);
    for (int64_t j = 0; j < kV; ++j)
      acc[u][j] = _mm512_mul_ps(_mm512_load_ps(rows.o + (r0 + u) * kH + 16 * j), c);
  }
  const float* p = rows.p + r0 * kKeys;
  int64_t jj = 0;
  do {   // keys >= 1: a loop without a zero-trip path keeps acc in registers
    __m512 vv[kV];
    for (int64_t j = 0; j < kV; ++j) vv[j] = _mm512_loadu_ps(vrows[jj] + 16 * j);
    for (int64_t u = 0; u < kR; ++u) {
      const __m512 pu = _mm512_set1_ps(p[u * kKeys + jj]);
      for (int64_t j = 0; j < kV; ++j) acc[u][j] = _mm512_fmadd_ps(pu, vv[j], acc[u][j]);
    }
  } while (++jj < keys);
  for (int64_t u = 0; u < kR; ++u)
    for (int64_t j = 0; j < kV; ++j) _mm512_store_ps(rows.o + (r0 + u) * kH + 16 * j, acc[u][j]);
}

// The widest tiles that fit the 32 vector registers (24 accumulators), and the narrower
// ones for the rows left over.
template <int64_t kH, int64_t kR, bool kMasked>
inline void ScoreRows(const Rows& rows, int64_t r0, int64_t count, const float* kt) {
  if constexpr (kR > 1) {
    if (count < kR) return ScoreRows<kH, kR - 1, kMasked>(rows, r0, count, kt);
  }
  ScoreTile<kH, kR, kMasked>(rows, r0, kt);
}

template <int64_t kV, int64_t kR>
inline void ValueRows(const Rows& rows, int64_t r0, int64_t count, const float* const* vrows,
                      int64_t keys) {
  if constexpr (kR > 1) {
    if (count < kR) return ValueRows<kV, kR - 1>(rows, r0, count, vrows, keys);
  }
  ValueTile<kV, kR>(rows, r0, vrows, keys);
}

// One block of kKeys keys (transposed at `kt`, value rows `vrows`, `keys` of them real)
// for all of a task's rows: scores and softmax, then values. `masked`: some row sees
// only part of the block (rows.limit below kKeys).
template <int64_t kH>
void AttendBlock(const Rows& rows, int64_t count, const float* kt, const float* const* vrows,
                 int64_t keys, bool masked) {
  constexpr int64_t kV = kH / 16, kScoreRows = 6, kValueRows = 24 / kV;
  for (int64_t r = 0; r < count; r += kScoreRows)
    if (masked)
      ScoreRows<kH, kScoreRows, true>(rows, r, std::min(kScoreRows, count - r), kt);
    else
      ScoreRows<kH, kScoreRows, false>(rows, r, std::min(kScoreRows, count - r), kt);
  for (int64_t r = 0; r < count; r += kValueRows)
    ValueRows<kV, kValueRows>(rows, r, std::min(kValueRows, count - r), vrows, keys);
}

// Query positions i0 .. i0 + pr.tile - 1 of row b for all G heads of kv head kh, stacked
// as the rows of one tile (position-major: row (i - i0) * G + g), so that each key and
// value vector read serves all of them: the prefix's key blocks, then the own keys up
// to the tile's last position, kKeys at a time.
template <int64_t kH>
void AttendRows(const Prompt& pr, int64_t b, int64_t kh, int64_t i0) {
  const int64_t T = pr.T, K = pr.K, N = pr.N, G = N / K;
  const int64_t positions = std::min(pr.tile, T - i0), count = positions * G;
  Buffer buffer;
  float* base = Allocate(buffer, count * (2 * kH + kKeys + 16 + 3) + kKeys * 2 + 16);
  if (base == nullptr) std::abort();   // tens of KiB; a task has no way to report
  float* qs = base;
  Rows rows{qs, qs + count * kH, qs + count * (kH + kKeys), nullptr, nullptr, nullptr, nullptr};
  rows.l = rows.o + count * kH;
  rows.m = rows.l + count * 16;
  rows.corr = rows.m + count;
  int32_t* limit = reinterpret_cast<int32_t*>(rows.corr + count);
  rows.limit = limit;
  const float** vrows = reinterpret_cast<const float**>(RoundUpPointer(limit + count));
  const __m512 scale = _mm512_set1_ps(pr.scale);
  for (int64_t i = 0; i < positions; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const float* src = pr.q + ((b * T + i0 + i) * N + kh * G + g) * kH;
      float* dst = qs + (i * G + g) * kH;
      for (int64_t j = 0; j < kH; j += 16)
        _mm512_store_ps(dst + j, _mm512_mul_ps(_mm512_loadu_ps(src + j), scale));
    }
  for (int64_t r = 0; r < count; ++r) {
    rows.m[r] = -INFINITY;
    _mm512_store_ps(rows.l + r * 16, _mm512_setzero_ps());
  }
  for (int64_t j = 0; j < count * kH; ++j) rows.o[j] = 0.0f;

  const int64_t plen = pr.PrefixLen(b);
  const float* pkt = pr.pkt + (b * K + kh) * pr.pblocks * kH * 16;
  for (int64_t k0 = 0; k0 < plen; k0 += kKeys) {
    const int64_t keys = std::min(kKeys, plen - k0);
    for (int64_t r = 0; r < count; ++r) limit[r] = static_cast<int32_t>(keys);
    for (int64_t jj = 0; jj < keys; ++jj) vrows[jj] = pr.PrefixRow(pr.vp, b, k0 + jj, kh);
    AttendBlock<kH>(rows, count, pkt + k0 * kH, vrows, keys, keys < kKeys);
  }
  const float* kt = pr.kt + (b * K + kh) * pr.blocks * kH * 16;
  const int64_t end = i0 + positions;   // keys 0 .. end - 1 are seen by some row
  for (int64_t k0 = 0; k0 < end; k0 += kKeys) {
    const int64_t keys = std::min(kKeys, end - k0);
    // keys k0 + lane <= i are visible to position i
    for (int64_t i = 0; i < positions; ++i)
      for (int64_t g = 0; g < G; ++g)
        limit[i * G + g] = static_cast<int32_t>(std::min<int64_t>(kKeys, i0 + i + 1 - k0));
    for (int64_t jj = 0; jj < keys; ++jj) vrows[jj] = pr.v + ((b * T + k0 + jj) * K + kh) * kH;
    AttendBlock<kH>(rows, count, kt + k0 * kH, vrows, keys, k0 + kKeys > i0 + 1);
  }
  for (int64_t i = 0; i < positions; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      float* dst = pr.out + ((b * T + i0 + i) * N + kh * G + g) * kH;
      const float sum = _mm512_reduce_add_ps(_mm512_load_ps(rows.l + r * 16));
      const __m512 inv = _mm512_set1_ps(1.0f / sum);
      for (int64_t j = 0; j < kH; j += 16)
        _mm512_storeu_ps(dst + j, _mm512_mul_ps(_mm512_load_ps(rows.o + r * kH + j), inv));
    }
}

// Tasks of the first phase: transpose (b, kh)'s keys; of the second: pr.tile positions.
void TransposeTask(const Prompt& pr, int64_t task) {
  const int64_t b = task / pr.K, kh = task % pr.K;
  switch (pr.H) {
    case 32: return TransposeKeys<32>(pr, b, kh);
    case 64: return TransposeKeys<64>(pr, b, kh);
    default: return TransposeKeys<128>(pr, b, kh);
  }
}

void AttendTask(const Prompt& pr, int64_t task) {
  const int64_t blocks = (pr.T + pr.tile - 1) / pr.tile;
  // Longest tasks (the last query blocks, of any row and kv head) first: claimed before
  // the short ones, they leave only short ones to even out the threads' ends.
  const int64_t qb = blocks - 1 - task / (pr.B * pr.K), rest = task % (pr.B * pr.K);
  const int64_t kh = rest % pr.K, b = rest / pr.K;
  switch (pr.H) {
    case 32: return AttendRows<32>(pr, b, kh, qb * pr.tile);
    case 64: return AttendRows<64>(pr, b, kh, qb * pr.tile);
    default: return AttendRows<128>(pr, b, kh, qb * pr.tile);
  }
}

// Checks q, k, v and fills `pr`'s prompt fields; an error, or Success.
ffi::Error PromptOf(const char* name, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
                    ffi::Buffer<ffi::F32>& v, ffi::ResultBuffer<ffi::F32>& out, Prompt& pr) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4)
    return ffi::Error::InvalidArgument(std::string(name) + ": q [B,T,N,H], k, v [B,T,K,H]");
  const int64_t B = qd[0], T = qd[1], N = qd[2], H = qd[3], K = kd[2];
  if (kd[0] != B || kd[1] != T || kd[3] != H || K == 0 || N % K != 0 ||
      !std::equal(kd.begin(), kd.end(), v.dimensions().begin(), v.dimensions().end()))
    return ffi::Error::InvalidArgument(std::string(name) + ": inconsistent shapes");
  if (H != 32 && H != 64 && H != 128)
    return ffi::Error::InvalidArgument(std::string(name) + ": head dim 32, 64 or 128");
  pr.q = q.typed_data();
  pr.k = k.typed_data();
  pr.v = v.typed_data();
  pr.out = out->typed_data();
  pr.B = B, pr.T = T, pr.N = N, pr.K = K, pr.H = H, pr.blocks = RoundUp(T, kKeys) / 16;
  const int64_t G = N / K;
  pr.tile = G <= 2 ? 64 : G <= 4 ? 32 : 16;
  pr.scale = kLog2e / std::sqrt(static_cast<float>(H));
  return ffi::Error::Success();
}

ffi::Error Run(ffi::ThreadPool& pool, Prompt pr) {
  if (pr.B == 0 || pr.T == 0) return ffi::Error::Success();
  Buffer kt, pkt;
  pr.kt = Allocate(kt, pr.B * pr.K * pr.blocks * pr.H * 16);
  pr.pkt = Allocate(pkt, pr.B * pr.K * pr.pblocks * pr.H * 16);
  if (pr.kt == nullptr || pr.pkt == nullptr)
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "causal_prefill: out of memory");
  RunTasks(pool, pr.B * pr.K, [pr](int64_t task) { TransposeTask(pr, task); });
  RunTasks(pool, pr.B * pr.K * ((pr.T + pr.tile - 1) / pr.tile),
           [pr](int64_t task) { AttendTask(pr, task); });
  return ffi::Error::Success();
}

ffi::Error CausalPrefill(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                         ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                         ffi::ResultBuffer<ffi::F32> out) {
  Prompt pr{};
  if (auto e = PromptOf("causal_prefill", q, k, v, out, pr); e.failure()) return e;
  return Run(pool, pr);
}

ffi::Error PrefixPrefill(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                         ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                         ffi::Buffer<ffi::F32> k_pool, ffi::Buffer<ffi::F32> v_pool,
                         ffi::Buffer<ffi::S32> prefix_tables, ffi::Buffer<ffi::S32> prefix_len,
                         ffi::Buffer<ffi::S32> layer_index, ffi::ResultBuffer<ffi::F32> out) {
  Prompt pr{};
  if (auto e = PromptOf("prefix_prefill", q, k, v, out, pr); e.failure()) return e;
  const auto pd = k_pool.dimensions(), td = prefix_tables.dimensions();
  if (pd.size() != 5 || td.size() != 2 || prefix_len.dimensions().size() != 1 ||
      layer_index.element_count() != 1)
    return ffi::Error::InvalidArgument("prefix_prefill: pools [L,P,page_size,K,H], "
                                       "prefix_tables [B,W], prefix_len [B], layer []");
  // The layer is an operand, not an attribute: a scan over layers passes its counter.
  const int64_t layer = layer_index.typed_data()[0];
  const int64_t L = pd[0], P = pd[1], page_size = pd[2];
  if (pd[3] != pr.K || pd[4] != pr.H || td[0] != pr.B || prefix_len.dimensions()[0] != pr.B ||
      P < 1 || page_size < 1 || layer < 0 || layer >= L ||
      !std::equal(pd.begin(), pd.end(), v_pool.dimensions().begin(), v_pool.dimensions().end()))
    return ffi::Error::InvalidArgument("prefix_prefill: inconsistent shapes or layer");
  const int64_t layer_size = P * page_size * pr.K * pr.H;
  pr.kp = k_pool.typed_data() + layer * layer_size;
  pr.vp = v_pool.typed_data() + layer * layer_size;
  pr.tables = prefix_tables.typed_data();
  pr.plen = prefix_len.typed_data();
  pr.P = P, pr.page_size = page_size, pr.W = td[1];
  pr.pblocks = RoundUp(pr.W * page_size, kKeys) / 16;
  return Run(pool, pr);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpdCausalPrefillF32, CausalPrefill,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // q [B, T, N, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // k [B, T, K, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // v [B, T, K, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // out [B, T, N, H]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpdPrefixPrefillF32, PrefixPrefill,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // q [B, T, N, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // k [B, T, K, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // v [B, T, K, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // k pool [L,P,S,K,H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // v pool
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // prefix tables [B,W]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // prefix lengths [B]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // layer []
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // out [B, T, N, H]
#endif  // __AVX512F__
