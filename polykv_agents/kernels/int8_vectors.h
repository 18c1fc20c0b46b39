// The int8 kernel's vector path: float32 rows x the int8 codes packed for the tile path (int8_linear.cpp has the
// layout), for a model that computes in float32 (a CPU without AVX-512 bfloat16 or AMX). Included by int8_linear.cpp.
//
// Every output is one chain of fused multiply-adds over k = 0, 1, ..., K - 1 in float32, started at zero and scaled
// once at the end, whatever the number of rows and however they are blocked or spread over threads (threads split
// the columns, never k). So a row's result is bit for bit the same alone or beside any other rows (a decode step's
// agents, a packed admission chunk, a prefill), which neither PyTorch's int8 kernel nor oneDNN's float32 product
// promises; and the same on AVX2 as on AVX-512, which differ only in how many columns one instruction takes.
//
// Few rows (a decode step) widen each code to float32 in registers and multiply it with every row of the block.
// More rows (a prefill chunk) widen a column block's codes once into a [K_pad, 64] scratch (k-major, 144 KiB for
// K = 576, in the core's L2) and multiply it with a block of rows at a time, ROW_CHUNK rows per pass so that the
// rows stay in L2 beside it. Either way a decode step reads each weight from memory once.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define POLYKV_INT8_VECTORS 1
#include <immintrin.h>
#else
#define POLYKV_INT8_VECTORS 0
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

// Internal linkage: a build for other instructions (a test loads an AVX2 build beside the AVX-512 one) may share a
// process with this one, and its functions of the same names must not stand in for these.
namespace polykv::int8_vectors {
namespace {

constexpr int64_t K_BLOCK = 32, N_BLOCK = 64, GROUP = 16, ROW_CHUNK = 96;

#if POLYKV_INT8_VECTORS

#if defined(__AVX512F__)
// One vector: the 16 columns of a tile group. Fused: 6 rows x 4 groups of sums (24 of 32 registers).
struct Isa {
  using V = __m512;
  static constexpr int LANES = 16, GROUPS_PER_PASS = 4, FUSED_ROWS = 6, SCRATCH_ROWS = 6;
  static const char* name() { return "avx512"; }
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_load_ps(p); }
  static void store(float* p, V v) { _mm512_store_ps(p, v); }
  static V broadcast(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // 16 columns x 2 inputs, interleaved: each 16-bit word holds (code at k + 1) << 8 | (code at k, as a byte).
  static void widen_pair(const int8_t* src, V* even, V* odd) {
    const __m512i words = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    even[0] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(words, 24), 24));
    odd[0] = _mm512_cvtepi32_ps(_mm512_srai_epi32(words, 8));
  }
  // out[c] = sums[c] * scales[c] for the first `width` of 16 columns.
  static void store_scaled(float* out, V sums, const float* scales, int64_t width) {
    const __mmask16 mask = width >= LANES ? 0xFFFF : static_cast<__mmask16>((1u << width) - 1);
    _mm512_mask_storeu_ps(out, mask, _mm512_mul_ps(sums, _mm512_maskz_loadu_ps(mask, scales)));
  }
};
#else
// Two vectors per tile group of 16 columns. Fused: 4 rows x 1 group of sums, 8 of 16 registers, beside the group's
// 4 widened vectors; scratch: 6 rows x 1 group.
struct Isa {
  using V = __m256;
  static constexpr int LANES = 8, GROUPS_PER_PASS = 1, FUSED_ROWS = 4, SCRATCH_ROWS = 6;
  static const char* name() { return "avx2"; }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_load_ps(p); }
  static void store(float* p, V v) { _mm256_store_ps(p, v); }
  static V broadcast(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void widen_pair(const int8_t* src, V* even, V* odd) {
    for (int half = 0; half < 2; ++half) {
      const __m256i words = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * half)));
      even[half] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(words, 24), 24));
      odd[half] = _mm256_cvtepi32_ps(_mm256_srai_epi32(words, 8));
    }
  }
  static void store_scaled(float* out, V sums, const float* scales, int64_t width) {
    alignas(32) float lanes[LANES];
    _mm256_store_ps(lanes, sums);
    for (int64_t c = 0; c < std::min<int64_t>(width, LANES); ++c) out[c] = lanes[c] * scales[c];
  }
};
#endif

