// x @ W for a weight kept quantized (models/quant.py), with x's rows quantized too, as
// llama.cpp multiplies on CPU: each block of 32 elements of a row of x becomes int8
// (d = max|x| / 127, q = x * 127 / max|x| rounded to nearest even, as its Q8
// activations), and each block's dot product with a block of W is taken in integers,
// scaled once by both blocks' scales:
//   int8, q8_0: sum_b dw_b * dx_b * (wq . xq)_b                 (int8: dw = 1, then its
//                                                                row scale)
//   q4_0, q4_1: sum_b dw_b * dx_b * (nibbles . xq)_b + c_b * sx_b, where
//               sx_b = dx_b * sum(xq)_b and c_b = -8 dw_b (q4_0) or m_b (q4_1).
// The integer part is exact; the float sums differ from a reference only in order. x's
// rounding to int8 changes the product by up to half a step of x per element, which is
// why it is an option of the engine, not the float product's contract.
//
// Bodies, by what the build targets: AVX-512 VNNI (`vpdpbusd`: two blocks per vector,
// unsigned by signed bytes into int32; for signed weights x is biased by 128 and the
// bias's product subtracted in the accumulator's start, so every lane stays exact),
// AVX2 (`vpmaddubsw`, then pairs of int16 summed into int32: no sum of two products
// overflows int16, since |wq| <= 128 and |xq| <= 127), and a portable scalar body.
// Register tiles of rows of W by rows of x, over tasks of rows of W on XLA's intra-op
// pool (quant_common.h's SplitRows).
#include <vector>

#include "quant_common.h"

namespace jaxpd_native {
namespace {

constexpr int64_t kBlock = kQuantBlock;
constexpr int64_t kRowTile = 4;    // rows of W per tile: what tasks are made of

struct DotProblem : QuantOperands {
  const int8_t* xq;      // [M, I] x quantized
  const float* xd;       // [M, I/32] its blocks' scales
  const float* xs;       // [M, I/32] dx * sum(xq) per block
  const int32_t* xsum;   // [M, I/32] sum(xq) per block
  float* out;            // [M, O]
  int64_t xb;            // blocks in a row of x
};

// One row of x to int8 blocks (q [I]; d, s and sums [I/32]).
void QuantizeRow(const float* x, int64_t I, int8_t* q, float* d, float* s, int32_t* sums) {
  for (int64_t b = 0; b < I / kBlock; ++b) {
    const float* v = x + b * kBlock;
    int8_t* out = q + b * kBlock;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    // Nearest even under the default rounding mode, as std::nearbyint below.
    const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
    const __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(ql));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(qh));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
#elif defined(__AVX2__)
    __m256 m = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < 4; ++j) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * j)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    __m256i q32[4];
    for (int j = 0; j < 4; ++j)
      q32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), _mm256_set1_ps(id)));
    const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(q32[0], q32[1]),
                                          _mm256_add_epi32(q32[2], q32[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    const int32_t sum = _mm_cvtsi128_si32(s4);
    // int32 -> int16 -> int8 with saturation (nothing saturates: |q| <= 127), then the
    // lanes put back in order (packs works within 128-bit halves).
    const __m256i q16a = _mm256_packs_epi32(q32[0], q32[1]);
    const __m256i q16b = _mm256_packs_epi32(q32[2], q32[3]);
    const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), q8);
#else
    float amax = 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      out[j] = static_cast<int8_t>(std::nearbyint(v[j] * id));
      sum += out[j];
    }
#endif
    d[b] = amax / 127.0f;
    s[b] = d[b] * static_cast<float>(sum);
    sums[b] = sum;
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// Lanes 0-7 take element 0, lanes 8-15 element 1: a scale per block of a block pair.
inline __m512i PairIndex() {
  return _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
}

