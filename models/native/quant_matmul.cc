// x @ W for a weight kept quantized (models/quant.py): out [M, O] = x [M, I] times the
// O rows of W, each row stored in blocks along I. A decode step's product reads each
// weight byte from memory once for all M rows of x, so a batch of M rows costs little
// more than the products of M rows.
//
// Formats: quant_common.h.
// Every dequantized element is exactly the float32 the jnp form computes (q * d is
// exact in float32 for these widths, the K-quants' float32 scales included: a float16
// times a 6- or 8-bit integer, times a 4- or 6-bit q; and q * d + m is rounded once
// either way), so the two differ only in summation order.
//
// Rows of W are split over XLA's intra-op thread pool in ranges of whole tiles
// (quant_common.h's SplitRows). On a CPU with AVX-512 a block is dequantized in
// registers (two vectors of 16; a nibble indexes a 16-entry table of its block's values
// with vpermps), and a range is taken in one of two forms by the rows of x:
// - few rows (a small decode batch): register tiles of 4 rows of W by up to 4 of x, or
//   2 by 8, each block dequantized once per tile of x's rows and fed straight to the
//   FMAs: with few rows there is little to share a dequantized block among;
// - more rows: panels. A few rows of W are dequantized once into a float panel that
//   stays in L1, and tiles of 4 of its rows by 6 rows of x (24 accumulators) run over
//   it, so the FMAs are fed from L1 and registers and the dequantization is paid once
//   per panel for every row of x.
// Elsewhere a portable body (a panel the compiler vectorizes; the tests also build it
// on AVX-512).
#include <cstring>
#include <vector>

#include "quant_common.h"

namespace jaxpd_native {
namespace {

constexpr int64_t kBlock = kQuantBlock;
constexpr int64_t kRowTile = 4;    // rows of W per tile: what tasks are made of

struct Problem : QuantOperands {
  const float* x;        // [M, I]
  float* out;            // [M, O]
};

#if defined(__AVX512F__)
// Block b of row o as two vectors of 16 floats (elements 0-15 and 16-31).
template <int64_t FMT>
inline void Dequant512(const Problem& p, int64_t o, int64_t b, __m512& lo, __m512& hi) {
  const uint8_t* row = p.data + o * p.row_bytes;
  if constexpr (FMT <= 1 || FMT == kQ6K) {
    const __m128i* q = reinterpret_cast<const __m128i*>(row + b * kBlock);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
    if constexpr (FMT == 1) {
      const __m512 d = _mm512_set1_ps(p.BlockScaleOf<FMT>(o, b));
      lo = _mm512_mul_ps(lo, d);
      hi = _mm512_mul_ps(hi, d);
    } else if constexpr (FMT == kQ6K) {   // a scale per 16: one for each half
      lo = _mm512_mul_ps(lo, _mm512_set1_ps(p.BlockScaleOf<FMT>(o, 2 * b)));
      hi = _mm512_mul_ps(hi, _mm512_set1_ps(p.BlockScaleOf<FMT>(o, 2 * b + 1)));
    }
  } else {
    // The block's 16 possible values as a table; vpermps reads only the low 4 bits of
    // each index lane, so a byte widened to 32 bits indexes by its low nibble, and
    // shifted right by 4 by its high one.
    const __m512i idx = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kBlock / 2)));
    const __m512 d = _mm512_set1_ps(p.BlockScaleOf<FMT>(o, b));
    __m512 table;
    if constexpr (FMT == 3 || FMT == kQ4K) {
      table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              d, _mm512_set1_ps(p.BlockMinOf<FMT>(o, b)));
    } else {
      table = _mm512_mul_ps(
          _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), d);
    }
    lo = _mm512_permutexvar_ps(idx, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
  }
}

