// What the two quantized products (quant_matmul.cc: float activations; quant_dot.cc:
// activations quantized to int8 blocks) share: float16 scales, the operands of a
// weight kept quantized (models/quant.py), checked against x before anything is read,
// the split of W's rows into tasks, and the XLA FFI signature both handlers bind.
#ifndef JAXPD_NATIVE_QUANT_COMMON_H_
#define JAXPD_NATIVE_QUANT_COMMON_H_

#include <cstdint>
#include <cstring>

#include "common.h"

#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace jaxpd_native {

constexpr int64_t kQuantBlock = 32;

inline float HalfToFloat(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {   // subnormal: renormalize
      int e = -1;
      uint32_t m = man;
      do { ++e; m <<= 1; } while (!(m & 0x400u));
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  return __builtin_bit_cast(float, bits);
#endif
}

// One layer's weight and the product's sizes. Formats (`fmt`), per row of W:
//   0 int8:  data int8 [O, I], scale float32 [O, 1]: w = q * scale (scale applied once
//            to the row's sum).
//   1 q8_0:  data int8 [O, I], scale float16 [O, I/32]: w = q * d.
//   2 q4_0:  data uint8 [O, I/2], scale float16 [O, I/32]: w = (q - 8) * d.
//   3 q4_1:  as q4_0, and min float16 [O, I/32]: w = q * d + m.
//   4 q4_k:  as q4_1 with float32 scale and min (GGUF's Q4_K re-read at load).
//   5 q6_k:  data int8 [O, I], scale float32 [O, I/16]: w = q * d, a scale per 16
//            elements, so a block of 32 has two (GGUF's Q6_K re-read at load).
// A nibble block's byte j holds element j (low 4 bits) and element j + 16 (high).
constexpr int64_t kQ4K = 4, kQ6K = 5;

struct QuantOperands {
  const uint8_t* data;   // row stride `row_bytes`
  const void* scale;     // [O, nb]
  const void* min;       // [O, nb] (q4_1, q4_k)
  int64_t M, I, O, nb, row_bytes, fmt;

  float RowScale(int64_t o) const {   // int8's per-row scale, applied to the sum
    return fmt == 0 ? static_cast<const float*>(scale)[o] : 1.0f;
  }
  // Scale `b` of row o: block b's (q6_k: sub-block b's, two to a block). The vector
  // kernels, templated on the format, take the `FMT` forms: no test of `fmt` per block.
  template <int64_t FMT>
  float BlockScaleOf(int64_t o, int64_t b) const {
    if constexpr (FMT >= kQ4K) return static_cast<const float*>(scale)[o * nb + b];
    else return HalfToFloat(static_cast<const uint16_t*>(scale)[o * nb + b]);
  }
  template <int64_t FMT>
  float BlockMinOf(int64_t o, int64_t b) const {
    if constexpr (FMT == kQ4K) return static_cast<const float*>(min)[o * nb + b];
    else return HalfToFloat(static_cast<const uint16_t*>(min)[o * nb + b]);
  }
  float BlockScale(int64_t o, int64_t b) const {
    return fmt >= kQ4K ? BlockScaleOf<kQ4K>(o, b) : BlockScaleOf<1>(o, b);
  }
  float BlockMin(int64_t o, int64_t b) const {
    return fmt == kQ4K ? BlockMinOf<kQ4K>(o, b) : BlockMinOf<3>(o, b);
  }
};

// x [M, I] and a weight's data, scale and min, each [O, *] or, for a run of stacked
// layers, [L, O, *]: then the product uses layer `layer_index` (an operand, so a scan
// over layers passes its counter and no layer's weight is copied out of the stack).
// Every extent is checked against x's and fmt: the kernels never index past a buffer.
// Formats above `max_fmt` (those a product does not take) are refused.
inline ffi::Error ParseQuantOperands(const char* name, ffi::Span<const int64_t> xd,
                                     ffi::AnyBuffer& data, ffi::AnyBuffer& scale,
                                     ffi::AnyBuffer& min, ffi::Buffer<ffi::S32>& layer_index,
                                     int64_t fmt, int64_t max_fmt, QuantOperands* q) {
  const auto dd = data.dimensions();
  const auto sd = scale.dimensions();
  const size_t rank = dd.size();
  auto refuse = [name](const char* why) {
    return ffi::Error::InvalidArgument(std::string(name) + ": " + why);
  };
  if (xd.size() != 2 || (rank != 2 && rank != 3) || sd.size() != rank ||
      layer_index.element_count() != 1)
    return refuse("x [M, I], data [(L,) O, I'], scale [(L,) O, nb], one layer");
  const int64_t L = rank == 3 ? dd[0] : 1;
  const int64_t layer = layer_index.typed_data()[0];
  const size_t r = rank - 2;   // the first per-layer dim
  if (layer < 0 || layer >= L || (rank == 3 && sd[0] != L)) return refuse("layer out of range");
  QuantOperands p{};
  p.M = xd[0];
  p.I = xd[1];
  p.O = dd[r];
  p.nb = sd[r + 1];
  p.fmt = fmt;
  if (fmt < 0 || fmt > max_fmt || p.I % kQuantBlock || sd[r] != p.O)
    return refuse("unknown format or shapes");
  const bool nibbles = fmt >= 2 && fmt <= kQ4K;
  const bool f32_scale = fmt == 0 || fmt >= kQ4K;
  const int64_t want_cols = nibbles ? p.I / 2 : p.I;
  const int64_t want_nb = fmt == 0 ? 1 : fmt == kQ6K ? p.I / 16 : p.I / kQuantBlock;
  const auto want_data = nibbles ? ffi::DataType::U8 : ffi::DataType::S8;
  const auto want_scale = f32_scale ? ffi::DataType::F32 : ffi::DataType::F16;
  if (dd[r + 1] != want_cols || p.nb != want_nb || data.element_type() != want_data ||
      scale.element_type() != want_scale)
    return refuse("data or scale do not fit x and fmt");
  const int64_t scale_bytes = f32_scale ? 4 : 2;
  if (fmt == 3 || fmt == kQ4K) {
    const auto md = min.dimensions();
    if (md.size() != rank || md[r] != p.O || md[r + 1] != p.nb || (rank == 3 && md[0] != L) ||
        min.element_type() != scale.element_type())
      return refuse("q4_1 and q4_k need min [(L,) O, nb] of the scale's type");
    p.min = static_cast<const uint8_t*>(min.untyped_data()) + layer * p.O * p.nb * scale_bytes;
  }
  p.data = static_cast<const uint8_t*>(data.untyped_data()) + layer * p.O * want_cols;
  p.scale = static_cast<const uint8_t*>(scale.untyped_data()) + layer * p.O * p.nb * scale_bytes;
  p.row_bytes = want_cols;
  *q = p;
  return ffi::Error::Success();
}

// Rows [0, O) of W in tasks of whole tiles of `tile` rows, run on XLA's intra-op pool
// (`RunTasks`): about two tasks per thread, each at least two tiles, so a thread that
// starts late still finds work and each task's streams through W stay long (shorter
// ones, from more tasks, leave the hardware prefetchers less to follow). `rows(begin,
// end)` is copied into the tasks, so it must capture by value.
template <typename RowsFn>
inline void SplitRows(ffi::ThreadPool& pool, int64_t O, int64_t tile, RowsFn rows) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t tiles = (O + tile - 1) / tile;
  const int64_t chunk = tile * std::max<int64_t>(2, tiles / (threads * 2) + 1);
  RunTasks(pool, (O + chunk - 1) / chunk, [rows, chunk, O](int64_t c) {
    rows(c * chunk, std::min(O, (c + 1) * chunk));
  });
}