// Blocks b and b + 1 of row o (b alone, the other zeros, where `two` is false) as 64
// bytes in x's element order: signed for int8/q8_0, the nibbles (0..15) for q4.
template <int64_t FMT>
inline __m512i Weights512(const DotProblem& p, int64_t o, int64_t b, bool two) {
  const uint8_t* row = p.data + o * p.row_bytes;
  if constexpr (FMT <= 1) {
    const uint8_t* at = row + b * kBlock;
    return two ? _mm512_loadu_si512(at) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, at);
  } else {
    const uint8_t* at = row + b * kBlock / 2;
    const __m256i c = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))
                          : _mm256_maskz_loadu_epi8(0xFFFF, at);
    // 128-bit lanes (c0, c0, c1, c1); the second of each pair shifted to its high
    // nibbles.
    const __m512i v = _mm512_shuffle_i64x2(_mm512_castsi256_si512(c), _mm512_castsi256_si512(c), 0x50);
    return _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)),
                            _mm512_set1_epi8(0x0F));
  }
}

// Two float16 block scales (or one) at `at`, each over its block's 8 lanes.
inline __m512 HalfPair(const uint16_t* at, bool two) {
  const uint32_t bits = at[0] | (two ? static_cast<uint32_t>(at[1]) << 16 : 0u);
  const __m512 f = _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_cvtsi32_si128(static_cast<int>(bits))));
  return _mm512_permutexvar_ps(PairIndex(), f);
}

inline __m512 FloatPair(const float* at, bool two) {
  const __m128 v = two ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(at)))
                       : _mm_load_ss(at);
  return _mm512_permutexvar_ps(PairIndex(), _mm512_castps128_ps512(v));
}

// out[m0 + t, o0 + r * stride] for r < TO, t < TM.
template <int64_t FMT, int64_t TO, int64_t TM>
void Tile(const DotProblem& p, int64_t o0, int64_t stride, int64_t m0) {
  __m512 acc[TO][TM];
  for (int64_t r = 0; r < TO; ++r)
    for (int64_t t = 0; t < TM; ++t) acc[r][t] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t b = 0; b < p.xb; b += 2) {
    const bool two = b + 1 < p.xb;
    __m512i w[TO], base[TO];
    __m512 ws[TO];
    for (int64_t r = 0; r < TO; ++r) {
      const int64_t o = o0 + r * stride;
      w[r] = Weights512<FMT>(p, o, b, two);
      if constexpr (FMT != 0)
        ws[r] = HalfPair(static_cast<const uint16_t*>(p.scale) + o * p.nb + b, two);
      if constexpr (FMT <= 1)   // -128 * the weights' sums: the bias of x taken back out
        base[r] = _mm512_sub_epi32(zero, _mm512_slli_epi32(
            _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(1), w[r]), 7));
    }
    for (int64_t t = 0; t < TM; ++t) {
      const int8_t* xq = p.xq + (m0 + t) * p.I + b * kBlock;
      __m512i xv = two ? _mm512_loadu_si512(xq) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, xq);
      if constexpr (FMT <= 1) xv = _mm512_xor_si512(xv, _mm512_set1_epi8(static_cast<char>(0x80)));
      const __m512 dx = FloatPair(p.xd + (m0 + t) * p.xb + b, two);
      for (int64_t r = 0; r < TO; ++r) {
        const __m512i dot = FMT <= 1 ? _mm512_dpbusd_epi32(base[r], xv, w[r])
                                     : _mm512_dpbusd_epi32(zero, w[r], xv);
        const __m512 scale = FMT == 0 ? dx : _mm512_mul_ps(ws[r], dx);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r][t]);
      }
    }
  }
  if constexpr (FMT >= 2) {   // the nibbles' offset: c_b * sx_b, 16 blocks at a time
    for (int64_t b = 0; b < p.xb; b += 16) {
      const __mmask16 mask = p.xb - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (p.xb - b)) - 1);
      for (int64_t r = 0; r < TO; ++r) {
        const int64_t o = o0 + r * stride;
        const uint16_t* from =
            static_cast<const uint16_t*>(FMT == 3 ? p.min : p.scale) + o * p.nb + b;
        __m512 c = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, from));
        if constexpr (FMT == 2) c = _mm512_mul_ps(c, _mm512_set1_ps(-8.0f));
        for (int64_t t = 0; t < TM; ++t)
          acc[r][t] = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(mask, p.xs + (m0 + t) * p.xb + b),
                                      acc[r][t]);
      }
    }
  }
  for (int64_t t = 0; t < TM; ++t) {
    float* out = p.out + (m0 + t) * p.O + o0;
    if constexpr (TO == 4) {
      alignas(16) float s[4];
      _mm_store_ps(s, Sum4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
      for (int64_t r = 0; r < 4; ++r) out[r * stride] = s[r] * p.RowScale(o0 + r * stride);
    } else {
      for (int64_t r = 0; r < TO; ++r)
        out[r * stride] = _mm512_reduce_add_ps(acc[r][t]) * p.RowScale(o0 + r * stride);
    }
  }
}

