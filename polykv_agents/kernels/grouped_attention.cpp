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
// Work: the prefix of each (group, kv head) is cut into chunks of CHUNK keys, each one task that reads its keys
// and values once for all of the group's queries of that kv head; each (group, kv head, row) suffix is one task.
// Tasks write partial softmax sums (max, sum, weighted values); a last pass merges each query's parts in a fixed
// order, so a group's result never depends on which other groups share the call, nor on the thread count.

#include <torch/extension.h>
#include <ATen/Parallel.h>


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

// Per-thread buffers, reused from task to task.
struct Scratch {
  std::vector<float> queries, rows, scores, top, total;
  std::vector<int64_t> limits;
};

template <typename scalar_t>
struct Group {
  // prefix: [KVH, T, D]; suffix: [rows, KVH, S, D]; query: [H, N, D]
  const scalar_t* prefix_k;
  const scalar_t* prefix_v;
  int64_t pk_head, pk_tok, pv_head, pv_tok;
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

// Queries of (group, kv head), rows [first, last), as float, scaled and transposed: [D, lanes], query m in
// (row, token, head in group) order at lane m; lanes past the last query hold 0.
template <typename scalar_t>
void load_queries(const scalar_t* query, int64_t q_head, int64_t q_tok, const Group<scalar_t>& g, int64_t kv_head,
                  int64_t groups, int64_t dim, int64_t first, int64_t last, float scaling, int64_t lanes,
                  float* out) {
  std::fill(out, out + dim * lanes, 0.0f);
  int64_t m = 0;
  for (int64_t r = first; r < last; ++r)
    for (int64_t i = 0; i < g.width; ++i)
      for (int64_t h = 0; h < groups; ++h, ++m) {
        const scalar_t* src = query + (kv_head * groups + h) * q_head + (g.offset + r * g.width + i) * q_tok;
        for (int64_t d = 0; d < dim; ++d) out[d * lanes + m] = static_cast<float>(src[d]) * scaling;
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

// Attention of M queries (`queries` [D, lanes] from load_queries) over `count` keys and values (rows `k_tok` /
// `v_tok` apart), writing each query's Part. `limit(m)`: how many leading keys query m sees.
//
// Scores are [count, lanes]: a key's score for every query is a broadcast-multiply-add over d into vectors of
// LANES queries, so neither keys nor queries are transposed per key and no dot product is reduced across a
// vector. The softmax then runs down the columns (vectorised across queries) and the weighted values sum over
// the keys with D in registers.
template <typename scalar_t, typename Limit>
void attend(const float* queries, int64_t m_count, int64_t lanes, const scalar_t* keys, int64_t k_tok,
            const scalar_t* values, int64_t v_tok, int64_t count, int64_t dim, Limit limit, Scratch& work,
            const std::vector<Part>& parts) {
  work.rows.resize(static_cast<size_t>(std::max<int64_t>(count, 1) * dim));
  work.scores.resize(static_cast<size_t>(std::max<int64_t>(count, 1) * lanes));
  float* rows = work.rows.data();
  float* scores = work.scores.data();
  to_float(keys, k_tok, count, dim, rows, values, v_tok);  // the values start coming from memory meanwhile
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
  to_float(values, v_tok, count, dim, rows);
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

template <typename scalar_t>
at::Tensor run(const at::Tensor& query, double scaling, const std::vector<at::Tensor>& prefix_keys,
               const std::vector<at::Tensor>& prefix_values, const std::vector<at::Tensor>& suffix_keys,
               const std::vector<at::Tensor>& suffix_values, const std::vector<at::Tensor>& starts,
               const std::vector<at::Tensor>& past, const std::vector<int64_t>& widths) {
  const int64_t heads = query.size(0), tokens = query.size(1), dim = query.size(2);
  const int64_t kv_heads = prefix_keys[0].size(0), groups = heads / kv_heads;
  const int64_t part_size = dim + 2;
  std::vector<Group<scalar_t>> all;
  int64_t offset = 0, scratch = 0;
  for (size_t g = 0; g < prefix_keys.size(); ++g) {
    const auto &pk = prefix_keys[g], &pv = prefix_values[g], &sk = suffix_keys[g], &sv = suffix_values[g];
    Group<scalar_t> group{};
    group.prefix_k = pk.data_ptr<scalar_t>();
    group.prefix_v = pv.data_ptr<scalar_t>();
    group.pk_head = pk.stride(0), group.pk_tok = pk.stride(1), group.pv_head = pv.stride(0);
    group.pv_tok = pv.stride(1), group.prefix_len = pk.size(1);
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
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = tasks[t];
      const Group<scalar_t>& g = all[task.group];
      const int64_t h = task.head;
      const int64_t first = task.prefix ? 0 : task.index, last = task.prefix ? g.rows : task.index + 1;
      const int64_t m_count = (last - first) * g.width * groups;
      const int64_t lanes = (m_count + LANES - 1) / LANES * LANES;
      work.queries.resize(static_cast<size_t>(lanes * dim));
      load_queries(q_data, q_head, q_tok, g, h, groups, dim, first, last, scale, lanes, work.queries.data());
      parts.clear();
      const int64_t p = task.prefix ? task.index : g.chunks;
      for (int64_t m = 0; m < m_count; ++m) parts.push_back(part_at(g, h, p, first * g.width * groups + m));
      if (task.prefix) {
        const int64_t k0 = task.index * CHUNK, count = std::min(CHUNK, g.prefix_len - k0);
        attend(work.queries.data(), m_count, lanes, g.prefix_k + h * g.pk_head + k0 * g.pk_tok, g.pk_tok,
               g.prefix_v + h * g.pv_head + k0 * g.pv_tok, g.pv_tok, count, dim,
               [count](int64_t) { return count; }, work, parts);
      } else {
        const int64_t r = task.index, start = g.starts[r];
        const int64_t count = std::max<int64_t>(0, std::min(g.suffix_len, g.past[r] + g.width) - start);
        const int64_t seen_before = g.past[r] - start;  // slots token 0 sees, besides its own
        const int64_t per_token = groups;
        attend(work.queries.data(), m_count, lanes, g.suffix_k + r * g.sk_row + h * g.sk_head + start * g.sk_tok, g.sk_tok,
               g.suffix_v + r * g.sv_row + h * g.sv_head + start * g.sv_tok, g.sv_tok, count, dim,
               [=](int64_t m) { return std::min(count, seen_before + m / per_token + 1); }, work, parts);
      }
    }
  });

  // Merge each query's parts in order, into out [N, H, D].
  auto out = at::empty({tokens, heads, dim}, query.options());
  scalar_t* out_data = out.data_ptr<scalar_t>();
  at::parallel_for(0, tokens * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(static_cast<size_t>(dim));
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
                             const std::vector<at::Tensor>& past, const std::vector<int64_t>& widths) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [H, N, D] with unit last stride");
  TORCH_CHECK(!prefix_keys.empty(), "at least one group");
  const size_t n = prefix_keys.size();
  TORCH_CHECK(prefix_values.size() == n && suffix_keys.size() == n && suffix_values.size() == n &&
                  starts.size() == n && past.size() == n && widths.size() == n,
              "one prefix, suffix, starts, past and width per group");
  for (size_t g = 0; g < n; ++g)
    for (const at::Tensor* t : {&prefix_keys[g], &prefix_values[g], &suffix_keys[g], &suffix_values[g]}) {
      TORCH_CHECK(t->scalar_type() == query.scalar_type() && t->stride(-1) == 1 && t->device().is_cpu(),
                  "keys and values must be CPU tensors of the query's dtype with unit last stride");
    }
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "grouped_attention", [&] {
    out = run<scalar_t>(query, scaling, prefix_keys, prefix_values, suffix_keys, suffix_values, starts, past,
                        widths);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grouped_attention", &grouped_attention, "cascade attention of many groups in one call (CPU)");
}
