// Cascade attention of many groups in one call, for CPUs: every group's queries against its own shared prefix
// and its rows' own suffixes, merged exactly by log-sum-exp (polykv_agents/kernels/__init__.py says why).
//
// Shapes (N query tokens in all, H query heads, KVH kv heads, G = H / KVH, D head dim):
//   query   [H, N, D]           any strides with the last one 1; group g's tokens are N[off_g .. off_g + rows*width)
//                               in (row, token) order, as a packed forward lays them out
//   prefix  [KVH, T_g, D]       group g's shared keys / values (one read serves every query of a kv head)
//   suffix  [rows_g, KVH, S_g, D]  group g's rows' own keys / values; row r, token i sees slots
//                               starts[r] .. past[r] + i (left padding before starts[r] is never seen)
//   out     [N, H, D]           in the query's dtype; a query that sees no key gets 0
//
// A group's prefix may instead be read as the pool stores it (a "stored" prefix, never decoded to a tensor):
//   key codes    [KVH, T, D] int8, key scale [KVH, D] float: key = code * scale; the scale is folded into the
//                queries once, so a score is the query's dot product with the int8 codes widened to float
//   value codes  the bit stream of [KVH, T, D] codes of `bits` bits (little-endian, code i at bit i * bits),
//   norms        [KVH, T] half, centroids [2^bits] float (already / sqrt(D)), rotation [D, D] float (or empty):
//                value = norm * centroids[code] @ rotation. The softmax-weighted sum runs in the rotated domain
//                (norm * centroid per key), and the rotation, being linear, is applied once per query to the sum
//                of its prefix parts, before the suffix part (in the model's own domain) is added.
//
// Work: the prefix of each (group, kv head) is cut into chunks of CHUNK keys, each one task that reads its keys
// and values once for all of the group's queries of that kv head; each (group, kv head, row) suffix is one task.
// Tasks write partial softmax sums (max, sum, weighted values); a last pass merges each query's parts in a fixed
// order, so a group's result never depends on which other groups share the call, nor on the thread count.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__) || defined(__AMX_TILE__)
#include <immintrin.h>
#endif
#include "amx_tiles.h"  // POLYKV_TILES: bfloat16 groups may use the tile matrix products

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t CHUNK = 256;  // prefix keys per task
constexpr int64_t LANES = 16;   // queries per score vector (one AVX-512 register of float)
constexpr int64_t KBLOCK = 8;   // keys per register block of scores: 8 independent FMA chains hide the FMA latency
constexpr int64_t QBLOCK = 4;   // queries per register block of the weighted values
constexpr int64_t SLICE = 64;   // head dims per register block of the weighted values
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (scores minus their max), vectorisable: 2^(x log2 e) split into 2^n * 2^r, |r| <= 1/2,
// 2^r by its Taylor polynomial of degree 6 (relative error below 2e-7, a few float ulps);
// below -87 (and -inf, a masked key) it gives 0.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -126.0f * 0.69314718f) * 1.44269504f;
  const float n = std::nearbyint(t);
  const float r = (t - n) * 0.69314718f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// One part of a query's softmax: its max score, its sum of exp(score - max), and the values weighted by those.
// Stored as [D + 2] floats: weighted values, then max, then sum.
struct Part {
  float* data;
  int64_t dim;
  float* values() const { return data; }
  float& max() const { return data[dim]; }
  float& sum() const { return data[dim + 1]; }
};

// Per-thread buffers, reused from task to task. `tiles`: this thread computes with AMX tiles (attend_tiles).
struct Scratch {
  std::vector<float> queries, rows, scores, top, total, tile_out;
  std::vector<int64_t> limits;
  std::vector<uint16_t> queries16, weights16;
  std::vector<uint32_t> key_pairs, value_pairs;
  bool tiles = false;
};

// float -> bfloat16 bits, rounded to nearest even (no NaN reaches it).
inline uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

using polykv::tiles_permitted;

#if POLYKV_TILES
// Every tile product here uses one configuration: tiles 0-3 accumulate [16 x 16] float; tile 4 holds 16 rows of 32
// bfloat16 (the left operand); tiles 5-6 hold 16 rows of 16 bfloat16 pairs (the right operand, pairs along the
// summed dimension).
void configure_tiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 7; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}
#endif

// A prefix as the pool stores it (see the head of this file); bits == 0: the group's prefix is a decoded tensor.
struct Stored {
  const int8_t* key_codes = nullptr;
  int64_t kc_head = 0, kc_tok = 0;
  const float* key_scale = nullptr;  // [KVH, D], contiguous
  const uint8_t* value_codes = nullptr;
  const at::Half* norms = nullptr;
  int64_t norm_head = 0;
  const float* centroids = nullptr;
  const float* rotation = nullptr;  // [D, D], contiguous; nullptr: the codes were not rotated
  int bits = 0;
};

template <typename scalar_t>
struct Group {
  // prefix: [KVH, T, D]; suffix: [rows, KVH, S, D]; query: [H, N, D]
  const scalar_t* prefix_k;
  const scalar_t* prefix_v;
  int64_t pk_head, pk_tok, pv_head, pv_tok;
  Stored stored;
  int64_t prefix_len;
  const scalar_t* suffix_k;
  const scalar_t* suffix_v;
  int64_t sk_row, sk_head, sk_tok, sv_row, sv_head, sv_tok;
  int64_t suffix_len;
  const int64_t* starts;
  const int64_t* past;
  int64_t rows, width, offset;  // query tokens N[offset .. offset + rows * width)
  int64_t chunks;               // prefix chunks
  int64_t scratch;              // first float of this group's parts
};

