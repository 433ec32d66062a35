// Paged decode attention for XLA:CPU, called through jax.ffi (see models/native_attention.py).
//
// One query token per slot against the pages its block table names, read in place from
// the whole [L, P, page_size, K, H] pool: no gathered copy of the context, no transpose,
// no padded width. XLA:CPU's code for the jnp reference spends most of a decode step
// gathering pages into a [B, S, K, H] copy (BENCHMARKS.md section 3); this reads each
// token's keys and values once, every kv head together (one contiguous K*H row each).
//
// Same semantics as models/attention.py:paged_attention: keys at index >= length are
// masked; float32 scores and softmax; a page id outside the pool is read as jnp's
// gather reads it (a negative one counted from the end, then clamped into the pool), so
// the kernel never reads outside the pool and always agrees with the reference.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Asks for the next page while this one is computed: the hardware prefetcher stops at
// the page's end, and the next page is anywhere in the pool.
inline void Prefetch(const float* pool, int32_t page, int64_t floats) {
  const char* p = reinterpret_cast<const char*>(pool + static_cast<int64_t>(page) * floats);
  for (int64_t i = 0; i < floats * 4; i += 64) __builtin_prefetch(p + i);
}

// e^x for x <= 0 (a softmax after subtracting its max), written so that the compiler
// vectorizes the loop calling it (libm's expf is a call per element): x = n ln2 + y with
// |y| <= ln2/2 (ln2 split in two for accuracy), e^y by its Taylor series to y^6
// (relative error below 3e-7), times 2^n from its exponent bits. Below -87, where 2^n
// would leave the normal floats, it returns e^-87 (~1.6e-38): nil beside the max's 1.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float y = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 720.0f;
  p = p * y + 1.0f / 120.0f;
  p = p * y + 1.0f / 24.0f;
  p = p * y + 1.0f / 6.0f;
  p = p * y + 0.5f;
  p = p * y + 1.0f;
  p = p * y + 1.0f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

// Calls visit(t, n, row) for every token t < len and query head n, `row` being the H
// values of n's kv head at t: pages in order, then the tokens of a page (no division
// per token or head), all kv heads of a token together (one contiguous K*H row).
template <typename Visit>
inline void WalkContext(const float* pool, const int32_t* table, int64_t len,
                        int64_t page_size, int64_t K, int64_t G, int64_t H, Visit&& visit) {
  for (int64_t t0 = 0; t0 < len; t0 += page_size) {
    const float* page = pool + static_cast<int64_t>(table[t0 / page_size]) * page_size * K * H;
    if (t0 + page_size < len) Prefetch(pool, table[t0 / page_size + 1], page_size * K * H);
    for (int64_t t = t0; t < std::min(len, t0 + page_size); ++t) {
      const float* rows = page + (t - t0) * K * H;
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

// The head dims of common models known at compile time, so the inner loops unroll
// (12% on the kernel at H = 32); any other H runs the general loop.
void AttendSlots(const Problem& pr, int64_t begin, int64_t end) {
  switch (pr.H) {
    case 32: return AttendSlotsT<32>(pr, begin, end);
    case 64: return AttendSlotsT<64>(pr, begin, end);
    case 128: return AttendSlotsT<128>(pr, begin, end);
    default: return AttendSlotsT<0>(pr, begin, end);
  }
}

// Chunks of slots claimed from a shared counter by the calling thread and by helpers
// scheduled on XLA's intra-op pool. The caller works too and waits only for chunks that
// were claimed, so it never waits on a helper that has not started (the pool may be
// busy running this very program on other devices); a helper that starts late finds no
// chunk left and only drops its reference to the shared state.
struct Work {
  Problem pr;
  int64_t num_slots, chunk, num_chunks;
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int64_t done = 0;            // guarded by mu

  void Run() {
    for (int64_t c; (c = next.fetch_add(1)) < num_chunks;) {
      AttendSlots(pr, c * chunk, std::min(num_slots, (c + 1) * chunk));
      std::lock_guard<std::mutex> lock(mu);
      if (++done == num_chunks) cv.notify_all();
    }
  }
};

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q_BNH,
                       ffi::Buffer<ffi::F32> k_pool, ffi::Buffer<ffi::F32> v_pool,
                       ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> lengths,
                       int64_t layer, ffi::ResultBuffer<ffi::F32> out_BNH) {
  const auto qd = q_BNH.dimensions();
  const auto pd = k_pool.dimensions();
  const auto td = block_tables.dimensions();
  if (qd.size() != 3 || pd.size() != 5 || td.size() != 2 || lengths.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("paged_decode: q [B,N,H], pools [L,P,page_size,K,H], "
                                       "block_tables [B,W], lengths [B]");
  const int64_t B = qd[0], N = qd[1], H = qd[2];
  const int64_t L = pd[0], P = pd[1], page_size = pd[2], K = pd[3];
  if (pd[4] != H || td[0] != B || lengths.dimensions()[0] != B || K == 0 || N % K != 0 ||
      P < 1 || page_size < 1 || layer < 0 || layer >= L ||
      !std::equal(pd.begin(), pd.end(), v_pool.dimensions().begin(), v_pool.dimensions().end()))
    return ffi::Error::InvalidArgument("paged_decode: inconsistent shapes or layer");
  auto work = std::make_shared<Work>();
  const int64_t layer_size = P * page_size * K * H;
  work->pr = Problem{q_BNH.typed_data(), k_pool.typed_data() + layer * layer_size,
                     v_pool.typed_data() + layer * layer_size, block_tables.typed_data(),
                     lengths.typed_data(), out_BNH->typed_data(), N, H, P, page_size, K, td[1],
                     1.0f / std::sqrt(static_cast<float>(H))};
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  work->num_slots = B;
  work->chunk = std::max<int64_t>(1, (B + 2 * threads - 1) / (2 * threads));
  work->num_chunks = B == 0 ? 0 : (B + work->chunk - 1) / work->chunk;
  for (int64_t i = 1; i < std::min(threads, work->num_chunks); ++i)
    pool.Schedule([work] { work->Run(); });
  work->Run();
  {
    std::unique_lock<std::mutex> lock(work->mu);
    work->cv.wait(lock, [&] { return work->done == work->num_chunks; });
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpdPagedDecodeF32, PagedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, N, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k pool [L, P, S, K, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block tables [B, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lengths [B]
                                  .Attr<int64_t>("layer")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [B, N, H]
