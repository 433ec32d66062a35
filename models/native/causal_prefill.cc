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
// Flash-attention's order on a CPU: query rows in tiles of 4 (2 at head dim 128) held
// in registers against keys 16 at a time, an online softmax, values added into per-row
// accumulators, never a [T, T] score matrix; each tile reads only the keys up to its
// own last row. Keys are first transposed into blocks of [H, 16] so that 16 scores are
// one vector per head dim. Built for AVX-512 only: on other CPUs the library has no
// such symbol and prefill stays on the jnp reference (XLA:CPU's own code for it).
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

constexpr int64_t kRows = 32;     // query rows per task

struct Prompt {
  const float* q;   // [B, T, N, H]
  const float* k;   // [B, T, K, H]
  const float* v;
  float* out;       // [B, T, N, H]
  float* kt;        // [B, K, T / 16 (rounded up), H, 16]: keys transposed per block of 16
  int64_t B, T, N, K, H, blocks;
  float scale;
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
  for (int64_t kb = 0; kb * 16 < plen; ++kb) {
    float* dst = pr.pkt + ((b * pr.K + kh) * pr.pblocks + kb) * kH * 16;
    for (int64_t jj = 0; jj < 16; ++jj) {
      const float* src = pr.PrefixRow(pr.kp, b, std::min(kb * 16 + jj, plen - 1), kh);
      for (int64_t h = 0; h < kH; ++h) dst[h * 16 + jj] = src[h];
    }
  }
}

// One block of 16 transposed keys `kblk` for kR query rows: scores, the online softmax
// (m, l, acc rescaled), masked lanes dropped (`live`: at least one lane of some row is
// live, and every row's first block has one), and `keys` value rows from value(jj) added.
template <int64_t kV, int64_t kR, typename Value>
inline void AttendBlock(const float* kblk, const float* const* q, const __mmask16* live,
                        __m512 scale, int64_t keys, Value&& value, __m512 (&acc)[kR][kV],
                        float* m, float* l) {
  constexpr int64_t kH = kV * 16;
  alignas(64) float p[kR][16];
  __m512 s[kR];
  for (int64_t u = 0; u < kR; ++u) s[u] = _mm512_setzero_ps();
  for (int64_t h = 0; h < kH; ++h) {
    const __m512 kv = _mm512_load_ps(kblk + h * 16);
    for (int64_t u = 0; u < kR; ++u) s[u] = _mm512_fmadd_ps(_mm512_set1_ps(q[u][h]), kv, s[u]);
  }
  for (int64_t u = 0; u < kR; ++u) {
    const __m512 su = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), live[u], s[u], scale);
    const float m_new = std::max(m[u], _mm512_reduce_max_ps(su));
    const float corr = ExpNonPositive(m[u] - m_new);
    const __m512 pu = _mm512_maskz_mov_ps(live[u], Exp16(_mm512_sub_ps(su, _mm512_set1_ps(m_new))));
    l[u] = l[u] * corr + _mm512_reduce_add_ps(pu);
    m[u] = m_new;
    _mm512_store_ps(p[u], pu);
    const __m512 c = _mm512_set1_ps(corr);
    for (int64_t j = 0; j < kV; ++j) acc[u][j] = _mm512_mul_ps(acc[u][j], c);
  }
  for (int64_t jj = 0; jj < keys; ++jj) {
    const float* vrow = value(jj);
    for (int64_t j = 0; j < kV; ++j) {
      const __m512 vv = _mm512_loadu_ps(vrow + 16 * j);
      for (int64_t u = 0; u < kR; ++u)
        acc[u][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[u][jj]), vv, acc[u][j]);
    }
  }
}