// `count` rows of `src` (rows `stride` apart) as float [count, D]; bfloat16 widened by a shift, which vectorises.
// Row j of `ahead` (rows `ahead_stride` apart), when given, is fetched into the cache meanwhile: the pass is bound
// by waiting for memory, and two streams in flight wait about as long as one.
template <typename scalar_t>
void to_float(const scalar_t* src, int64_t stride, int64_t count, int64_t dim, float* out,
              const scalar_t* ahead = nullptr, int64_t ahead_stride = 0) {
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t j = 0; j < count; ++j) {
    const scalar_t* row = src + j * stride;
    float* dst = out + j * dim;
    if (ahead != nullptr)
      for (int64_t b = 0; b < row_bytes; b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(ahead + j * ahead_stride) + b);
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      const uint16_t* raw = reinterpret_cast<const uint16_t*>(row);
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) {
        const uint32_t bits = static_cast<uint32_t>(raw[d]) << 16;
        float value;
        std::memcpy(&value, &bits, sizeof(value));
        dst[d] = value;
      }
    } else {
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(row[d]);
    }
  }
}

// Stored keys of kv head h, tokens [t0, t0 + count), as float [count, D]: the int8 codes widened (their scale is
// in the queries).
inline void stored_keys(const Stored& s, int64_t h, int64_t t0, int64_t count, int64_t dim, float* out) {
  for (int64_t j = 0; j < count; ++j) {
    const int8_t* row = s.key_codes + h * s.kc_head + (t0 + j) * s.kc_tok;
    float* dst = out + j * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(row[d]);
  }
}

// Little-endian integer of the `n` (<= 4) bytes at p.
inline uint32_t read_le(const uint8_t* p, int n) {
  uint32_t word = 0;
  for (int i = 0; i < n; ++i) word |= static_cast<uint32_t>(p[i]) << (8 * i);
  return word;
}

#if defined(__AVX512F__)
// Codes of at most 4 bits, 16 at a time, from a row that starts on a byte: codes d0 .. d0 + 15 fill two words of
// `bits` bytes each (code i of 8 at bit i * bits); one variable shift per lane takes each code out of its word, and
// a register holding the whole codebook looks them up.
struct Codes16 {
  int bits;
  __m512 codebook;
  __m512i shift, low;

  explicit Codes16(const Stored& s) : bits(s.bits) {
    alignas(64) float table[16] = {};
    alignas(64) int32_t shifts[16];
    for (int i = 0; i < 16; ++i) shifts[i] = (i % 8) * bits;
    if (bits <= 4) std::copy(s.centroids, s.centroids + (1 << bits), table);
    codebook = _mm512_load_ps(table);
    shift = _mm512_load_si512(shifts);
    low = _mm512_set1_epi32((1 << bits) - 1);
  }

  // norm * centroids[code] for codes d0 .. d0 + 15 of `row`.
  __m512 operator()(const uint8_t* row, int64_t d0, float norm) const {
    const uint32_t w0 = read_le(row + (d0 / 8) * bits, bits), w1 = read_le(row + (d0 / 8 + 1) * bits, bits);
    const __m512i words = _mm512_mask_set1_epi32(_mm512_set1_epi32(static_cast<int32_t>(w0)), 0xFF00,
                                                 static_cast<int32_t>(w1));
    const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(words, shift), low);
    return _mm512_mul_ps(_mm512_permutexvar_ps(codes, codebook), _mm512_set1_ps(norm));
  }
};
#endif

// Stored values of kv head h, tokens [t0, t0 + count), in the rotated domain as float [count, D]:
// norm * centroids[code]. Every 8 codes of a row that starts on a byte fill `bits` whole bytes; where the CPU has
// AVX-512 and a code has at most 4 bits, 16 codes at a time (Codes16). Elsewhere, code by code from its bit position.
inline void stored_values(const Stored& s, int64_t h, int64_t prefix_len, int64_t t0, int64_t count, int64_t dim,
                          float* out) {
  const int bits = s.bits;
  const uint32_t mask = (1u << bits) - 1u;
#if defined(__AVX512F__)
  const bool vector_path = bits <= 4;
  const Codes16 codes16(s);
#endif
  for (int64_t j = 0; j < count; ++j) {
    const int64_t t = t0 + j;
    const float norm = static_cast<float>(s.norms[h * s.norm_head + t]);
    const int64_t first_bit = (h * prefix_len + t) * dim * bits;
    float* dst = out + j * dim;
    int64_t d = 0;
#if defined(__AVX512F__)
    if (vector_path && first_bit % 8 == 0) {
      const uint8_t* row = s.value_codes + first_bit / 8;
      for (; d + 16 <= dim; d += 16) _mm512_storeu_ps(dst + d, codes16(row, d, norm));
    }
#endif
    for (; d < dim; ++d) {
      const int64_t bit = first_bit + d * bits;
      const uint8_t* byte = s.value_codes + bit / 8;
      const int shift_in_byte = static_cast<int>(bit % 8);
      uint32_t word = byte[0];
      if (shift_in_byte + bits > 8) word |= static_cast<uint32_t>(byte[1]) << 8;  // the code spans two bytes
      dst[d] = s.centroids[(word >> shift_in_byte) & mask] * norm;
    }
  }
}

// Queries of (group, kv head), rows [first, last), as float, scaled (and by
// `key_scale [D]`, a stored prefix's, where given) and transposed: [D, lanes], query m in
// (row, token, head in group) order at lane m; lanes past the last query hold 0.
template <typename scalar_t>
void load_queries(const scalar_t* query, int64_t q_head, int64_t q_tok, const Group<scalar_t>& g, int64_t kv_head,
                  int64_t groups, int64_t dim, int64_t first, int64_t last, float scaling, const float* key_scale,
                  int64_t lanes, float* out) {
  std::fill(out, out + dim * lanes, 0.0f);
  int64_t m = 0;
  for (int64_t r = first; r < last; ++r)
    for (int64_t i = 0; i < g.width; ++i)
      for (int64_t h = 0; h < groups; ++h, ++m) {
        const scalar_t* src = query + (kv_head * groups + h) * q_head + (g.offset + r * g.width + i) * q_tok;
        for (int64_t d = 0; d < dim; ++d)
          out[d * lanes + m] = static_cast<float>(src[d]) * scaling * (key_scale ? key_scale[d] : 1.0f);
      }
}