// Many rows of x (a prompt's): 16 rows of W at a time are first repacked into a panel
// whose vector k of block b holds bytes 4k..4k+3 of that block of each of the 16 rows,
// as unsigned bytes (the nibbles; signed weights biased by 128, the bias's product
// -128 sum(xq) taken back out in the integer sum's start, as q4_0's -8 sum(xq)). A block of a row of x then costs 8 vpdpbusd
// (x's 4-byte groups broadcast), each lane a whole block's dot for its row of W, and one
// scaling for all 16 rows, where the tiles above spend a scaling per 16 products of a
// row of W. The repacking is paid once per 16 rows of W, so it pays with many rows of x.
constexpr int64_t kPanelRows = 16;
constexpr int64_t kPanelMinRows = 16;   // rows of x from which a product takes the panel

struct Panel {
  std::vector<uint8_t> bytes;   // [nb][8][16 rows][4]
  std::vector<float> scale;     // [nb][16]: dw (1 for int8)
  std::vector<float> offset;    // [nb][16]: q4_1's m
};

template <int64_t FMT>
void Repack(const DotProblem& p, int64_t o0, int64_t rows, Panel& panel) {
  panel.bytes.assign(p.xb * 8 * kPanelRows * 4, 0);
  panel.scale.assign(p.xb * kPanelRows, 0.0f);
  panel.offset.assign(p.xb * kPanelRows, 0.0f);
  alignas(32) uint32_t groups[8];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t o = o0 + r;
    const uint8_t* row = p.data + o * p.row_bytes;
    uint32_t* to = reinterpret_cast<uint32_t*>(panel.bytes.data()) + r;
    for (int64_t b = 0; b < p.xb; ++b, to += 8 * kPanelRows) {
      __m256i block;
      if constexpr (FMT <= 1) {
        block = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock)),
                                 _mm256_set1_epi8(static_cast<char>(0x80)));
      } else {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kBlock / 2));
        block = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(c, 4), c), _mm256_set1_epi8(0x0F));
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(groups), block);
      for (int64_t k = 0; k < 8; ++k) to[k * kPanelRows] = groups[k];
      const float dw = FMT == 0 ? 1.0f : p.BlockScaleOf<FMT>(o, b);
      panel.scale[b * kPanelRows + r] = dw;
      if constexpr (FMT == 3) panel.offset[b * kPanelRows + r] = p.BlockMinOf<FMT>(o, b);
    }
  }
}

