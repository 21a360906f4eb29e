// CPU float32 kernels for tokenweir (built on first use as a torch extension):
//
// 1. paged_decode_attention: one query token per request, attending its context directly in
//    the block-paged KV cache (no gather into a contiguous buffer).
//
//    Contract (checked by the Python caller, tokenweir/model/attention.py):
//      q            float32 [n, H, D], contiguous
//      kv_cache     float32 [2, num_blocks, block_size, KVH, D], contiguous (0 = K, 1 = V)
//      block_tables int64   [n, max_blocks], contiguous; row i covers seq_lens[i] tokens
//      seq_lens     int64   [n], >= 1
//      out          float32 [n, H, D], contiguous, written
//    Query head h reads kv head h / (H / KVH) (GQA). Softmax in float32 over the whole context.
//
// 2. skinny_linear: x [M, K] @ w[N, K]^T for a FEW rows M (decode batches), on the weight as
//    nn.Linear stores it (no packed copy). Each weight row is read from memory once and
//    multiplied with every row of x, several weight rows at a time sharing each x load; a
//    general GEMM (MKL) packs the weight per call, which costs more than the multiply when M is
//    small. Contract (checked by tokenweir/model/layers.py): x and w float32, contiguous.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// Eight floats: GCC/Clang vector extension, lowered to AVX/NEON/SSE by the target flags.
typedef float vec8 __attribute__((vector_size(32), aligned(4)));

inline vec8 load8(const float* p) { return *reinterpret_cast<const vec8*>(p); }
inline void store8(float* p, vec8 v) { *reinterpret_cast<vec8*>(p) = v; }
inline float hsum(vec8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

constexpr int64_t kHeadTile = 8;  // query heads scored together (independent accumulators)

// scores[h * stride + t] = dot(q_h, k_{h / group}) for query heads [h0, h0 + hn).
// q is already scaled. head_dim must be a multiple of 8.
inline void score_token(const float* q, const float* k_tok, int64_t h0, int64_t hn, int64_t group,
                        int64_t head_dim, float* scores, int64_t stride, int64_t t) {
  vec8 acc[kHeadTile] = {};
  for (int64_t i = 0; i < head_dim; i += 8)
    for (int64_t j = 0; j < hn; ++j)
      acc[j] += load8(q + (h0 + j) * head_dim + i) * load8(k_tok + ((h0 + j) / group) * head_dim + i);
  for (int64_t j = 0; j < hn; ++j) scores[(h0 + j) * stride + t] = hsum(acc[j]);
}

// In place: s[0..n) -> softmax(s).
inline void softmax(float* s, int64_t n) {
  float m = s[0];
  for (int64_t t = 1; t < n; ++t) m = s[t] > m ? s[t] : m;
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}

// Fast path for a GQA group of G query heads sharing one kv head and head_dim % 32 == 0: K and V
// rows are loaded once for the G heads and the accumulators stay in registers.
template <int G>
void score_group(const float* q, const float* k_blk, int64_t nt, int64_t row, int64_t head_dim,
                 float* scores, int64_t stride) {
  for (int64_t j = 0; j < nt; ++j) {
    const float* k = k_blk + j * row;
    vec8 acc[G] = {};
    for (int64_t i = 0; i < head_dim; i += 8) {
      const vec8 kv = load8(k + i);
      for (int g = 0; g < G; ++g) acc[g] += load8(q + g * head_dim + i) * kv;
    }
    for (int g = 0; g < G; ++g) scores[g * stride + j] = hsum(acc[g]);
  }
}

// V pass of one block for one kv head: out[g, c:c+32] += sum_j p[g, j] * v[j, c:c+32].
template <int G>
void accumulate_block(const float* v_blk, int64_t nt, int64_t row, int64_t head_dim,
                      const float* scores, int64_t stride, float* out) {
  for (int64_t c = 0; c < head_dim; c += 32) {
    vec8 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int u = 0; u < 4; ++u) acc[g][u] = load8(out + g * head_dim + c + 8 * u);
    for (int64_t j = 0; j < nt; ++j) {
      const float* v = v_blk + j * row + c;
      const vec8 v0 = load8(v), v1 = load8(v + 8), v2 = load8(v + 16), v3 = load8(v + 24);
      for (int g = 0; g < G; ++g) {
        const float p = scores[g * stride + j];
        acc[g][0] += p * v0;
        acc[g][1] += p * v1;
        acc[g][2] += p * v2;
        acc[g][3] += p * v3;
      }
    }
    for (int g = 0; g < G; ++g)
      for (int u = 0; u < 4; ++u) store8(out + g * head_dim + c + 8 * u, acc[g][u]);
  }
}

