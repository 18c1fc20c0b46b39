// The product of bfloat16 rows with int8 weights on AMX tiles, reading each weight once for all rows: a decode
// step's few rows, or a prefill chunk's hundreds (polykv_agents/model/int8_tiles.py says where it is used and why).
//
// Shapes (M rows; K input features; N output features; K_pad, N_pad: K and N rounded up to 32 and 64):
//   rows     [M, K]   bfloat16, contiguous
//   packed   [N_pad / 64, K_pad / 32, 4, 16, 16, 2] int8: the weight codes w[n, k] at
//            [n / 64][k / 32][(n % 64) / 16][(k % 32) / 2][n % 16][k % 2], zero where n >= N or k >= K.
//            Each (column block, k block) is four right operands of a bfloat16 tile product (16 pairs of k by 16
//            columns), 2 KiB in a row, so a thread streams its column blocks' weights in memory order.
//   scales   [N]      float, one per output feature: w = code * scale
//   out      [M, N]   bfloat16: rows @ (codes * scales)^T
//
// Float32 rows (a model that computes in float32: a CPU without AVX-512 bfloat16 or AMX) take the vector path,
// int8_linear_float, on AVX-512 or AVX2: [M, K] float32 x the same packed codes -> [M, N] float32 (int8_vectors.h).
//
// A thread widens each column block's int8 codes to bfloat16 (exact: |code| <= 127) once, into a scratch that stays
// in its core's cache, and multiplies them with every 16 rows; the tile
// products sum in float over all of K, the scale applied once per output. So the result is the weight-only
// product of the dequantized weight, rounded to bfloat16 once at the end; up to 16 rows take the time of one (the
// weights cross the memory bus once per step, not once per few rows), and each row's result is its own sum in a
// fixed order, whatever the other rows are.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "amx_tiles.h"

#if POLYKV_TILES && defined(__AVX512BF16__)  // widening to bfloat16 takes AVX-512's bfloat16 conversions too
#define POLYKV_INT8_TILES 1
#else
#define POLYKV_INT8_TILES 0
#endif
#include "int8_vectors.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t MAX_ROWS = 16, K_BLOCK = 32, N_BLOCK = 64, TILE_BYTES = 16 * 16 * 2;

#if POLYKV_INT8_TILES
// Tiles 0-3: [rows x 16] float sums of four column tiles; tile 4: [rows x 32] bfloat16 of the input; tiles 5-6:
// 16 pairs of k by 16 columns of bfloat16 weights.
void configure_tiles(int64_t rows) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 7; ++t) config.colsb[t] = 64, config.rows[t] = t < 5 ? static_cast<uint8_t>(rows) : 16;
  _tile_loadconfig(&config);
}

// 512 int8 codes -> 512 bfloat16 values (exact), 32 at a time.
inline void widen_tile(const int8_t* codes, uint16_t* out) {
  for (int i = 0; i < 512; i += 32) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i));
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
    _mm512_store_si512(reinterpret_cast<__m512i*>(out + i), (__m512i)_mm512_cvtne2ps_pbh(high, low));
  }
}

// Four [tile rows x 16] float sums, one column block of 64 outputs, over all k blocks: `b_tiles(kb)` gives k block
// kb's four right operands, widened to bfloat16.
template <typename Tiles>
inline void block_sums(const uint16_t* rows, int64_t k_pad, Tiles b_tiles, float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < k_pad / K_BLOCK; ++kb) {
    const uint16_t* b = b_tiles(kb);
    _tile_loadd(4, rows + kb * K_BLOCK, k_pad * 2);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 512, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 1024, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, b + 1536, 64);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, sums, N_BLOCK * 4);
  _tile_stored(1, sums + 16, N_BLOCK * 4);
  _tile_stored(2, sums + 32, N_BLOCK * 4);
  _tile_stored(3, sums + 48, N_BLOCK * 4);
}

// out[r, n0 + c] = sums[r, c] * scales[n0 + c], rounded to bfloat16 (nearest even), for `width` columns.
inline void write_block(const float* sums, int64_t tile_rows, int64_t width, const float* scales, int64_t n,
                        int64_t n0, uint16_t* out) {
  for (int64_t r = 0; r < tile_rows; ++r)
    for (int64_t c = 0; c < width; ++c) out[r * n + n0 + c] = c10::BFloat16(sums[r * N_BLOCK + c] * scales[n0 + c]).x;
}

// One thread's column blocks [first, last). Up to 16 rows (a decode step): each k block's codes are widened just
// before their products, into 4 KiB that stay in L1. More rows (a prefill chunk): a column block's codes are widened
// once, into K_pad x 64 bfloat16 (72 KiB for K = 576, in the core's L2), and multiplied with every 16 rows.
void column_blocks(const uint16_t* rows, int64_t m, int64_t k_pad, const int8_t* packed, const float* scales,
                   int64_t n, uint16_t* out, int64_t first, int64_t last) {
  const int64_t k_blocks = k_pad / K_BLOCK, tile_rows = std::min(m, MAX_ROWS), block_codes = k_blocks * 4 * 512;
  thread_local std::vector<uint16_t> storage;  // reused from call to call: no allocation in a decode step
  storage.resize(std::max(storage.size(), static_cast<size_t>((m > MAX_ROWS ? block_codes : 4 * 512) + 32)));
  uint16_t* weights = storage.data() + (32 - reinterpret_cast<uintptr_t>(storage.data()) / 2 % 32) % 32;  // 64 B
  alignas(64) float sums[MAX_ROWS * N_BLOCK];
  configure_tiles(tile_rows);
  for (int64_t block = first; block < last; ++block) {
    const int8_t* codes = packed + block * block_codes;
    const int64_t n0 = block * N_BLOCK, width = std::min(N_BLOCK, n - n0);
    if (m <= MAX_ROWS) {
      block_sums(rows, k_pad, [&](int64_t kb) {
        for (int t = 0; t < 4; ++t) widen_tile(codes + (kb * 4 + t) * 512, weights + t * 512);
        return weights;
      }, sums);
      write_block(sums, tile_rows, width, scales, n, n0, out);
      continue;
    }
    for (int64_t t = 0; t < k_blocks * 4; ++t) widen_tile(codes + t * 512, weights + t * 512);
    for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {  // rows are padded to whole tiles (see int8_linear)
      block_sums(rows + r0 * k_pad, k_pad, [&](int64_t kb) { return weights + kb * 4 * 512; }, sums);
      write_block(sums, MAX_ROWS, width, scales, n, n0, out + r0 * n);
    }
  }
  _tile_release();
}
#endif