constexpr int VECTORS_PER_GROUP = GROUP / Isa::LANES;
constexpr int PASS_VECTORS = Isa::GROUPS_PER_PASS * VECTORS_PER_GROUP;  // sums per row in one pass
constexpr int64_t PASS_COLUMNS = Isa::GROUPS_PER_PASS * GROUP;

// out[r, n0 + c] = sums[r][c] * scales[n0 + c], for the pass's columns [c0, c0 + PASS_COLUMNS) of the block.
template <int R>
inline void store_rows(const typename Isa::V (&sums)[R][PASS_VECTORS], const float* scales, int64_t n, int64_t n0,
                       int64_t c0, int64_t width, float* out) {
  for (int v = 0; v < PASS_VECTORS; ++v) {
    const int64_t c = c0 + v * Isa::LANES;
    if (c >= width) break;
    for (int r = 0; r < R; ++r) Isa::store_scaled(out + r * n + n0 + c, sums[r][v], scales + n0 + c, width - c);
  }
}

// R rows straight from one column block's codes (`codes`, its k blocks in the packed layout), widened in registers.
template <int R>
void rows_from_codes(const float* rows, int64_t k, const int8_t* codes, const float* scales, int64_t n, int64_t n0,
                     int64_t width, float* out) {
  for (int g0 = 0; g0 < 4; g0 += Isa::GROUPS_PER_PASS) {
    typename Isa::V sums[R][PASS_VECTORS];
    for (auto& row : sums)
      for (auto& v : row) v = Isa::zero();
    for (int64_t kb = 0; kb * K_BLOCK < k; ++kb) {
      const int pairs = static_cast<int>(std::min<int64_t>(16, (k - kb * K_BLOCK + 1) / 2));
      const bool odd_last = kb * K_BLOCK + 2 * pairs > k;  // K odd: the last pair has no second input
      for (int g = 0; g < Isa::GROUPS_PER_PASS; ++g)
        for (int pair = 0; pair < pairs; ++pair) {
          typename Isa::V even[VECTORS_PER_GROUP], odd[VECTORS_PER_GROUP];
          Isa::widen_pair(codes + ((kb * 4 + g0 + g) * 16 + pair) * 32, even, odd);
          const int64_t i = kb * K_BLOCK + 2 * pair;
          for (int r = 0; r < R; ++r) {
            const auto x = Isa::broadcast(rows[r * k + i]);
            for (int v = 0; v < VECTORS_PER_GROUP; ++v)
              sums[r][g * VECTORS_PER_GROUP + v] = Isa::fma(x, even[v], sums[r][g * VECTORS_PER_GROUP + v]);
          }
          if (odd_last && pair == pairs - 1) continue;
          for (int r = 0; r < R; ++r) {
            const auto x = Isa::broadcast(rows[r * k + i + 1]);
            for (int v = 0; v < VECTORS_PER_GROUP; ++v)
              sums[r][g * VECTORS_PER_GROUP + v] = Isa::fma(x, odd[v], sums[r][g * VECTORS_PER_GROUP + v]);
          }
        }
    }
    store_rows<R>(sums, scales, n, n0, g0 * GROUP, width, out);
  }
}

// One column block's codes -> scratch[k * 64 + c] = the code of column c at input k, as float32.
inline void widen_block(const int8_t* codes, int64_t k_blocks, float* scratch) {
  for (int64_t kb = 0; kb < k_blocks; ++kb)
    for (int g = 0; g < 4; ++g)
      for (int pair = 0; pair < 16; ++pair) {
        typename Isa::V even[VECTORS_PER_GROUP], odd[VECTORS_PER_GROUP];
        Isa::widen_pair(codes + ((kb * 4 + g) * 16 + pair) * 32, even, odd);
        float* row = scratch + (kb * K_BLOCK + 2 * pair) * N_BLOCK + g * GROUP;
        for (int v = 0; v < VECTORS_PER_GROUP; ++v) {
          Isa::store(row + v * Isa::LANES, even[v]);
          Isa::store(row + N_BLOCK + v * Isa::LANES, odd[v]);
        }
      }
}