// Scores [count, lanes] of keys as float [count, D] against queries as float [D, lanes] (already scaled).
inline void float_scores(const float* queries, int64_t lanes, const float* rows, int64_t count, int64_t dim,
                         float* scores) {
  for (int64_t q0 = 0; q0 < lanes; q0 += LANES) {
    int64_t j = 0;
    for (; j + KBLOCK <= count; j += KBLOCK) {
      float acc[KBLOCK][LANES] = {};
      for (int64_t d = 0; d < dim; ++d) {
        const float* q = queries + d * lanes + q0;
        for (int64_t jj = 0; jj < KBLOCK; ++jj) {
          const float k = rows[(j + jj) * dim + d];
#pragma omp simd
          for (int64_t l = 0; l < LANES; ++l) acc[jj][l] += k * q[l];
        }
      }
      for (int64_t jj = 0; jj < KBLOCK; ++jj) std::copy(acc[jj], acc[jj] + LANES, scores + (j + jj) * lanes + q0);
    }
    for (; j < count; ++j) {
      float acc[LANES] = {};
      for (int64_t d = 0; d < dim; ++d) {
        const float k = rows[j * dim + d];
        const float* q = queries + d * lanes + q0;
#pragma omp simd
        for (int64_t l = 0; l < LANES; ++l) acc[l] += k * q[l];
      }
      std::copy(acc, acc + LANES, scores + j * lanes + q0);
    }
  }
}

// Attention of M queries (`queries` [D, lanes] from load_queries) over `count` keys and values, writing each query's
// Part. `load_keys(rows)` and `load_values(rows)` write them as float [count, D]; `limit(m)`: how many leading keys
// query m sees.
//
// Scores are [count, lanes]: a key's score for every query is a broadcast-multiply-add over d into vectors of
// LANES queries, so neither keys nor queries are transposed per key and no dot product is reduced across a
// vector. The softmax then runs down the columns (vectorised across queries) and the weighted values sum over
// the keys with D in registers.
template <typename LoadKeys, typename LoadValues, typename Limit>
void attend(const float* queries, int64_t m_count, int64_t lanes, LoadKeys load_keys, LoadValues load_values,
            int64_t count, int64_t dim, Limit limit, Scratch& work, const std::vector<Part>& parts) {
  work.rows.resize(static_cast<size_t>(std::max<int64_t>(count, 1) * dim));
  work.scores.resize(static_cast<size_t>(std::max<int64_t>(count, 1) * lanes));
  float* rows = work.rows.data();
  float* scores = work.scores.data();
  load_keys(rows);
  float_scores(queries, lanes, rows, count, dim, scores);
  // Masked keys, then the softmax down each query's column.
  work.limits.resize(static_cast<size_t>(lanes));
  work.top.assign(static_cast<size_t>(lanes), NEG_INF);
  work.total.assign(static_cast<size_t>(lanes), 0.0f);
  float* top = work.top.data();
  float* total = work.total.data();
  int64_t* seen = work.limits.data();
  for (int64_t m = 0; m < lanes; ++m) seen[m] = m < m_count ? std::min(count, limit(m)) : 0;
  for (int64_t j = 0; j < count; ++j) {
    float* row = scores + j * lanes;
#pragma omp simd
    for (int64_t m = 0; m < lanes; ++m) {
      row[m] = j < seen[m] ? row[m] : NEG_INF;
      top[m] = std::max(top[m], row[m]);
    }
  }
  for (int64_t j = 0; j < count; ++j) {
    float* row = scores + j * lanes;
#pragma omp simd
    for (int64_t m = 0; m < lanes; ++m) {
      row[m] = exp_nonpositive(row[m] - (top[m] == NEG_INF ? 0.0f : top[m]));
      total[m] += row[m];
    }
  }
  for (int64_t m = 0; m < m_count; ++m) {
    parts[m].max() = top[m];
    parts[m].sum() = total[m];
  }
  // Weighted values: the values as float [count, D], read once; per block of QBLOCK queries a sum over the keys
  // held in registers, D in slices of SLICE.
  load_values(rows);
  for (int64_t q0 = 0; q0 < m_count; q0 += QBLOCK) {
    const int64_t qn = std::min(QBLOCK, m_count - q0);
    for (int64_t d0 = 0; d0 < dim; d0 += SLICE) {
      const int64_t slice = std::min(SLICE, dim - d0);
      float acc[QBLOCK][SLICE] = {};
      if (slice == SLICE) {
        for (int64_t k = 0; k < count; ++k) {
          const float* v = rows + k * dim + d0;
          const float* w = scores + k * lanes + q0;  // lanes past m_count hold weights of 0 or of padding
          for (int64_t qq = 0; qq < QBLOCK; ++qq) {
            const float wk = w[qq];
#pragma omp simd
            for (int64_t d = 0; d < SLICE; ++d) acc[qq][d] += wk * v[d];
          }
        }
      } else {
        for (int64_t k = 0; k < count; ++k)
          for (int64_t qq = 0; qq < qn; ++qq)
            for (int64_t d = 0; d < slice; ++d) acc[qq][d] += scores[k * lanes + q0 + qq] * rows[k * dim + d0 + d];
      }
      for (int64_t qq = 0; qq < qn; ++qq) std::copy(acc[qq], acc[qq] + slice, parts[q0 + qq].values() + d0);
    }
  }
}