// Rows m0 .. m0 + TM - 1 of x against the panel of rows o0 .. o0 + rows - 1 of W.
template <int64_t FMT, int64_t TM>
void PanelTile(const DotProblem& p, const Panel& panel, int64_t o0, int64_t rows, int64_t m0) {
  __m512 acc[TM];
  for (int64_t t = 0; t < TM; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i* bytes = reinterpret_cast<const __m512i*>(panel.bytes.data());
  for (int64_t b = 0; b < p.xb; ++b) {
    __m512i w[8];
    for (int64_t k = 0; k < 8; ++k) w[k] = _mm512_loadu_si512(bytes + b * 8 + k);
    __m512i dot[TM];
    for (int64_t t = 0; t < TM; ++t) {
      constexpr int32_t bias = FMT <= 1 ? -128 : FMT == 2 ? -8 : 0;
      dot[t] = _mm512_set1_epi32(bias * p.xsum[(m0 + t) * p.xb + b]);
    }
    for (int64_t k = 0; k < 8; ++k)
      for (int64_t t = 0; t < TM; ++t) {
        int32_t group;
        std::memcpy(&group, p.xq + (m0 + t) * p.I + b * kBlock + 4 * k, 4);
        dot[t] = _mm512_dpbusd_epi32(dot[t], w[k], _mm512_set1_epi32(group));
      }
    const __m512 dw = _mm512_loadu_ps(panel.scale.data() + b * kPanelRows);
    [[maybe_unused]] const __m512 c = _mm512_loadu_ps(panel.offset.data() + b * kPanelRows);
    for (int64_t t = 0; t < TM; ++t) {
      const int64_t at = (m0 + t) * p.xb + b;
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]),
                               _mm512_mul_ps(dw, _mm512_set1_ps(p.xd[at])), acc[t]);
      if constexpr (FMT == 3) acc[t] = _mm512_fmadd_ps(c, _mm512_set1_ps(p.xs[at]), acc[t]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  const __m512 row_scale = FMT == 0
      ? _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p.scale) + o0) : _mm512_set1_ps(1.0f);
  for (int64_t t = 0; t < TM; ++t)
    _mm512_mask_storeu_ps(p.out + (m0 + t) * p.O + o0, mask, _mm512_mul_ps(acc[t], row_scale));
}

template <int64_t FMT, int64_t TM>
void PanelPartial(const DotProblem& p, const Panel& panel, int64_t o0, int64_t rows, int64_t m0,
                  int64_t left) {
  if constexpr (TM > 1) {
    if (left == TM - 1) return PanelTile<FMT, TM - 1>(p, panel, o0, rows, m0);
    return PanelPartial<FMT, TM - 1>(p, panel, o0, rows, m0, left);
  }
}

template <int64_t FMT>
void PanelRows(const DotProblem& p, int64_t begin, int64_t end) {
  constexpr int64_t TM = 8;
  thread_local Panel panel;
  for (int64_t o = begin; o < end; o += kPanelRows) {
    const int64_t rows = std::min(kPanelRows, end - o);
    Repack<FMT>(p, o, rows, panel);
    int64_t m = 0;
    for (; m + TM <= p.M; m += TM) PanelTile<FMT, TM>(p, panel, o, rows, m);
    if (m < p.M) PanelPartial<FMT, TM>(p, panel, o, rows, m, p.M - m);
  }
}
#define JAXPD_DOT_PANEL 1

// Rows of W per tile, rows of x per tile: 4 x 4 (16 accumulators) for the nibble
// formats; signed weights hold a bias per row of W too, so 2 x 8.
template <int64_t FMT> constexpr int64_t kTileO = FMT >= 2 ? 4 : 2;
template <int64_t FMT> constexpr int64_t kTileM = FMT >= 2 ? 4 : 8;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <int64_t FMT, int64_t TO, int64_t TM>
void Tile(const DotProblem& p, int64_t o0, int64_t stride, int64_t m0) {
  __m256 acc[TO][TM];
  for (int64_t r = 0; r < TO; ++r)
    for (int64_t t = 0; t < TM; ++t) acc[r][t] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < p.xb; ++b) {
    __m256i w[TO], sign[TO];
    float ws[TO];
    for (int64_t r = 0; r < TO; ++r) {
      const int64_t o = o0 + r * stride;
      const uint8_t* row = p.data + o * p.row_bytes;
      if constexpr (FMT <= 1) {
        sign[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock));
        w[r] = _mm256_abs_epi8(sign[r]);
      } else {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kBlock / 2));
        w[r] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(c, 4), c), _mm256_set1_epi8(0x0F));
      }
      ws[r] = FMT == 0 ? 1.0f : p.BlockScaleOf<FMT>(o, b);
    }
    for (int64_t t = 0; t < TM; ++t) {
      const __m256i xv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(p.xq + (m0 + t) * p.I + b * kBlock));
      const float dx = p.xd[(m0 + t) * p.xb + b];
      for (int64_t r = 0; r < TO; ++r) {
        // Unsigned by signed bytes: for signed weights |w| by x with w's sign.
        const __m256i pairs = _mm256_maddubs_epi16(w[r], FMT <= 1 ? _mm256_sign_epi8(xv, sign[r]) : xv);
        const __m256i dot = _mm256_madd_epi16(pairs, ones);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(ws[r] * dx), acc[r][t]);
      }
    }
  }
  for (int64_t r = 0; r < TO; ++r) {
    const int64_t o = o0 + r * stride;
    for (int64_t t = 0; t < TM; ++t) {
      float sum = HorizontalSum(acc[r][t]);
      if constexpr (FMT >= 2) {   // the nibbles' offset
        const float* xs = p.xs + (m0 + t) * p.xb;
        for (int64_t b = 0; b < p.xb; ++b)
          sum += (FMT == 3 ? p.BlockMinOf<FMT>(o, b) : -8.0f * p.BlockScaleOf<FMT>(o, b)) * xs[b];
      }
      p.out[(m0 + t) * p.O + o] = sum * p.RowScale(o);
    }
  }
}

