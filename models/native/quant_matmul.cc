// x @ W for a weight kept quantized (models/quant.py): out [M, O] = x [M, I] times the
// O rows of W, each row stored in blocks along I and dequantized block by block in
// registers, never to memory. A decode step's product has few rows (M), so it reads
// each weight byte once and is bound by memory: the bytes read are the stored ones.
//
// Formats (attr `fmt`), per row of W:
//   0 int8:  data int8 [O, I], scale float32 [O, 1]: w = q * scale (scale applied once
//            to the row's sum).
//   1 q8_0:  data int8 [O, I], scale float16 [O, I/32]: w = q * d.
//   2 q4_0:  data uint8 [O, I/2], scale float16 [O, I/32]: w = (q - 8) * d.
//   3 q4_1:  as q4_0, and min float16 [O, I/32]: w = q * d + m.
// A nibble block's byte j holds element j (low 4 bits) and element j + 16 (high).
// The element is dequantized to float32 before the product, as the jnp form does.
//
// Rows of W are split over XLA's intra-op thread pool (common.h's RunTasks); x's rows
// go through in tiles (of 8 and 4 with AVX-512, of 4 elsewhere), each tile reading the
// block it dequantized once. On a CPU
// with AVX-512 a block is two vectors of 16; elsewhere a portable body the compiler
// vectorizes (which the tests also build on AVX-512 machines).
#include <cstring>
#include <vector>

#include "common.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jaxpd_native {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 4;   // rows of x per pass over a weight row

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

struct Problem {
  const float* x;        // [M, I]
  const uint8_t* data;   // row stride `row_bytes`
  const void* scale;     // [O, nb]
  const uint16_t* min;   // [O, nb] (q4_1)
  float* out;            // [M, O]
  int64_t M, I, O, nb, row_bytes, fmt;
};

// One block of row o dequantized into w[32] (before the int8 format's row scale).
inline void Dequant(const Problem& p, int64_t o, int64_t b, float* w) {
  const uint8_t* row = p.data + o * p.row_bytes;
  switch (p.fmt) {
    case 0: {
      const int8_t* q = reinterpret_cast<const int8_t*>(row) + b * kBlock;
#pragma omp simd
      for (int64_t j = 0; j < kBlock; ++j) w[j] = static_cast<float>(q[j]);
      return;
    }
    case 1: {
      const int8_t* q = reinterpret_cast<const int8_t*>(row) + b * kBlock;
      const float d = HalfToFloat(static_cast<const uint16_t*>(p.scale)[o * p.nb + b]);
#pragma omp simd
      for (int64_t j = 0; j < kBlock; ++j) w[j] = static_cast<float>(q[j]) * d;
      return;
    }
    default: {
      const uint8_t* q = row + b * (kBlock / 2);
      const float d = HalfToFloat(static_cast<const uint16_t*>(p.scale)[o * p.nb + b]);
      const bool has_min = p.fmt == 3;
      const float m = has_min ? HalfToFloat(p.min[o * p.nb + b]) : 0.0f;
      const float shift = has_min ? 0.0f : 8.0f;
#pragma omp simd
      for (int64_t j = 0; j < kBlock / 2; ++j) {
        w[j] = (static_cast<float>(q[j] & 0xF) - shift) * d + m;
        w[j + kBlock / 2] = (static_cast<float>(q[j] >> 4) - shift) * d + m;
      }
      return;
    }
  }
}