#if POLYKV_TILES
// The largest of row[0 .. count), -inf for none; 16 running maxima, since a single one is a chain of dependent
// scalar steps (measured: most of a tile task's time at 45 queries).
inline float row_max(const float* row, int64_t count) {
  float lanes[16];
  std::fill(lanes, lanes + 16, NEG_INF);
  int64_t j = 0;
  for (; j + 16 <= count; j += 16)
#pragma omp simd
    for (int l = 0; l < 16; ++l) lanes[l] = std::max(lanes[l], row[j + l]);
  for (; j < count; ++j) lanes[0] = std::max(lanes[0], row[j]);
  return *std::max_element(lanes, lanes + 16);
}

// exp(row[j] - top) for j < seen, 0 for seen <= j < count (a multiple of 16), as bfloat16 into `weights`; returns
// their float sum. Sixteen at a time with AVX-512 (the exp of exp_nonpositive, its 2^n by vscalefps): most of a
// tile task's time went here when the compiler's 8-wide loop did it.
inline float softmax_row(const float* row, int64_t seen, int64_t count, float top, uint16_t* weights) {
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(top), log2e = _mm512_set1_ps(1.44269504f), ln2 = _mm512_set1_ps(0.69314718f);
  const __m512 lowest = _mm512_set1_ps(-126.0f);
  const __m512i round_bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < count; j += 16) {
    const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, seen - j));
    const __mmask16 visible = static_cast<__mmask16>((1u << left) - 1u);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(visible, row + j), shift);
    const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, log2e), lowest);
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), ln2);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512 e = _mm512_maskz_mov_ps(visible, _mm512_scalef_ps(p, n));
    sum = _mm512_add_ps(sum, e);
    // to bfloat16, rounded to nearest even (as to_bf16)
    __m512i bits = _mm512_castps_si512(e);
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(round_bias, _mm512_and_si512(_mm512_srli_epi32(bits, 16), one)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
  }
  return _mm512_reduce_add_ps(sum);
#else
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < count; ++j) {
    const float e = j < seen ? exp_nonpositive(row[j] - top) : 0.0f;
    total += e;
    weights[j] = to_bf16(e);
  }
  return total;
#endif
}

// attend() with AMX tile products, for bfloat16 groups and a head dim that is a multiple of 64. The products run on
// bfloat16 operands with float sums, as PyTorch's fused CPU attention does for bfloat16: the queries (scaled, with
// any stored key scale), the values and the softmax weights are rounded to bfloat16; keys are exact (bfloat16
// already, or int8 codes). `load_queries(out)` writes the M queries as bfloat16 rows [M, D]; `load_keys(work, out,
// K)` and `load_values(work, out, K)` write the `count` keys and values in the layouts below (0 past `count`).
//
// Four [16 x 16] float sums side by side, stored into c (rows c_row floats apart): over `steps` steps, each the
// product of a [16 x 32] bfloat16 left block (rows a_row elements apart; the next step 32 elements on) and four
// right blocks of [16 pairs x 16] (rows b_row pairs apart, 16 pairs apart from each other; the next step b_step
// pairs on). Tiles 0-3 hold the sums, 4 the left block, 5 and 6 the right blocks in turn.
inline void four_tile_sums(const uint16_t* a, int64_t a_row, const uint32_t* b, int64_t b_row, int64_t b_step,
                           int64_t steps, float* c, int64_t c_row) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t step = 0; step < steps; ++step, a += 32, b += b_step) {
    _tile_loadd(4, a, a_row * 2);
    _tile_loadd(5, b, b_row * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 16, b_row * 4);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 32, b_row * 4);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, b + 48, b_row * 4);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, c, c_row * 4);
  _tile_stored(1, c + 16, c_row * 4);
  _tile_stored(2, c + 32, c_row * 4);
  _tile_stored(3, c + 48, c_row * 4);
}

// Layouts (M queries padded to 16, K keys padded to 64), the right operands with pairs along the summed dimension:
//   queries16   [M, D]                                       left operand of the scores
//   key_pairs   [D/2, K] of (key[2p], key[2p+1])              right operand of the scores: the keys transposed
//   scores      [M, K] float -> weights16 [M, K] bfloat16     left operand of the weighted values
//   value_pairs [K/2, D] of (value[2k][d], value[2k+1][d])    right operand of the weighted values
template <typename LoadQueries, typename LoadKeys, typename LoadValues, typename Limit>
void attend_tiles(int64_t m_count, LoadQueries load_queries, LoadKeys load_keys, LoadValues load_values,
                  int64_t count, int64_t dim, Limit limit, Scratch& work, const std::vector<Part>& parts) {
  const int64_t m_pad = (m_count + 15) / 16 * 16, k_pad = std::max<int64_t>((count + 63) / 64 * 64, 64);
  const int64_t pairs = dim / 2;
  work.queries16.resize(static_cast<size_t>(m_pad * dim));
  work.key_pairs.resize(static_cast<size_t>(pairs * k_pad));
  work.scores.resize(static_cast<size_t>(m_pad * k_pad));
  work.weights16.resize(static_cast<size_t>(m_pad * k_pad));
  work.value_pairs.resize(static_cast<size_t>(k_pad / 2 * dim));
  work.tile_out.resize(16 * 64);
  float* scores = work.scores.data();
  uint16_t* q16 = work.queries16.data();
  uint16_t* w16 = work.weights16.data();
  uint32_t* keys = work.key_pairs.data();
  uint32_t* values = work.value_pairs.data();
  load_queries(q16);
  std::fill(q16 + m_count * dim, q16 + m_pad * dim, 0);

  load_keys(work, keys, k_pad);
  // Scores: per 16 queries and 64 keys, four [16 x 16] sums over D in steps of 32.
  for (int64_t q0 = 0; q0 < m_pad; q0 += 16)
    for (int64_t k0 = 0; k0 < k_pad; k0 += 64)
      four_tile_sums(q16 + q0 * dim, dim, keys + k0, k_pad, 16 * k_pad, dim / 32, scores + q0 * k_pad + k0, k_pad);
  // The softmax along each query's row; weights past what a query sees (and of padding queries) are 0.
  for (int64_t m = 0; m < m_pad; ++m) {
    const float* row = scores + m * k_pad;
    uint16_t* weights = w16 + m * k_pad;
    const int64_t seen = m < m_count ? std::min(count, limit(m)) : 0;
    const float top = row_max(row, seen);
    const float total = softmax_row(row, seen, k_pad, top, weights);
    if (m < m_count) parts[m].max() = top, parts[m].sum() = total;
  }
  load_values(work, values, k_pad);
  // Weighted values: per 16 queries and 64 dims, four [16 x 16] sums over the keys in steps of 32.
  float* out = work.tile_out.data();
  for (int64_t q0 = 0; q0 < m_pad; q0 += 16)
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
      four_tile_sums(w16 + q0 * k_pad, k_pad, values + d0, dim, 16 * dim, k_pad / 32, out, 64);
      for (int64_t r = 0; r < 16 && q0 + r < m_count; ++r)
        std::copy(out + r * 64, out + r * 64 + 64, parts[q0 + r].values() + d0);
    }
}