template <int64_t FMT> constexpr int64_t kTileO = 2;
template <int64_t FMT> constexpr int64_t kTileM = 2;
#else
// The portable body: one row of W against one row of x, block by block.
template <int64_t FMT, int64_t TO, int64_t TM>
void Tile(const DotProblem& p, int64_t o0, int64_t stride, int64_t m0) {
  for (int64_t r = 0; r < TO; ++r) {
    const int64_t o = o0 + r * stride;
    const uint8_t* row = p.data + o * p.row_bytes;
    for (int64_t t = 0; t < TM; ++t) {
      const int8_t* x = p.xq + (m0 + t) * p.I;
      const float* dx = p.xd + (m0 + t) * p.xb;
      const float* xs = p.xs + (m0 + t) * p.xb;
      float sum = 0.0f;
      for (int64_t b = 0; b < p.xb; ++b) {
        int32_t dot = 0;
        const int8_t* xb = x + b * kBlock;
        if constexpr (FMT <= 1) {
          const int8_t* q = reinterpret_cast<const int8_t*>(row) + b * kBlock;
          for (int64_t j = 0; j < kBlock; ++j) dot += q[j] * xb[j];
        } else {
          const uint8_t* q = row + b * kBlock / 2;
          for (int64_t j = 0; j < kBlock / 2; ++j)
            dot += (q[j] & 0xF) * xb[j] + (q[j] >> 4) * xb[j + kBlock / 2];
        }
        const float dw = FMT == 0 ? 1.0f : p.BlockScaleOf<FMT>(o, b);
        sum += dw * dx[b] * static_cast<float>(dot);
        if constexpr (FMT == 2) sum += -8.0f * dw * xs[b];
        if constexpr (FMT == 3) sum += p.BlockMinOf<FMT>(o, b) * xs[b];
      }
      p.out[(m0 + t) * p.O + o] = sum * p.RowScale(o);
    }
  }
}

template <int64_t FMT> constexpr int64_t kTileO = 1;
template <int64_t FMT> constexpr int64_t kTileM = 1;
#endif

// The tile of `rows` (< TM) rows of x from m0: the last, partial tile.
template <int64_t FMT, int64_t TO, int64_t TM>
void PartialTile(const DotProblem& p, int64_t o0, int64_t stride, int64_t m0, int64_t rows) {
  if constexpr (TM > 1) {
    if (rows == TM - 1) return Tile<FMT, TO, TM - 1>(p, o0, stride, m0);
    return PartialTile<FMT, TO, TM - 1>(p, o0, stride, m0, rows);
  }
}