// out[m0 + t, o0 + r * stride] = sum of acc[r][t]'s lanes (times int8's row scale).
template <int64_t TO, int64_t TM>
inline void Store512(const Problem& p, const __m512 (&acc)[TO][TM], int64_t o0, int64_t m0,
                     int64_t stride) {
  if constexpr (TO == 4) {
    for (int64_t t = 0; t < TM; ++t) {
      const __m128 sums = Sum4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]);
      float* out = p.out + (m0 + t) * p.O + o0;
      if (stride == 1) {
        const __m128 row_scale = p.fmt == 0
            ? _mm_loadu_ps(static_cast<const float*>(p.scale) + o0) : _mm_set1_ps(1.0f);
        _mm_storeu_ps(out, _mm_mul_ps(sums, row_scale));
      } else {
        alignas(16) float s[4];
        _mm_store_ps(s, sums);
        for (int64_t r = 0; r < 4; ++r) out[r * stride] = s[r] * p.RowScale(o0 + r * stride);
      }
    }
  } else {
    for (int64_t r = 0; r < TO; ++r)
      for (int64_t t = 0; t < TM; ++t)
        p.out[(m0 + t) * p.O + o0 + r * stride] =
            _mm512_reduce_add_ps(acc[r][t]) * p.RowScale(o0 + r * stride);
  }
}

