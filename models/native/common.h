// What the native kernels share: a vectorizable exp for softmaxes, and tasks run on
// XLA:CPU's intra-op thread pool (see models/native_attention.py).
#ifndef JAXPD_NATIVE_COMMON_H_
#define JAXPD_NATIVE_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxpd_native {

namespace ffi = xla::ffi;

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

#if defined(__AVX512F__)
inline __m512 Exp16(__m512 x) {   // ExpNonPositive on 16 lanes
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 y = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

#endif

// Tasks 0 .. num_tasks - 1, claimed from a shared counter by the calling thread and by
// helpers scheduled on XLA's intra-op pool. The caller works too and waits only for
// tasks that were claimed, so it never waits on a helper that has not started (the pool
// may be busy running this very program on other devices); a helper that starts late
// finds no task left and only drops its reference to the shared state. `run` is copied
// into that state, so it must capture by value what a late helper could outlive.
inline void RunTasks(ffi::ThreadPool& pool, int64_t num_tasks, std::function<void(int64_t)> run) {
  struct Work {
    std::function<void(int64_t)> run;
    int64_t num_tasks;
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable cv;
    int64_t done = 0;   // guarded by mu

    void Run() {
      for (int64_t t; (t = next.fetch_add(1)) < num_tasks;) {
        run(t);
        std::lock_guard<std::mutex> lock(mu);
        if (++done == num_tasks) cv.notify_all();
      }
    }
  };
  if (num_tasks <= 0) return;
  auto work = std::make_shared<Work>();
  work->run = std::move(run);
  work->num_tasks = num_tasks;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  for (int64_t i = 1; i < std::min(threads, num_tasks); ++i)
    pool.Schedule([work] { work->Run(); });
  work->Run();
  std::unique_lock<std::mutex> lock(work->mu);
  work->cv.wait(lock, [&] { return work->done == work->num_tasks; });
}

}  // namespace jaxpd_native

#endif  // JAXPD_NATIVE_COMMON_H_