// What both paths check of their operands, and the sizes they read from them.
struct Operands {
  int64_t m, k, n, k_pad, n_blocks;
};

Operands check_operands(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales,
                        at::ScalarType row_type, const char* row_name, const char* op) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == row_type, "rows must be [M, K] ", row_name);
  TORCH_CHECK(rows.size(0) >= 1, op, " needs at least one row");
  TORCH_CHECK(packed.dim() == 6 && packed.scalar_type() == at::kChar && packed.is_contiguous(), "packed: see layout");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.is_contiguous(), "scales: [N] float");
  const Operands o{rows.size(0), rows.size(1), scales.size(0), packed.size(1) * K_BLOCK, packed.size(0)};
  TORCH_CHECK(o.k <= o.k_pad && o.k_pad - o.k < K_BLOCK && o.n <= o.n_blocks * N_BLOCK &&
                  o.n_blocks * N_BLOCK - o.n < N_BLOCK,
              "packed weights [", o.n_blocks * N_BLOCK, ", ", o.k_pad, "] do not fit rows of ", o.k, " and ", o.n,
              " scales");
  return o;
}

}  // namespace

bool tiles_available() { return POLYKV_INT8_TILES && polykv::tiles_permitted(); }

// rows [M, K] bfloat16 x packed codes (see the head of this file) -> [M, N] bfloat16.
at::Tensor int8_linear(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(tiles_available(), "int8_linear needs AMX bfloat16 tiles (polykv_agents.kernels.int8_linear)");
  // Plain copies, not structured bindings: the parallel loop's lambda captures them (C++17 forbids bindings there).
  const Operands o = check_operands(rows, packed, scales, at::kBFloat16, "bfloat16", "int8_linear");
  const int64_t m = o.m, k = o.k, n = o.n, k_pad = o.k_pad, n_blocks = o.n_blocks;
  // Up to 16 rows fill one tile's rows; more are padded with zero rows to whole tiles, and the input to K_pad, so
  // every tile load reads whole blocks.
  const int64_t m_pad = m <= MAX_ROWS ? m : (m + MAX_ROWS - 1) / MAX_ROWS * MAX_ROWS;
  auto input = m == m_pad && k == k_pad && rows.is_contiguous()
                   ? rows
                   : at::constant_pad_nd(rows, {0, k_pad - k, 0, m_pad - m}).contiguous();
  auto out = at::empty({m_pad, n}, rows.options());
#if POLYKV_INT8_TILES
  const auto* in = reinterpret_cast<const uint16_t*>(input.data_ptr<at::BFloat16>());
  auto* result = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int8_t* codes = packed.data_ptr<int8_t>();
  const float* scale = scales.data_ptr<float>();
  at::parallel_for(0, n_blocks, 1, [&](int64_t first, int64_t last) {
    column_blocks(in, m_pad, k_pad, codes, scale, n, result, first, last);
  });
#endif
  return m == m_pad ? out : out.narrow(0, 0, m);
}

bool vectors_available() { return POLYKV_INT8_VECTORS; }

std::string vector_instructions() { return polykv::int8_vectors::instructions(); }

// rows [M, K] float32 x packed codes (see the head of this file) -> [M, N] float32 (the vector path).
at::Tensor int8_linear_float(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(vectors_available(), "int8_linear_float needs AVX-512 or AVX2 (polykv_agents.kernels.int8_linear)");
  const Operands o = check_operands(rows, packed, scales, at::kFloat, "float32", "int8_linear_float");
  const int64_t m = o.m, k = o.k, n = o.n, k_pad = o.k_pad, n_blocks = o.n_blocks;
  const auto input = rows.contiguous();
  auto out = at::empty({m, n}, rows.options());
#if POLYKV_INT8_VECTORS
  const float* in = input.data_ptr<float>();
  float* result = out.data_ptr<float>();
  const int8_t* codes = packed.data_ptr<int8_t>();
  const float* scale = scales.data_ptr<float>();
  at::parallel_for(0, n_blocks, 1, [&](int64_t first, int64_t last) {
    polykv::int8_vectors::column_blocks(in, m, k, k_pad, codes, scale, n, result, first, last);
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "rows [M, K] bf16 x int8 weights packed for AMX tiles -> [M, N] bf16 (CPU)");
  m.def("int8_linear_float", &int8_linear_float, "rows [M, K] float32 x the packed int8 weights -> [M, N] float32");
  m.def("vectors_available", &vectors_available, "whether this build has AVX-512 or AVX2 for int8_linear_float");
  m.def("vector_instructions", &vector_instructions, "the vector path's instructions: avx512, avx2 or empty");
  m.def("tiles_available", &tiles_available, "whether this build and CPU have AMX bfloat16 tiles, granted by the OS");
}