// The XLA FFI binding of a quantized product, whose handler is
//   (ThreadPool, x [M, I] float32, data, scale, min, layer int32 [], fmt) -> out [M, O]
// with the weight's parts as `ParseQuantOperands` reads them.
inline auto QuantProductBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()   // x [M, I]
      .Arg<ffi::AnyBuffer>()          // data [(L,) O, I']
      .Arg<ffi::AnyBuffer>()          // scale [(L,) O, nb]
      .Arg<ffi::AnyBuffer>()          // min [(L,) O, nb]
      .Arg<ffi::Buffer<ffi::S32>>()   // layer []
      .Attr<int64_t>("fmt")
      .Ret<ffi::Buffer<ffi::F32>>();  // out [M, O]
}

#if defined(__AVX512F__)
// The sums of four vectors' lanes, in order.
inline __m128 Sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // 128-bit lanes: ab = (a0 + a2, a1 + a3, b0 + b2, b1 + b3), cd alike.
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44),
                                  _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44),
                                  _mm512_shuffle_f32x4(c, d, 0xEE));
  // 128-bit lane k now holds four partial sums of the k-th vector.
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88),
                                    _mm512_shuffle_f32x4(ab, cd, 0xDD));
  const __m128 l01 = _mm_hadd_ps(_mm512_castps512_ps128(abcd), _mm512_extractf32x4_ps(abcd, 1));
  const __m128 l23 = _mm_hadd_ps(_mm512_extractf32x4_ps(abcd, 2), _mm512_extractf32x4_ps(abcd, 3));
  return _mm_hadd_ps(l01, l23);
}
#endif

}  // namespace jaxpd_native

#endif  // JAXPD_NATIVE_QUANT_COMMON_H_