// Rows o0 + r * stride (r < TO) of W against TM rows of x from m0, blocks dequantized in
// registers.
template <int64_t FMT, int64_t TO, int64_t TM>
void RegisterTile512(const Problem& p, int64_t o0, int64_t stride, int64_t m0) {
  __m512 acc[TO][TM];
  for (int64_t r = 0; r < TO; ++r)
    for (int64_t t = 0; t < TM; ++t) acc[r][t] = _mm512_setzero_ps();
  const float* x0 = p.x + m0 * p.I;
  for (int64_t b = 0; b < p.I / kBlock; ++b) {
    __m512 lo[TO], hi[TO];
    for (int64_t r = 0; r < TO; ++r) Dequant512<FMT>(p, o0 + r * stride, b, lo[r], hi[r]);
    for (int64_t t = 0; t < TM; ++t) {
      const float* x = x0 + t * p.I + b * kBlock;
      const __m512 xl = _mm512_loadu_ps(x), xh = _mm512_loadu_ps(x + 16);
      for (int64_t r = 0; r < TO; ++r) {
        acc[r][t] = _mm512_fmadd_ps(xl, lo[r], acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(xh, hi[r], acc[r][t]);
      }
    }
  }
  Store512<TO, TM>(p, acc, o0, m0, stride);
}

// The tile of `rows` (< TM) rows of x from m0: the last, partial tile.
template <int64_t FMT, int64_t TO, int64_t TM>
void PartialTile512(const Problem& p, int64_t o0, int64_t stride, int64_t m0, int64_t rows) {
  if constexpr (TM > 1) {
    if (rows == TM - 1) return RegisterTile512<FMT, TO, TM - 1>(p, o0, stride, m0);
    return PartialTile512<FMT, TO, TM - 1>(p, o0, stride, m0, rows);
  }
}

// Rows [begin, end) of W in tiles of TO rows, one from each of TO equal parts of the
// range: TO sequential streams through W, which the hardware prefetchers follow, where
// TO adjacent rows read block by block (stored one after another) stall on memory.
// Groups of kGroup tiles (a few KiB of W as stored) stay in L1/L2 while each tile of
// TM rows of x goes over them.
template <int64_t FMT, int64_t TO, int64_t TM>
void Streams512(const Problem& p, int64_t begin, int64_t end) {
  constexpr int64_t kGroup = 16;
  const int64_t part = (end - begin) / TO;
  for (int64_t g = 0; g < part; g += kGroup) {
    const int64_t group_end = std::min(part, g + kGroup);
    int64_t m = 0;
    for (; m + TM <= p.M; m += TM)
      for (int64_t i = g; i < group_end; ++i) RegisterTile512<FMT, TO, TM>(p, begin + i, part, m);
    if (m < p.M)
      for (int64_t i = g; i < group_end; ++i)
        PartialTile512<FMT, TO, TM>(p, begin + i, part, m, p.M - m);
  }
  for (int64_t o = begin + TO * part; o < end; ++o)   // rows past the last tile
    Streams512<FMT, 1, TM>(p, o, o + 1);
}

// The panel form, for many rows of x: kPanelRows rows of W dequantized once per slice of
// their contraction into a float panel, and tiles of 4 panel rows by up to 6 rows of x
// (24 accumulators: 24 FMAs for 10 loads per 16 elements) over it. Each slice's sums
// are added into out, so every output is stored once per slice.
constexpr int64_t kPanelRows = 8;
// Contraction elements of a panel's slice at most: a row's blocks go in equal slices
// of no more, so a panel and a tile's 6 rows of x fit in L1 together.
constexpr int64_t kPanelCols = 768;
constexpr int64_t kPanelMinRows = 9;   // rows of x from which panels pay
// x's rows are taken in blocks of about this many bytes, which stay in L2 while every
// panel of a range goes over them.
constexpr int64_t kXBlockBytes = 512 << 10;
// Floats between a panel row's start and the next one's: past the slice by a line, so
// the 4 rows a tile reads at once do not share L1 sets.
constexpr int64_t kPanelStride = kPanelCols + 16;

float* Panel512() {
  thread_local float panel[kPanelRows * kPanelStride];
  return panel;
}

// out[m0 + t, o0 + r] (+)= the sums of panel rows r < 4 (of `rows` valid) against TM
// rows of x from m0 over the slice [k0, k0 + cols).
template <int64_t TM>
inline void PanelTile512(const Problem& p, const float* w, int64_t o0, int64_t rows, int64_t m0,
                         int64_t k0, int64_t cols) {
  __m512 acc[4][TM];
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t t = 0; t < TM; ++t) acc[r][t] = _mm512_setzero_ps();
  const float* x = p.x + m0 * p.I + k0;
  for (int64_t k = 0; k < cols; k += 16) {
    __m512 wv[4];
    for (int64_t r = 0; r < 4; ++r) wv[r] = _mm512_loadu_ps(w + r * kPanelStride + k);
    for (int64_t t = 0; t < TM; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * p.I + k);
      for (int64_t r = 0; r < 4; ++r) acc[r][t] = _mm512_fmadd_ps(xv, wv[r], acc[r][t]);
    }
  }
  for (int64_t t = 0; t < TM; ++t) {
    const __m128 sums = Sum4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]);
    float* out = p.out + (m0 + t) * p.O + o0;
    if (rows >= 4) {
      _mm_storeu_ps(out, k0 == 0 ? sums : _mm_add_ps(_mm_loadu_ps(out), sums));
    } else {   // the last tile of W, past its end: only the real rows
      alignas(16) float s[4];
      _mm_store_ps(s, sums);
      for (int64_t r = 0; r < rows; ++r) out[r] = k0 == 0 ? s[r] : out[r] + s[r];
    }
  }
}

template <int64_t TM>
void PartialPanelTile512(const Problem& p, const float* w, int64_t o0, int64_t rows,
                         int64_t m0, int64_t k0, int64_t cols, int64_t m_rows) {
  if constexpr (TM > 1) {
    if (m_rows == TM - 1) return PanelTile512<TM - 1>(p, w, o0, rows, m0, k0, cols);
    return PartialPanelTile512<TM - 1>(p, w, o0, rows, m0, k0, cols, m_rows);
  }
}

constexpr int64_t kPanelTileM = 6;