// A task's queries as bfloat16 rows [M, D], M in (row, token, head in group) order, scaled (and by `key_scale`).
template <typename scalar_t>
void queries_bf16(const scalar_t* query, int64_t q_head, int64_t q_tok, const Group<scalar_t>& g, int64_t kv_head,
                  int64_t groups, int64_t dim, int64_t first, int64_t last, float scaling, const float* key_scale,
                  uint16_t* out) {
  for (int64_t r = first; r < last; ++r)
    for (int64_t i = 0; i < g.width; ++i)
      for (int64_t h = 0; h < groups; ++h, out += dim) {
        const scalar_t* src = query + (kv_head * groups + h) * q_head + (g.offset + r * g.width + i) * q_tok;
        for (int64_t d = 0; d < dim; ++d)
          out[d] = to_bf16(static_cast<float>(src[d]) * scaling * (key_scale ? key_scale[d] : 1.0f));
      }
}

// 16 x 16 32-bit elements transposed in registers (r[i][j] becomes r[j][i]).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// `count` keys as key pairs [D/2, K] (see attend_tiles): blocks of 16 keys x 16 pairs transposed in registers; keys
// past `count` are 0. `row(n, p0)`: pairs p0 .. p0 + 15 of key n (dims 2 p0 .. 2 p0 + 31) as bfloat16.
template <typename Row>
inline void key_pairs_of(Row row, int64_t count, int64_t dim, uint32_t* out, int64_t k_pad) {
  const int64_t pairs = dim / 2;
  for (int64_t n0 = 0; n0 < count; n0 += 16) {
    const int64_t keys = std::min<int64_t>(16, count - n0);
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) r[i] = i < keys ? row(n0 + i, p0) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(out + (p0 + j) * k_pad + n0, r[j]);
    }
  }
  const int64_t filled = (count + 15) / 16 * 16;
  for (int64_t p = 0; p < pairs; ++p) std::fill(out + p * k_pad + filled, out + (p + 1) * k_pad, 0u);
}

// `count` rows, each a pointer to D values, interleaved two keys at a time as value pairs [K/2, D] (see
// attend_tiles); keys past `count` are 0. `bits(row, d)`: value d of a row as bfloat16 bits.
template <typename Row, typename Bits>
inline void value_pairs_of(Row row, Bits bits, int64_t count, int64_t dim, uint32_t* out, int64_t k_pad) {
  for (int64_t kp = 0; kp < k_pad / 2; ++kp) {
    uint32_t* dst = out + kp * dim;
    const int64_t a = 2 * kp, b = 2 * kp + 1;
    if (b < count) {
      const auto first = row(a), second = row(b);
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) dst[d] = bits(first, d) | (bits(second, d) << 16);
    } else if (a < count) {
      const auto first = row(a);
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) dst[d] = bits(first, d);
    } else {
      std::fill(dst, dst + dim, 0u);
    }
  }
}

// 16 floats rounded to bfloat16 (to nearest even, as to_bf16), each in the top half of its 32 bits.
inline __m512i bf16_high(__m512 values) {
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(bits, 16),
                                                                                   _mm512_set1_epi32(1)));
  return _mm512_and_si512(_mm512_add_epi32(bits, bias), _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
}

// 32 int8 key codes as 32 bfloat16 (exact: they are integers below 2^8), in order.
inline __m512i int8_to_bf16(const int8_t* codes) {
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  const __m512 high =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16))));
  const __m256i low16 = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(low), 16));
  const __m256i high16 = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(high), 16));
  return _mm512_inserti64x4(_mm512_castsi256_si512(low16), high16, 1);
}

// A stored prefix's values as value pairs [K/2, D] (see attend_tiles), decoded two keys at a time straight into
// bfloat16 pairs, for codes of at most 4 bits whose rows start on a byte (stored_values says how); keys past `count`
// are 0. Elsewhere decoded by stored_values, then paired by value_pairs_of.
inline bool stored_value_pairs(const Stored& s, int64_t h, int64_t prefix_len, int64_t t0, int64_t count,
                               int64_t dim, uint32_t* out, int64_t k_pad) {
  const int bits = s.bits;
  if (bits > 4 || (dim * bits) % 8 != 0 || dim % 16 != 0) return false;
  const Codes16 codes16(s);
  auto decoded = [&](int64_t t, int64_t d0) {  // values d0 .. d0 + 15 of key t0 + t, 0 past `count`
    if (t >= count) return _mm512_setzero_ps();
    const uint8_t* row = s.value_codes + (h * prefix_len + t0 + t) * dim * bits / 8;
    return codes16(row, d0, static_cast<float>(s.norms[h * s.norm_head + t0 + t]));
  };
  for (int64_t kp = 0; kp < k_pad / 2; ++kp)
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
      const __m512i first = _mm512_srli_epi32(bf16_high(decoded(2 * kp, d0)), 16);
      const __m512i second = bf16_high(decoded(2 * kp + 1, d0));
      _mm512_storeu_si512(out + kp * dim + d0, _mm512_or_si512(first, second));
    }
  return true;
}