#if defined(__AVX512F__)
// The block of row o as two vectors of 16 floats (elements 0-15 and 16-31).
template <int64_t FMT>
inline void Dequant512(const Problem& p, int64_t o, int64_t b, __m512& w0, __m512& w1) {
  const uint8_t* row = p.data + o * p.row_bytes;
  if constexpr (FMT <= 1) {
    const __m128i* q = reinterpret_cast<const __m128i*>(row + b * kBlock);
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
    if constexpr (FMT == 1) {
      const __m512 d = _mm512_set1_ps(
          HalfToFloat(static_cast<const uint16_t*>(p.scale)[o * p.nb + b]));
      w0 = _mm512_mul_ps(w0, d);
      w1 = _mm512_mul_ps(w1, d);
    }
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kBlock / 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    const __m512 hi = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
    const __m512 d = _mm512_set1_ps(
        HalfToFloat(static_cast<const uint16_t*>(p.scale)[o * p.nb + b]));
    // q4_0: (q - 8) * d = q * d - 8 d; q4_1: q * d + m.
    const float offset_value = FMT == 3 ? HalfToFloat(p.min[o * p.nb + b])
                                        : -8.0f * HalfToFloat(static_cast<const uint16_t*>(
                                              p.scale)[o * p.nb + b]);
    const __m512 offset = _mm512_set1_ps(offset_value);
    w0 = _mm512_fmadd_ps(lo, d, offset);
    w1 = _mm512_fmadd_ps(hi, d, offset);
  }
}

template <int64_t T, int64_t FMT>
void RowTile512(const Problem& p, int64_t o, int64_t m0) {
  __m512 acc[T][2];
  for (int64_t t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  const int64_t nblocks = p.I / kBlock;
  const float* x0 = p.x + m0 * p.I;
  for (int64_t b = 0; b < nblocks; ++b) {
    __m512 w0, w1;
    Dequant512<FMT>(p, o, b, w0, w1);
    for (int64_t t = 0; t < T; ++t) {
      const float* x = x0 + t * p.I + b * kBlock;
      acc[t][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x), w0, acc[t][0]);
      acc[t][1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), w1, acc[t][1]);
    }
  }
  const float row_scale = FMT == 0 ? static_cast<const float*>(p.scale)[o] : 1.0f;
  for (int64_t t = 0; t < T; ++t)
    p.out[(m0 + t) * p.O + o] =
        _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1])) * row_scale;
}

template <int64_t FMT>
void Rows512(const Problem& p, int64_t begin, int64_t end) {
  for (int64_t o = begin; o < end; ++o) {
    int64_t m = 0;
    // Tiles of 8 rows (16 accumulators), then 4, then single rows: each tile reads the
    // block it dequantized once.
    for (; m + 8 <= p.M; m += 8) RowTile512<8, FMT>(p, o, m);
    for (; m + 4 <= p.M; m += 4) RowTile512<4, FMT>(p, o, m);
    for (; m < p.M; ++m) RowTile512<1, FMT>(p, o, m);
  }
}
#endif

// The portable body (any CPU; the compiler vectorizes its loops of 32).
template <int64_t T>
void RowTile(const Problem& p, int64_t o, int64_t m0) {
  float acc[T][kBlock] = {};
  alignas(64) float w[kBlock];
  const int64_t nblocks = p.I / kBlock;
  for (int64_t b = 0; b < nblocks; ++b) {
    Dequant(p, o, b, w);
    for (int64_t t = 0; t < T; ++t) {
      const float* x = p.x + (m0 + t) * p.I + b * kBlock;
#pragma omp simd
      for (int64_t j = 0; j < kBlock; ++j) acc[t][j] += x[j] * w[j];
    }
  }
  const float row_scale =
      p.fmt == 0 ? static_cast<const float*>(p.scale)[o] : 1.0f;
  for (int64_t t = 0; t < T; ++t) {
    float s = 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) s += acc[t][j];
    p.out[(m0 + t) * p.O + o] = s * row_scale;
  }
}

void Rows(const Problem& p, int64_t begin, int64_t end) {
#if defined(__AVX512F__)
  switch (p.fmt) {
    case 0: return Rows512<0>(p, begin, end);
    case 1: return Rows512<1>(p, begin, end);
    case 2: return Rows512<2>(p, begin, end);
    default: return Rows512<3>(p, begin, end);
  }
#else
  for (int64_t o = begin; o < end; ++o) {
    int64_t m = 0;
    for (; m + kTile <= p.M; m += kTile) RowTile<kTile>(p, o, m);
    for (; m < p.M; ++m) RowTile<1>(p, o, m);
  }
#endif
}