// kR query rows r0 .. r0 + kR - 1 of head n: the row's prefix keys (if any), then its
// keys 0 .. r0 + kR - 1: scores 16 keys at a time from the transposed keys, an online
// softmax, values into kR x kV accumulator vectors held in registers.
template <int64_t kV, int64_t kR>
void AttendTile(const Prompt& pr, int64_t b, int64_t kh, int64_t n, int64_t r0) {
  constexpr int64_t kH = kV * 16;
  const int64_t T = pr.T, K = pr.K, N = pr.N;
  __m512 acc[kR][kV];
  float m[kR], l[kR];
  const float* q[kR];
  for (int64_t u = 0; u < kR; ++u) {
    for (int64_t j = 0; j < kV; ++j) acc[u][j] = _mm512_setzero_ps();
    m[u] = -INFINITY;
    l[u] = 0.0f;
    q[u] = pr.q + ((b * T + r0 + u) * N + n) * kH;
  }
  const __m512 scale = _mm512_set1_ps(pr.scale);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __mmask16 live[kR];
  const int64_t plen = pr.PrefixLen(b);
  const float* pkt = pr.pkt + (b * K + kh) * pr.pblocks * kH * 16;
  for (int64_t kb = 0; kb * 16 < plen; ++kb) {
    const int64_t keys = std::min<int64_t>(16, plen - kb * 16);
    // prefix keys kb * 16 + lane < plen are visible to every row
    const __mmask16 visible = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int32_t>(keys)));
    for (int64_t u = 0; u < kR; ++u) live[u] = visible;
    AttendBlock<kV, kR>(pkt + kb * kH * 16, q, live, scale, keys,
                        [&](int64_t jj) { return pr.PrefixRow(pr.vp, b, kb * 16 + jj, kh); },
                        acc, m, l);
  }
  const int64_t last = (r0 + kR - 1) / 16;
  const float* kt = pr.kt + (b * K + kh) * pr.blocks * kH * 16;
  for (int64_t kb = 0; kb <= last; ++kb) {
    // keys kb * 16 + lane <= r0 + u are visible
    for (int64_t u = 0; u < kR; ++u)
      live[u] = _mm512_cmple_epi32_mask(
          lane, _mm512_set1_epi32(static_cast<int32_t>(r0 + u - kb * 16)));
    const int64_t keys = std::min<int64_t>(16, std::min(T, r0 + kR) - kb * 16);
    const float* vrow = pr.v + ((b * T + kb * 16) * K + kh) * kH;
    AttendBlock<kV, kR>(kt + kb * kH * 16, q, live, scale, keys,
                        [&](int64_t jj) { return vrow + jj * K * kH; }, acc, m, l);
  }
  for (int64_t u = 0; u < kR; ++u) {
    float* dst = pr.out + ((b * T + r0 + u) * N + n) * kH;
    const __m512 inv = _mm512_set1_ps(1.0f / l[u]);
    for (int64_t j = 0; j < kV; ++j) _mm512_storeu_ps(dst + 16 * j, _mm512_mul_ps(acc[u][j], inv));
  }
}

template <int64_t kV>
void AttendRows(const Prompt& pr, int64_t b, int64_t kh, int64_t i0) {
  constexpr int64_t kR = kV <= 4 ? 4 : 2;
  const int64_t i1 = std::min(pr.T, i0 + kRows), G = pr.N / pr.K;
  for (int64_t g = 0; g < G; ++g) {
    int64_t r = i0;
    for (; r + kR <= i1; r += kR) AttendTile<kV, kR>(pr, b, kh, kh * G + g, r);
    for (; r < i1; ++r) AttendTile<kV, 1>(pr, b, kh, kh * G + g, r);
  }
}

// Tasks of the first phase: transpose (b, kh)'s keys; of the second: 32 query rows.
void TransposeTask(const Prompt& pr, int64_t task) {
  const int64_t b = task / pr.K, kh = task % pr.K;
  switch (pr.H) {
    case 32: return TransposeKeys<32>(pr, b, kh);
    case 64: return TransposeKeys<64>(pr, b, kh);
    default: return TransposeKeys<128>(pr, b, kh);
  }
}

void AttendTask(const Prompt& pr, int64_t task) {
  const int64_t blocks = (pr.T + kRows - 1) / kRows;
  // Longest tasks (the last query blocks) first: they are claimed before the short ones.
  const int64_t qb = blocks - 1 - task % blocks, rest = task / blocks;
  const int64_t kh = rest % pr.K, b = rest / pr.K;
  switch (pr.H) {
    case 32: return AttendRows<2>(pr, b, kh, qb * kRows);
    case 64: return AttendRows<4>(pr, b, kh, qb * kRows);
    default: return AttendRows<8>(pr, b, kh, qb * kRows);
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
  pr.B = B, pr.T = T, pr.N = N, pr.K = K, pr.H = H, pr.blocks = (T + 15) / 16;
  pr.scale = 1.0f / std::sqrt(static_cast<float>(H));
  return ffi::Error::Success();
}

using Buffer = std::unique_ptr<float[], Free>;

float* Allocate(Buffer& buffer, int64_t floats) {
  buffer.reset(static_cast<float*>(
      std::aligned_alloc(64, static_cast<size_t>(std::max<int64_t>(floats, 16)) * sizeof(float))));
  return buffer.get();
}

ffi::Error Run(ffi::ThreadPool& pool, Prompt pr) {
  if (pr.B == 0 || pr.T == 0) return ffi::Error::Success();
  Buffer kt, pkt;
  pr.kt = Allocate(kt, pr.B * pr.K * pr.blocks * pr.H * 16);
  pr.pkt = Allocate(pkt, pr.B * pr.K * pr.pblocks * pr.H * 16);
  if (pr.kt == nullptr || pr.pkt == nullptr)
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "causal_prefill: out of memory");
  RunTasks(pool, pr.B * pr.K, [pr](int64_t task) { TransposeTask(pr, task); });
  RunTasks(pool, pr.B * pr.K * ((pr.T + kRows - 1) / kRows),
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
  pr.pblocks = (pr.W * page_size + 15) / 16;
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