// bfloat16 bits of a bfloat16 value and of a float (rounded to nearest even), widened for value_pairs_of.
inline uint32_t bf16_bits(const uint16_t* row, int64_t d) { return row[d]; }
inline uint32_t bf16_bits(const float* row, int64_t d) { return to_bf16(row[d]); }
#endif

// attend() over keys and values held as tensors in the model's dtype (rows `k_tok` / `v_tok` apart).
template <typename scalar_t, typename Limit>
void attend_rows(const float* queries, int64_t m_count, int64_t lanes, const scalar_t* keys, int64_t k_tok,
                 const scalar_t* values, int64_t v_tok, int64_t count, int64_t dim, Limit limit, Scratch& work,
                 const std::vector<Part>& parts) {
  attend(queries, m_count, lanes,
         // the values start coming from memory while the keys are widened
         [&](float* rows) { to_float(keys, k_tok, count, dim, rows, values, v_tok); },
         [&](float* rows) { to_float(values, v_tok, count, dim, rows); }, count, dim, limit, work, parts);
}

template <typename scalar_t>
at::Tensor run(const at::Tensor& query, double scaling, const std::vector<at::Tensor>& prefix_keys,
               const std::vector<at::Tensor>& prefix_values, const std::vector<at::Tensor>& suffix_keys,
               const std::vector<at::Tensor>& suffix_values, const std::vector<at::Tensor>& starts,
               const std::vector<at::Tensor>& past, const std::vector<int64_t>& widths,
               const std::vector<std::vector<at::Tensor>>& stored, bool tiles) {
  const int64_t heads = query.size(0), tokens = query.size(1), dim = query.size(2);
  // AMX tiles: asked for, for bfloat16, a head dim the tile loops cover, and granted by the OS.
  tiles = tiles && std::is_same_v<scalar_t, c10::BFloat16> && dim % 64 == 0 && tiles_permitted();
  const int64_t kv_heads = suffix_keys[0].size(1), groups = heads / kv_heads;
  const int64_t part_size = dim + 2;
  std::vector<Group<scalar_t>> all;
  int64_t offset = 0, scratch = 0;
  for (size_t g = 0; g < prefix_keys.size(); ++g) {
    const auto &pk = prefix_keys[g], &pv = prefix_values[g], &sk = suffix_keys[g], &sv = suffix_values[g];
    Group<scalar_t> group{};
    if (stored[g].empty()) {
      group.prefix_k = pk.data_ptr<scalar_t>();
      group.prefix_v = pv.data_ptr<scalar_t>();
      group.pk_head = pk.stride(0), group.pk_tok = pk.stride(1), group.pv_head = pv.stride(0);
      group.pv_tok = pv.stride(1), group.prefix_len = pk.size(1);
    } else {
      const auto &codes = stored[g][0], &norms = stored[g][3], &centroids = stored[g][4], &rotation = stored[g][5];
      group.stored.key_codes = codes.data_ptr<int8_t>();
      group.stored.kc_head = codes.stride(0), group.stored.kc_tok = codes.stride(1);
      group.stored.key_scale = stored[g][1].data_ptr<float>();
      group.stored.value_codes = stored[g][2].data_ptr<uint8_t>();
      group.stored.norms = norms.data_ptr<at::Half>();
      group.stored.norm_head = norms.stride(0);
      group.stored.centroids = centroids.data_ptr<float>();
      group.stored.rotation = rotation.numel() ? rotation.data_ptr<float>() : nullptr;
      group.stored.bits = static_cast<int>(std::lround(std::log2(static_cast<double>(centroids.numel()))));
      group.prefix_len = codes.size(1);
    }
    group.suffix_k = sk.data_ptr<scalar_t>();
    group.suffix_v = sv.data_ptr<scalar_t>();
    group.sk_row = sk.stride(0), group.sk_head = sk.stride(1), group.sk_tok = sk.stride(2);
    group.sv_row = sv.stride(0), group.sv_head = sv.stride(1), group.sv_tok = sv.stride(2);
    group.suffix_len = sk.size(2);
    group.starts = starts[g].data_ptr<int64_t>();
    group.past = past[g].data_ptr<int64_t>();
    group.rows = sk.size(0), group.width = widths[g], group.offset = offset;
    group.chunks = (group.prefix_len + CHUNK - 1) / CHUNK;
    group.scratch = scratch;
    const int64_t queries = group.rows * group.width * groups;
    scratch += kv_heads * (group.chunks + 1) * queries * part_size;
    offset += group.rows * group.width;
    all.push_back(group);
  }
  TORCH_CHECK(offset == tokens, "the groups hold ", offset, " query tokens; the query has ", tokens);
  std::vector<float> partials(static_cast<size_t>(scratch));
  // Part p of (group g, kv head h, query m), m in (row, token, head in group) order; p < chunks: a prefix chunk,
  // p == chunks: the suffix.
  auto part_at = [&](const Group<scalar_t>& g, int64_t h, int64_t p, int64_t m) {
    const int64_t queries = g.rows * g.width * groups;
    return Part{partials.data() + g.scratch + ((h * (g.chunks + 1) + p) * queries + m) * part_size, dim};
  };

  // The tasks: (group, kv head, prefix chunk) then (group, kv head, row) for suffixes.
  struct Task {
    int64_t group, head, index;
    bool prefix;
  };
  std::vector<Task> tasks;
  for (int64_t g = 0; g < static_cast<int64_t>(all.size()); ++g)
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t c = 0; c < all[g].chunks; ++c) tasks.push_back({g, h, c, true});
      for (int64_t r = 0; r < all[g].rows; ++r) tasks.push_back({g, h, r, false});
    }
  const scalar_t* q_data = query.data_ptr<scalar_t>();
  const int64_t q_head = query.stride(0), q_tok = query.stride(1);
  const float scale = static_cast<float>(scaling);

  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch work;
    std::vector<Part> parts;