// Rows [begin, end) of W against rows [m_begin, m_end) of x, in panels.
template <int64_t FMT>
void PanelBlock512(const Problem& p, int64_t begin, int64_t end, int64_t m_begin, int64_t m_end) {
  float* panel = Panel512();
  const int64_t slices = (p.I + kPanelCols - 1) / kPanelCols;
  const int64_t slice = (p.I / kBlock + slices - 1) / slices * kBlock;
  for (int64_t o0 = begin; o0 < end; o0 += kPanelRows) {
    const int64_t rows = std::min(kPanelRows, end - o0);
    const int64_t padded = (rows + 3) / 4 * 4;
    for (int64_t k0 = 0; k0 < p.I; k0 += slice) {
      const int64_t cols = std::min(slice, p.I - k0);
      for (int64_t r = 0; r < rows; ++r) {
        float* w = panel + r * kPanelStride;
        for (int64_t b = 0; b < cols / kBlock; ++b) {
          __m512 lo, hi;
          Dequant512<FMT>(p, o0 + r, k0 / kBlock + b, lo, hi);
          _mm512_storeu_ps(w + b * kBlock, lo);
          _mm512_storeu_ps(w + b * kBlock + 16, hi);
        }
      }
      // A last tile's rows past the end of W: zeros, computed and never stored.
      for (int64_t r = rows; r < padded; ++r)
        std::memset(panel + r * kPanelStride, 0, sizeof(float) * cols);
      int64_t m = m_begin;
      for (; m + kPanelTileM <= m_end; m += kPanelTileM)
        for (int64_t r = 0; r < padded; r += 4)
          PanelTile512<kPanelTileM>(p, panel + r * kPanelStride, o0 + r, rows - r, m, k0, cols);
      if (m < m_end)
        for (int64_t r = 0; r < padded; r += 4)
          PartialPanelTile512<kPanelTileM>(p, panel + r * kPanelStride, o0 + r, rows - r, m,
                                           k0, cols, m_end - m);
    }
    if constexpr (FMT == 0) {   // int8's row scale, once on each finished sum
      for (int64_t m = m_begin; m < m_end; ++m)
        for (int64_t r = 0; r < rows; ++r) p.out[m * p.O + o0 + r] *= p.RowScale(o0 + r);
    }
  }
}

template <int64_t FMT>
void Panels512(const Problem& p, int64_t begin, int64_t end) {
  const int64_t block_rows = std::max<int64_t>(
      kPanelTileM, kXBlockBytes / (sizeof(float) * p.I) / kPanelTileM * kPanelTileM);
  for (int64_t m = 0; m < p.M; m += block_rows)
    PanelBlock512<FMT>(p, begin, end, m, std::min(p.M, m + block_rows));
}

template <int64_t FMT>
void Rows512(const Problem& p, int64_t begin, int64_t end) {
  // Few rows of x (a small decode batch): 4 rows of W per tile, for independent sums.
  // Up to 8: 2 rows of W by 8 of x, 16 accumulators, 2 dequantized blocks per 32
  // products. More: panels.
  if (p.M <= 4) return Streams512<FMT, 4, 4>(p, begin, end);
  if (p.M >= kPanelMinRows) return Panels512<FMT>(p, begin, end);
  return Streams512<FMT, 2, 8>(p, begin, end);
}
#else
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
      const float d = p.BlockScale(o, b);