// All kv heads of one request, walking its blocks in order (each block's rows are read while
// they are cache-hot for every kv head). q is scaled, [H, D]; out is [H, D].
// Ask for the start of the next block early: blocks sit at unrelated addresses, so the hardware
// prefetcher cannot see the jump coming.
inline void prefetch_block(const float* base, const int64_t* table, int64_t t_next,
                           int64_t seq_len, int64_t block_size, int64_t row) {
  if (t_next >= seq_len) return;
  const char* p = reinterpret_cast<const char*>(base + table[t_next / block_size] * block_size * row);
  for (int i = 0; i < 16; ++i) __builtin_prefetch(p + 64 * i);
}

template <int G>
void attend_groups(const float* q, const float* k_base, const float* v_base, const int64_t* table,
                   int64_t seq_len, int64_t block_size, int64_t kv_heads, int64_t head_dim,
                   float* scores, float* out) {
  const int64_t row = kv_heads * head_dim;
  for (int64_t t0 = 0; t0 < seq_len; t0 += block_size) {
    const float* k_blk = k_base + table[t0 / block_size] * block_size * row;
    const int64_t nt = std::min(block_size, seq_len - t0);
    prefetch_block(k_base, table, t0 + block_size, seq_len, block_size, row);
    for (int64_t kh = 0; kh < kv_heads; ++kh)
      score_group<G>(q + kh * G * head_dim, k_blk + kh * head_dim, nt, row, head_dim,
                     scores + kh * G * seq_len + t0, seq_len);
  }
  for (int64_t h = 0; h < kv_heads * G; ++h) softmax(scores + h * seq_len, seq_len);
  std::fill(out, out + kv_heads * G * head_dim, 0.f);
  for (int64_t t0 = 0; t0 < seq_len; t0 += block_size) {
    const float* v_blk = v_base + table[t0 / block_size] * block_size * row;
    const int64_t nt = std::min(block_size, seq_len - t0);
    prefetch_block(v_base, table, t0 + block_size, seq_len, block_size, row);
    for (int64_t kh = 0; kh < kv_heads; ++kh)
      accumulate_block<G>(v_blk + kh * head_dim, nt, row, head_dim,
                          scores + kh * G * seq_len + t0, seq_len, out + kh * G * head_dim);
  }
}

using GroupFn = void (*)(const float*, const float*, const float*, const int64_t*, int64_t,
                         int64_t, int64_t, int64_t, float*, float*);  // see attend_groups

GroupFn group_fn(int64_t group, int64_t head_dim) {
  if (head_dim % 32 != 0) return nullptr;
  switch (group) {
    case 1: return attend_groups<1>;
    case 2: return attend_groups<2>;
    case 3: return attend_groups<3>;
    case 4: return attend_groups<4>;
    case 5: return attend_groups<5>;
    case 6: return attend_groups<6>;
    case 7: return attend_groups<7>;
    case 8: return attend_groups<8>;
    default: return nullptr;
  }
}