#if POLYKV_TILES
    work.tiles = tiles;
    if (tiles) configure_tiles();  // tile configuration is per thread
#endif
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = tasks[t];
      const Group<scalar_t>& g = all[task.group];
      const int64_t h = task.head;
      const int64_t first = task.prefix ? 0 : task.index, last = task.prefix ? g.rows : task.index + 1;
      const int64_t m_count = (last - first) * g.width * groups;
      // A stored prefix's key scale goes into the queries that read it (and only into those).
      const float* key_scale = task.prefix && g.stored.bits ? g.stored.key_scale + h * dim : nullptr;
      parts.clear();
      const int64_t p = task.prefix ? task.index : g.chunks;
      for (int64_t m = 0; m < m_count; ++m) parts.push_back(part_at(g, h, p, first * g.width * groups + m));
      // What the task reads: a prefix chunk (stored or a tensor's), or row r's suffix slots from `start`.
      const int64_t k0 = task.index * CHUNK, r = task.index, start = task.prefix ? 0 : g.starts[r];
      const int64_t count = task.prefix ? std::min(CHUNK, g.prefix_len - k0)
                                        : std::max<int64_t>(0, std::min(g.suffix_len, g.past[r] + g.width) - start);
      const bool stored_chunk = task.prefix && g.stored.bits;  // then it has no tensor of keys and values
      const scalar_t* keys = stored_chunk  ? nullptr
                             : task.prefix ? g.prefix_k + h * g.pk_head + k0 * g.pk_tok
                                           : g.suffix_k + r * g.sk_row + h * g.sk_head + start * g.sk_tok;
      const scalar_t* values = stored_chunk  ? nullptr
                               : task.prefix ? g.prefix_v + h * g.pv_head + k0 * g.pv_tok
                                             : g.suffix_v + r * g.sv_row + h * g.sv_head + start * g.sv_tok;
      const int64_t k_tok = task.prefix ? g.pk_tok : g.sk_tok, v_tok = task.prefix ? g.pv_tok : g.sv_tok;
      // A prefix chunk is seen whole; suffix token i of the row sees the slots before it and its own.
      const int64_t seen_before = task.prefix ? count : g.past[r] - start, per_token = groups;
      auto limit = [=](int64_t m) {
        return task.prefix ? count : std::min(count, seen_before + m / per_token + 1);
      };
#if POLYKV_TILES
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        if (work.tiles) {
          attend_tiles(
              m_count,
              [&](uint16_t* out) {
                queries_bf16(q_data, q_head, q_tok, g, h, groups, dim, first, last, scale, key_scale, out);
              },
              [&](Scratch& w, uint32_t* out, int64_t k_pad) {
                if (!stored_chunk) {
                  const uint16_t* rows = reinterpret_cast<const uint16_t*>(keys);
                  auto row = [&](int64_t n, int64_t p0) { return _mm512_loadu_si512(rows + n * k_tok + 2 * p0); };
                  return key_pairs_of(row, count, dim, out, k_pad);
                }
                const int8_t* codes = g.stored.key_codes + h * g.stored.kc_head + k0 * g.stored.kc_tok;
                auto row = [&](int64_t n, int64_t p0) { return int8_to_bf16(codes + n * g.stored.kc_tok + 2 * p0); };
                key_pairs_of(row, count, dim, out, k_pad);
              },
              [&](Scratch& w, uint32_t* out, int64_t k_pad) {
                if (!stored_chunk) {
                  const uint16_t* rows = reinterpret_cast<const uint16_t*>(values);
                  auto row = [&](int64_t n) { return rows + n * v_tok; };
                  return value_pairs_of(row, [](const uint16_t* r, int64_t d) { return bf16_bits(r, d); }, count,
                                        dim, out, k_pad);
                }
                if (stored_value_pairs(g.stored, h, g.prefix_len, k0, count, dim, out, k_pad)) return;
                w.rows.resize(static_cast<size_t>(std::max<int64_t>(count, 1) * dim));
                stored_values(g.stored, h, g.prefix_len, k0, count, dim, w.rows.data());
                const float* rows = w.rows.data();
                auto row = [&](int64_t n) { return rows + n * dim; };
                value_pairs_of(row, [](const float* r, int64_t d) { return bf16_bits(r, d); }, count, dim, out,
                               k_pad);
              },
              count, dim, limit, work, parts);
          continue;
        }
      }
#endif
      const int64_t lanes = (m_count + LANES - 1) / LANES * LANES;
      work.queries.resize(static_cast<size_t>(lanes * dim));
      load_queries(q_data, q_head, q_tok, g, h, groups, dim, first, last, scale, key_scale, lanes,
                   work.queries.data());
      if (stored_chunk)
        attend(work.queries.data(), m_count, lanes,
               [&](float* rows) { stored_keys(g.stored, h, k0, count, dim, rows); },
               [&](float* rows) { stored_values(g.stored, h, g.prefix_len, k0, count, dim, rows); }, count, dim,
               limit, work, parts);
      else
        attend_rows(work.queries.data(), m_count, lanes, keys, k_tok, values, v_tok, count, dim, limit, work,
                    parts);
    }
#if POLYKV_TILES
    if (tiles) _tile_release();