#pragma omp simd
      for (int64_t j = 0; j < kBlock; ++j) w[j] = static_cast<float>(q[j]) * d;
      return;
    }
    case kQ6K: {   // a scale per 16 elements
      const int8_t* q = reinterpret_cast<const int8_t*>(row) + b * kBlock;
      for (int64_t h = 0; h < 2; ++h) {
        const float d = p.BlockScale(o, 2 * b + h);
#pragma omp simd
        for (int64_t j = h * 16; j < h * 16 + 16; ++j) w[j] = static_cast<float>(q[j]) * d;
      }
      return;
    }
    default: {
      const uint8_t* q = row + b * (kBlock / 2);
      const float d = p.BlockScale(o, b);
      const bool has_min = p.fmt == 3 || p.fmt == kQ4K;
      const float m = has_min ? p.BlockMin(o, b) : 0.0f;
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

// A float panel per thread: kRowTile rows of W dequantized, reused across calls.
float* Panel(int64_t floats) {
  thread_local std::vector<float> panel;
  if (static_cast<int64_t>(panel.size()) < floats) panel.resize(floats);
  return panel.data();
}

// The portable body: a panel of up to kRowTile rows of W dequantized once, then each
// pair of x's rows against it in lanes of 8 the compiler vectorizes.
constexpr int64_t kLanes = 8;

template <int64_t TM>
void PortableTile(const Problem& p, const float* panel, int64_t rows, int64_t o0, int64_t m0) {
  float acc[kRowTile][TM][kLanes] = {};
  for (int64_t j = 0; j < p.I; j += kLanes)
    for (int64_t t = 0; t < TM; ++t) {
      const float* x = p.x + (m0 + t) * p.I + j;
      for (int64_t r = 0; r < kRowTile; ++r) {
        const float* w = panel + r * p.I + j;
#pragma omp simd
        for (int64_t k = 0; k < kLanes; ++k) acc[r][t][k] += x[k] * w[k];
      }
    }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < TM; ++t) {
      float s = 0.0f;
      for (int64_t k = 0; k < kLanes; ++k) s += acc[r][t][k];
      p.out[(m0 + t) * p.O + o0 + r] = s * p.RowScale(o0 + r);
    }
}

void PortableRows(const Problem& p, int64_t begin, int64_t end) {
  float* panel = Panel(kRowTile * p.I);
  for (int64_t o = begin; o < end; o += kRowTile) {
    const int64_t rows = std::min(kRowTile, end - o);
    // Rows past the end of W are zeros: computed, never stored.
    if (rows < kRowTile)
      std::memset(panel + rows * p.I, 0, sizeof(float) * (kRowTile - rows) * p.I);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < p.I / kBlock; ++b) Dequant(p, o + r, b, panel + r * p.I + b * kBlock);
    int64_t m = 0;
    for (; m + 2 <= p.M; m += 2) PortableTile<2>(p, panel, rows, o, m);
    if (m < p.M) PortableTile<1>(p, panel, rows, o, m);
  }
}
#endif

void Rows(const Problem& p, int64_t begin, int64_t end) {
#if defined(__AVX512F__)
  switch (p.fmt) {
    case 0: return Rows512<0>(p, begin, end);
    case 1: return Rows512<1>(p, begin, end);
    case 2: return Rows512<2>(p, begin, end);
    case 3: return Rows512<3>(p, begin, end);
    case kQ4K: return Rows512<kQ4K>(p, begin, end);
    default: return Rows512<kQ6K>(p, begin, end);
  }
#else
  PortableRows(p, begin, end);
#endif
}

ffi::Error QuantMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                       ffi::AnyBuffer scale, ffi::AnyBuffer min,
                       ffi::Buffer<ffi::S32> layer_index, int64_t fmt,
                       ffi::ResultBuffer<ffi::F32> out) {
  Problem p{};
  if (ffi::Error e = ParseQuantOperands("quant_matmul", x.dimensions(), data, scale, min,
                                        layer_index, fmt, kQ6K, &p);
      e.failure())
    return e;
  p.x = x.typed_data();
  // x's vectors are loaded whole from every row of x, once per tile of W: where x does
  // not start on a 32-byte boundary each load straddles two, so x is copied to one that
  // does (XLA's buffers usually do).
  std::vector<float> x_aligned;
  if (reinterpret_cast<uintptr_t>(p.x) % 32) {
    x_aligned.resize(p.M * p.I + 8);
    const uintptr_t address = reinterpret_cast<uintptr_t>(x_aligned.data());
    float* start = x_aligned.data() + (8 - address / sizeof(float) % 8) % 8;
    std::memcpy(start, p.x, sizeof(float) * p.M * p.I);
    p.x = start;
  }
  p.out = out->typed_data();
  SplitRows(pool, p.O, kRowTile, [p](int64_t begin, int64_t end) { Rows(p, begin, end); });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxpd_native

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpdQuantMatmul, jaxpd_native::QuantMatmul,
                              jaxpd_native::QuantProductBinding());