// One request: all heads, scores for every context token, softmax, weighted sum of V.
void attend_one(const float* q_in, const float* k_base, const float* v_base, const int64_t* table,
                int64_t seq_len, int64_t block_size, int64_t num_heads, int64_t kv_heads,
                int64_t head_dim, float scale, float* out, std::vector<float>& q,
                std::vector<float>& scores) {
  const int64_t group = num_heads / kv_heads;
  const int64_t row = kv_heads * head_dim;  // floats per token in one block slot
  q.resize(num_heads * head_dim);
  for (int64_t i = 0; i < num_heads * head_dim; ++i) q[i] = q_in[i] * scale;
  scores.resize(num_heads * seq_len);
  if (GroupFn fn = group_fn(group, head_dim)) {
    fn(q.data(), k_base, v_base, table, seq_len, block_size, kv_heads, head_dim, scores.data(),
       out);
    return;
  }
  // Walk the context block by block: token t lives at slot t % block_size of block
  // table[t / block_size].
  for (int64_t t0 = 0; t0 < seq_len; t0 += block_size) {
    const float* k_blk = k_base + table[t0 / block_size] * block_size * row;
    const int64_t nt = std::min(block_size, seq_len - t0);
    for (int64_t j = 0; j < nt; ++j)
      for (int64_t h0 = 0; h0 < num_heads; h0 += kHeadTile)
        score_token(q.data(), k_blk + j * row, h0, std::min(kHeadTile, num_heads - h0), group,
                    head_dim, scores.data(), seq_len, t0 + j);
  }
  for (int64_t h = 0; h < num_heads; ++h) softmax(scores.data() + h * seq_len, seq_len);
  std::fill(out, out + num_heads * head_dim, 0.f);
  for (int64_t t0 = 0; t0 < seq_len; t0 += block_size) {
    const float* v_blk = v_base + table[t0 / block_size] * block_size * row;
    const int64_t nt = std::min(block_size, seq_len - t0);
    for (int64_t j = 0; j < nt; ++j) {
      const float* v_tok = v_blk + j * row;
      for (int64_t h = 0; h < num_heads; ++h) {
        const float p = scores[h * seq_len + t0 + j];
        const float* v = v_tok + (h / group) * head_dim;
        float* o = out + h * head_dim;
        for (int64_t i = 0; i < head_dim; i += 8) store8(o + i, load8(o + i) + p * load8(v + i));
      }
    }
  }
}

}  // namespace

void paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, double scale, torch::Tensor out) {
  const int64_t n = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t kv_heads = kv_cache.size(3);
  const int64_t max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const float* k_base = kv_cache.data_ptr<float>();
  const float* v_base = k_base + num_blocks * block_size * kv_heads * head_dim;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  TORCH_CHECK(head_dim % 8 == 0, "paged_decode_attention: head_dim must be a multiple of 8");
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_scaled, scores;
    for (int64_t i = begin; i < end; ++i)
      attend_one(qp + i * num_heads * head_dim, k_base, v_base, tables + i * max_blocks, lens[i],
                 block_size, num_heads, kv_heads, head_dim, static_cast<float>(scale),
                 op + i * num_heads * head_dim, q_scaled, scores);
  });
}

namespace {

// out[m, n] for n in [n0, n1) and the MB rows of x from m0: R weight rows at a time, so each x
// load feeds R multiply-adds; R * MB accumulators stay in registers.
template <int MB, int R>
void skinny_tile(const float* x, const float* w, float* out, int64_t K, int64_t N, int64_t m0,
                 int64_t n0, int64_t n1) {
  const int64_t k8 = K & ~int64_t(7);
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    vec8 acc[R][MB] = {};
    for (int64_t k = 0; k < k8; k += 8) {
      vec8 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = load8(w + (n + r) * K + k);
      for (int m = 0; m < MB; ++m) {
        const vec8 xv = load8(x + (m0 + m) * K + k);
        for (int r = 0; r < R; ++r) acc[r][m] += wv[r] * xv;
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) {
        float s = hsum(acc[r][m]);
        for (int64_t k = k8; k < K; ++k) s += w[(n + r) * K + k] * x[(m0 + m) * K + k];
        out[(m0 + m) * N + n + r] = s;
      }
  }
  if (n < n1) skinny_tile<MB, 1>(x, w, out, K, N, m0, n, n1);
}

// Weight rows [n0, n1) against every row of x, in groups of 4, 2 and 1 rows of x (the weight
// rows stay in L1/L2 between groups, so memory sees them once).
void skinny_rows(const float* x, const float* w, float* out, int64_t M, int64_t K, int64_t N,
                 int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t left = M - m0;
    if (left >= 4) {
      skinny_tile<4, 3>(x, w, out, K, N, m0, n0, n1);
      m0 += 4;
    } else if (left >= 2) {
      skinny_tile<2, 4>(x, w, out, K, N, m0, n0, n1);
      m0 += 2;
    } else {
      skinny_tile<1, 6>(x, w, out, K, N, m0, n0, n1);
      m0 += 1;
    }
  }
}

constexpr int64_t kWeightRowsPerTask = 64;  // ~147 KB of weight at K = 576: stays in L2

}  // namespace

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "skinny_linear: x and w disagree on K");
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t tasks = (N + kWeightRowsPerTask - 1) / kWeightRowsPerTask;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      skinny_rows(xp, wp, op, M, K, N, t * kWeightRowsPerTask,
                  std::min(N, (t + 1) * kWeightRowsPerTask));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "x @ w.T for few rows of x (float32, CPU)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a block-paged KV cache (float32, CPU)");
}
