// Paged decode attention for XLA:CPU, called through jax.ffi (see models/native_attention.py).
//
// One query token per slot against the pages its block table names, read in place from
// the whole [L, P, page_size, K, H] pool: no gathered copy of the context, no transpose,
// no padded width. XLA:CPU's code for the jnp reference spends most of a decode step
// gathering pages into a [B, S, K, H] copy (BENCHMARKS.md section 3); this reads each key
// and value row once, for the G query heads of its kv head together.
//
// Same semantics as models/attention.py:paged_attention: keys at index >= length are
// masked; float32 scores and softmax. A page id outside the pool is an error, not a read.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float* q;            // [B, N, H]
  const float* k;            // this layer's [P, S, K, H]
  const float* v;
  const int32_t* tables;     // [B, W]
  const int32_t* lengths;    // [B]
  float* out;                // [B, N, H]
  int64_t N, H, P, S, K, W;
  float scale;
};

// Slots [begin, end). Per slot, every kv head at once: one token's keys (or values) of
// all K heads are one contiguous K*H row, and a page is page_size such rows, so the
// context is read once, in order. False, with the id in `*bad_page`, where a slot's table
// names a page outside the pool (that slot is left unwritten).
bool AttendSlots(const Problem& pr, int64_t begin, int64_t end, int64_t* bad_page) {
  const int64_t N = pr.N, H = pr.H, S = pr.S, K = pr.K, W = pr.W, G = N / K;
  std::vector<float> scores(static_cast<size_t>(W * S * N));   // [t, n]
  std::vector<float> acc(static_cast<size_t>(N * H));
  for (int64_t b = begin; b < end; ++b) {
    const int64_t len = std::min<int64_t>(pr.lengths[b], W * S);
    const int32_t* table = pr.tables + b * W;
    float* o = pr.out + b * N * H;
    if (len <= 0) {                                    // an empty slot: its output is unused
      std::fill(o, o + N * H, 0.0f);
      continue;
    }
    for (int64_t p = 0; p < (len + S - 1) / S; ++p)
      if (table[p] < 0 || table[p] >= pr.P) {
        *bad_page = table[p];
        return false;
      }
    const float* qb = pr.q + b * N * H;
    for (int64_t t = 0; t < len; ++t) {
      const float* keys = pr.k + (static_cast<int64_t>(table[t / S]) * S + t % S) * K * H;
      float* st = scores.data() + t * N;
      for (int64_t n = 0; n < N; ++n) {
        const float* qn = qb + n * H;
        const float* key = keys + (n / G) * H;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t h = 0; h < H; ++h) dot += qn[h] * key[h];
        st[n] = dot * pr.scale;
      }
    }
    for (int64_t n = 0; n < N; ++n) {
      float m = -INFINITY;
      for (int64_t t = 0; t < len; ++t) m = std::max(m, scores[t * N + n]);
      float sum = 0.0f;
      for (int64_t t = 0; t < len; ++t) {
        const float e = std::exp(scores[t * N + n] - m);
        scores[t * N + n] = e;
        sum += e;
      }
      const float inv = 1.0f / sum;
      for (int64_t t = 0; t < len; ++t) scores[t * N + n] *= inv;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t t = 0; t < len; ++t) {
      const float* vals = pr.v + (static_cast<int64_t>(table[t / S]) * S + t % S) * K * H;
      const float* st = scores.data() + t * N;
      for (int64_t n = 0; n < N; ++n) {
        const float w = st[n];
        const float* val = vals + (n / G) * H;
        float* a = acc.data() + n * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) a[h] += w * val[h];
      }
    }
    std::copy(acc.begin(), acc.end(), o);
  }
  return true;
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
  std::atomic<bool> failed{false};
  std::atomic<int64_t> bad_page{0};
  std::mutex mu;
  std::condition_variable cv;
  int64_t done = 0;            // guarded by mu

  void Run() {
    for (int64_t c; (c = next.fetch_add(1)) < num_chunks;) {
      int64_t bad = 0;
      if (!AttendSlots(pr, c * chunk, std::min(num_slots, (c + 1) * chunk), &bad)) {
        bad_page.store(bad);
        failed.store(true);
      }
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
    return ffi::Error::InvalidArgument("paged_decode: q [B,N,H], pools [L,P,S,K,H], "
                                       "block_tables [B,W], lengths [B]");
  const int64_t B = qd[0], N = qd[1], H = qd[2];
  const int64_t L = pd[0], P = pd[1], S = pd[2], K = pd[3];
  if (pd[4] != H || td[0] != B || lengths.dimensions()[0] != B || K == 0 || N % K != 0 ||
      layer < 0 || layer >= L ||
      !std::equal(pd.begin(), pd.end(), v_pool.dimensions().begin(), v_pool.dimensions().end()))
    return ffi::Error::InvalidArgument("paged_decode: inconsistent shapes or layer");
  auto work = std::make_shared<Work>();
  const int64_t layer_size = P * S * K * H;
  work->pr = Problem{q_BNH.typed_data(), k_pool.typed_data() + layer * layer_size,
                     v_pool.typed_data() + layer * layer_size, block_tables.typed_data(),
                     lengths.typed_data(), out_BNH->typed_data(), N, H, P, S, K, td[1],
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
  if (work->failed.load())
    return ffi::Error::InvalidArgument("paged_decode: page id " +
                                       std::to_string(work->bad_page.load()) +
                                       " outside the pool of " + std::to_string(P));
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