ffi::Error QuantMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                       ffi::AnyBuffer scale, ffi::AnyBuffer min,
                       ffi::Buffer<ffi::S32> layer_index, int64_t fmt,
                       ffi::ResultBuffer<ffi::F32> out) {
  // data, scale and min are [O, *] or, for a run of stacked layers, [L, O, *]: then the
  // product uses layer `layer_index` (an operand, so a scan over layers passes its
  // counter and no layer's weight is copied out of the stack).
  const auto xd = x.dimensions();
  const auto dd = data.dimensions();
  const auto sd = scale.dimensions();
  const size_t rank = dd.size();
  if (xd.size() != 2 || (rank != 2 && rank != 3) || sd.size() != rank ||
      layer_index.element_count() != 1)
    return ffi::Error::InvalidArgument("quant_matmul: x [M, I], data [(L,) O, I'], "
                                       "scale [(L,) O, nb], one layer");
  const int64_t L = rank == 3 ? dd[0] : 1;
  const int64_t layer = layer_index.typed_data()[0];
  const size_t r = rank - 2;   // the first per-layer dim
  if (layer < 0 || layer >= L || (rank == 3 && sd[0] != L))
    return ffi::Error::InvalidArgument("quant_matmul: layer out of range");
  Problem p{};
  p.M = xd[0];
  p.I = xd[1];
  p.O = dd[r];
  p.nb = sd[r + 1];
  p.fmt = fmt;
  if (fmt < 0 || fmt > 3 || p.I % kBlock || sd[r] != p.O)
    return ffi::Error::InvalidArgument("quant_matmul: unknown format or shapes");
  const bool nibbles = fmt >= 2;
  const int64_t want_cols = nibbles ? p.I / 2 : p.I;
  const int64_t want_nb = fmt == 0 ? 1 : p.I / kBlock;
  const auto want_data = nibbles ? ffi::DataType::U8 : ffi::DataType::S8;
  const auto want_scale = fmt == 0 ? ffi::DataType::F32 : ffi::DataType::F16;
  // Every extent is checked against x's: the loops below never index past a buffer.
  if (dd[r + 1] != want_cols || p.nb != want_nb || data.element_type() != want_data ||
      scale.element_type() != want_scale)
    return ffi::Error::InvalidArgument("quant_matmul: data or scale do not fit x and fmt");
  const int64_t scale_bytes = fmt == 0 ? 4 : 2;
  if (fmt == 3) {
    const auto md = min.dimensions();
    if (md.size() != rank || md[r] != p.O || md[r + 1] != p.nb || (rank == 3 && md[0] != L) ||
        min.element_type() != ffi::DataType::F16)
      return ffi::Error::InvalidArgument("quant_matmul: q4_1 needs min [(L,) O, nb] float16");
    p.min = static_cast<const uint16_t*>(min.untyped_data()) + layer * p.O * p.nb;
  }
  p.x = x.typed_data();
  p.data = static_cast<const uint8_t*>(data.untyped_data()) + layer * p.O * want_cols;
  p.scale = static_cast<const uint8_t*>(scale.untyped_data()) + layer * p.O * p.nb * scale_bytes;
  p.out = out->typed_data();
  p.row_bytes = want_cols;
  // Tasks of whole rows, several per thread so uneven progress evens out.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunk = std::max<int64_t>(8, p.O / (threads * 8) + 1);
  const Problem pr = p;
  RunTasks(pool, (p.O + chunk - 1) / chunk, [pr, chunk](int64_t c) {
    Rows(pr, c * chunk, std::min(pr.O, (c + 1) * chunk));
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxpd_native

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpdQuantMatmul, jaxpd_native::QuantMatmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // x [M, I]
                                  .Arg<xla::ffi::AnyBuffer>()               // data [(L,) O, I']
                                  .Arg<xla::ffi::AnyBuffer>()               // scale [(L,) O, nb]
                                  .Arg<xla::ffi::AnyBuffer>()               // min [(L,) O, nb]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // layer []
                                  .Attr<int64_t>("fmt")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // out [M, O]