// Rows [begin, end) of W in tiles of TO rows, one from each of TO equal parts of the
// range (TO sequential streams through W, which the hardware prefetchers follow), in
// groups of kGroup tiles that stay in cache while every tile of x's rows goes over them.
template <int64_t FMT, int64_t TO, int64_t TM>
void Streams(const DotProblem& p, int64_t begin, int64_t end) {
  constexpr int64_t kGroup = 16;
  const int64_t part = (end - begin) / TO;
  for (int64_t g = 0; g < part; g += kGroup) {
    const int64_t group_end = std::min(part, g + kGroup);
    int64_t m = 0;
    for (; m + TM <= p.M; m += TM)
      for (int64_t i = g; i < group_end; ++i) Tile<FMT, TO, TM>(p, begin + i, part, m);
    if (m < p.M)
      for (int64_t i = g; i < group_end; ++i) PartialTile<FMT, TO, TM>(p, begin + i, part, m, p.M - m);
  }
  if constexpr (TO > 1)
    for (int64_t o = begin + TO * part; o < end; ++o)   // rows past the last tile
      Streams<FMT, 1, TM>(p, o, o + 1);
}

template <int64_t FMT>
void RowsOf(const DotProblem& p, int64_t begin, int64_t end) {
#if defined(JAXPD_DOT_PANEL)
  if (p.M >= kPanelMinRows) return PanelRows<FMT>(p, begin, end);
#endif
  // A small batch: all of its rows in one tile, and more rows of W per tile.
  if (p.M <= kTileM<FMT> / 2 && kTileO<FMT> < 4)
    return Streams<FMT, kTileO<FMT> * 2, std::max<int64_t>(1, kTileM<FMT> / 2)>(p, begin, end);
  return Streams<FMT, kTileO<FMT>, kTileM<FMT>>(p, begin, end);
}

void Rows(const DotProblem& p, int64_t begin, int64_t end) {
  switch (p.fmt) {
    case 0: return RowsOf<0>(p, begin, end);
    case 1: return RowsOf<1>(p, begin, end);
    case 2: return RowsOf<2>(p, begin, end);
    default: return RowsOf<3>(p, begin, end);
  }
}

// A buffer whose data starts on a 64-byte boundary.
template <typename T>
T* Aligned(std::vector<T>& buffer, int64_t size) {
  buffer.resize(size + 64 / sizeof(T));
  const uintptr_t address = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + (64 - address % 64) % 64 / sizeof(T);
}

ffi::Error QuantDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                    ffi::AnyBuffer scale, ffi::AnyBuffer min, ffi::Buffer<ffi::S32> layer_index,
                    int64_t fmt, ffi::ResultBuffer<ffi::F32> out) {
  DotProblem p{};
  // The K-quants (fmt 4, 5) are not taken here (models/quant.py's native_dot).
  if (ffi::Error e = ParseQuantOperands("quant_dot", x.dimensions(), data, scale, min,
                                        layer_index, fmt, 3, &p);
      e.failure())
    return e;
  p.xb = p.I / kBlock;
  std::vector<int8_t> q_buffer;
  std::vector<float> d_buffer, s_buffer;
  std::vector<int32_t> sum_buffer;
  int8_t* q = Aligned(q_buffer, p.M * p.I);
  float* d = Aligned(d_buffer, p.M * p.xb);
  float* s = Aligned(s_buffer, p.M * p.xb);
  int32_t* sums = Aligned(sum_buffer, p.M * p.xb);
  const float* xf = x.typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // x's rows are quantized in tasks too where there are many (a prompt's).
  const int64_t row_chunk = std::max<int64_t>(16, p.M / (threads * 2) + 1);
  const int64_t I = p.I, xb = p.xb, M = p.M;
  RunTasks(pool, (p.M + row_chunk - 1) / row_chunk, [=](int64_t c) {
    for (int64_t m = c * row_chunk; m < std::min(M, (c + 1) * row_chunk); ++m)
      QuantizeRow(xf + m * I, I, q + m * I, d + m * xb, s + m * xb, sums + m * xb);
  });
  p.xq = q;
  p.xd = d;
  p.xs = s;
  p.xsum = sums;
  p.out = out->typed_data();
  int64_t tile = kRowTile;
#if defined(JAXPD_DOT_PANEL)
  if (p.M >= kPanelMinRows) tile = kPanelRows;
#endif
  SplitRows(pool, p.O, tile, [p](int64_t begin, int64_t end) { Rows(p, begin, end); });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxpd_native

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpdQuantDot, jaxpd_native::QuantDot,
                              jaxpd_native::QuantProductBinding());