// R rows against a widened column block: the same chains as rows_from_codes.
template <int R>
void rows_from_scratch(const float* rows, int64_t k, const float* scratch, const float* scales, int64_t n, int64_t n0,
                       int64_t width, float* out) {
  for (int64_t c0 = 0; c0 < N_BLOCK; c0 += PASS_COLUMNS) {
    typename Isa::V sums[R][PASS_VECTORS];
    for (auto& row : sums)
      for (auto& v : row) v = Isa::zero();
    for (int64_t i = 0; i < k; ++i) {
      typename Isa::V w[PASS_VECTORS];
      for (int v = 0; v < PASS_VECTORS; ++v) w[v] = Isa::load(scratch + i * N_BLOCK + c0 + v * Isa::LANES);
      for (int r = 0; r < R; ++r) {
        const auto x = Isa::broadcast(rows[r * k + i]);
        for (int v = 0; v < PASS_VECTORS; ++v) sums[r][v] = Isa::fma(x, w[v], sums[r][v]);
      }
    }
    store_rows<R>(sums, scales, n, n0, c0, width, out);
  }
}

using RowsFromCodes = void (*)(const float*, int64_t, const int8_t*, const float*, int64_t, int64_t, int64_t, float*);
using RowsFromScratch = void (*)(const float*, int64_t, const float*, const float*, int64_t, int64_t, int64_t, float*);

// rows_from_codes<R> for R = 1 ... FUSED_ROWS, rows_from_scratch<R> for R = 1 ... SCRATCH_ROWS.
template <int... R>
constexpr auto from_codes(std::integer_sequence<int, R...>) {
  return std::array<RowsFromCodes, sizeof...(R)>{rows_from_codes<R + 1>...};
}
template <int... R>
constexpr auto from_scratch(std::integer_sequence<int, R...>) {
  return std::array<RowsFromScratch, sizeof...(R)>{rows_from_scratch<R + 1>...};
}
inline constexpr auto FROM_CODES = from_codes(std::make_integer_sequence<int, Isa::FUSED_ROWS>{});
inline constexpr auto FROM_SCRATCH = from_scratch(std::make_integer_sequence<int, Isa::SCRATCH_ROWS>{});

// One thread's column blocks [first, last), for all m rows (rows [m, k] contiguous, out [m, n]).
inline void column_blocks(const float* rows, int64_t m, int64_t k, int64_t k_pad, const int8_t* packed,
                          const float* scales, int64_t n, float* out, int64_t first, int64_t last) {
  const int64_t k_blocks = k_pad / K_BLOCK, block_codes = k_blocks * 4 * 512;
  if (m <= Isa::FUSED_ROWS) {
    for (int64_t block = first; block < last; ++block) {
      const int64_t n0 = block * N_BLOCK;
      FROM_CODES[m - 1](rows, k, packed + block * block_codes, scales, n, n0, std::min(N_BLOCK, n - n0), out);
    }
    return;
  }
  thread_local std::vector<float> storage;  // reused from call to call: no allocation per product
  storage.resize(std::max(storage.size(), static_cast<size_t>(k_pad * N_BLOCK + 16)));
  float* scratch = storage.data() + (16 - reinterpret_cast<uintptr_t>(storage.data()) / 4 % 16) % 16;  // 64 B
  for (int64_t chunk = 0; chunk < m; chunk += ROW_CHUNK) {
    const int64_t chunk_end = std::min(m, chunk + ROW_CHUNK);
    for (int64_t block = first; block < last; ++block) {
      const int64_t n0 = block * N_BLOCK, width = std::min(N_BLOCK, n - n0);
      widen_block(packed + block * block_codes, k_blocks, scratch);
      for (int64_t r0 = chunk; r0 < chunk_end; r0 += Isa::SCRATCH_ROWS) {
        const int64_t r = std::min<int64_t>(Isa::SCRATCH_ROWS, chunk_end - r0);
        FROM_SCRATCH[r - 1](rows + r0 * k, k, scratch, scales, n, n0, width, out + r0 * n);
      }
    }
  }
}

#endif  // POLYKV_INT8_VECTORS

// Which instructions the vector path was built for: "avx512", "avx2", or "" (none: not built).
inline const char* instructions() {
#if POLYKV_INT8_VECTORS
  return Isa::name();
#else
  return "";
#endif
}

}  // namespace
}  // namespace polykv::int8_vectors