#endif
  });

  // Merge each query's parts in order, into out [N, H, D].
  auto out = at::empty({tokens, heads, dim}, query.options());
  scalar_t* out_data = out.data_ptr<scalar_t>();
  at::parallel_for(0, tokens * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(static_cast<size_t>(dim)), rotated(static_cast<size_t>(dim));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / kv_heads, h = item % kv_heads;
      size_t gi = 0;
      while (!(all[gi].offset <= n && n < all[gi].offset + all[gi].rows * all[gi].width)) ++gi;
      const Group<scalar_t>& g = all[gi];
      for (int64_t hg = 0; hg < groups; ++hg) {
        const int64_t m = (n - g.offset) * groups + hg;
        float top = NEG_INF;
        for (int64_t p = 0; p <= g.chunks; ++p) top = std::max(top, part_at(g, h, p, m).max());
        std::fill(merged.begin(), merged.end(), 0.0f);
        float total = 0.0f;
        if (top != NEG_INF) {
          for (int64_t p = 0; p <= g.chunks; ++p) {
            if (p == g.chunks && g.stored.rotation != nullptr) {
              // The prefix parts' sum is in the rotated domain: rotate it once, before the suffix joins.
              std::fill(rotated.begin(), rotated.end(), 0.0f);
              for (int64_t e = 0; e < dim; ++e) {
                const float y = merged[e];
                const float* row = g.stored.rotation + e * dim;
#pragma omp simd
                for (int64_t d = 0; d < dim; ++d) rotated[d] += y * row[d];
              }
              merged.swap(rotated);
            }
            const Part part = part_at(g, h, p, m);
            if (part.max() == NEG_INF) continue;
            const float w = std::exp(part.max() - top);
            total += w * part.sum();
            for (int64_t d = 0; d < dim; ++d) merged[d] += w * part.values()[d];
          }
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        scalar_t* dst = out_data + (n * heads + h * groups + hg) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(merged[d] * inv);
      }
    }
  });
  return out;
}

at::Tensor grouped_attention(const at::Tensor& query, double scaling, const std::vector<at::Tensor>& prefix_keys,
                             const std::vector<at::Tensor>& prefix_values, const std::vector<at::Tensor>& suffix_keys,
                             const std::vector<at::Tensor>& suffix_values, const std::vector<at::Tensor>& starts,
                             const std::vector<at::Tensor>& past, const std::vector<int64_t>& widths,
                             const std::vector<std::vector<at::Tensor>>& stored, bool tiles) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [H, N, D] with unit last stride");
  TORCH_CHECK(!prefix_keys.empty(), "at least one group");
  const size_t n = prefix_keys.size();
  const int64_t dim = query.size(2);
  TORCH_CHECK(prefix_values.size() == n && suffix_keys.size() == n && suffix_values.size() == n &&
                  starts.size() == n && past.size() == n && widths.size() == n && stored.size() == n,
              "one prefix, suffix, starts, past, width and stored prefix per group");
  for (size_t g = 0; g < n; ++g) {
    std::vector<const at::Tensor*> own = {&suffix_keys[g], &suffix_values[g]};
    if (stored[g].empty()) own.insert(own.end(), {&prefix_keys[g], &prefix_values[g]});
    for (const at::Tensor* t : own)
      TORCH_CHECK(t->scalar_type() == query.scalar_type() && t->stride(-1) == 1 && t->device().is_cpu(),
                  "keys and values must be CPU tensors of the query's dtype with unit last stride");
    if (stored[g].empty()) continue;
    TORCH_CHECK(stored[g].size() == 6, "a stored prefix is (key codes, key scale, value codes, norms, centroids, "
                "rotation)");
    const auto &codes = stored[g][0], &scale = stored[g][1], &values = stored[g][2], &norms = stored[g][3];
    const auto &centroids = stored[g][4], &rotation = stored[g][5];
    const int64_t kv_heads = suffix_keys[g].size(1);
    TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 3 && codes.size(0) == kv_heads &&
                    codes.size(2) == dim && codes.stride(2) == 1,
                "stored key codes must be int8 [KVH, T, D] with unit last stride");
    const int64_t tokens = codes.size(1);
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == kv_heads * dim,
                "stored key scales must be contiguous float [KVH, D]");
    const int64_t levels = centroids.numel();
    TORCH_CHECK(centroids.scalar_type() == at::kFloat && centroids.is_contiguous() && levels >= 2 && levels <= 256 &&
                    (levels & (levels - 1)) == 0,
                "stored centroids must be contiguous float [2^bits], bits 1..8");
    const int64_t bits = static_cast<int64_t>(std::lround(std::log2(static_cast<double>(levels))));
    TORCH_CHECK(values.scalar_type() == at::kByte && values.is_contiguous() &&
                    values.numel() * 8 >= kv_heads * tokens * dim * bits,
                "stored value codes must be a contiguous uint8 bit stream of [KVH, T, D] codes");
    TORCH_CHECK(norms.scalar_type() == at::kHalf && norms.dim() == 2 && norms.size(0) == kv_heads &&
                    norms.size(1) == tokens && norms.stride(1) == 1,
                "stored value norms must be half [KVH, T] with unit last stride");
    TORCH_CHECK(rotation.numel() == 0 || (rotation.scalar_type() == at::kFloat && rotation.is_contiguous() &&
                                          rotation.numel() == dim * dim),
                "a stored rotation must be contiguous float [D, D], or empty");
    for (const at::Tensor* t : {&codes, &scale, &values, &norms, &centroids, &rotation})
      TORCH_CHECK(t->device().is_cpu(), "a stored prefix must be on the CPU");
  }
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "grouped_attention", [&] {
    out = run<scalar_t>(query, scaling, prefix_keys, prefix_values, suffix_keys, suffix_values, starts, past,
                        widths, stored, tiles);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grouped_attention", &grouped_attention, "cascade attention of many groups in one call (CPU)");
  m.def("tiles_available", &tiles_permitted, "whether this build and CPU compute bfloat16 groups with AMX tiles");
}
