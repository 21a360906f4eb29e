// CPU kernels for tokenweir (built on first use as a torch extension):
//
// 1. paged_attention: causal attention of decodes and prefill chunks over the block-paged KV
//    cache, read in place (no gather); float32 or bfloat16, one variant per instruction set
//    (AVX2, AVX-512) chosen at run time. The body is paged_attention_impl.h; the contract is
//    at paged_attention() below.
//
// 2. skinny_linear: x [M, K] @ w[N, K]^T for a FEW rows M (decode batches), on the weight as
//    nn.Linear stores it (no packed copy). Each weight row is read from memory once and
//    multiplied with every row of x, several weight rows at a time sharing each x load; a
//    general GEMM (MKL) packs the weight per call, which costs more than the multiply when M is
//    small. Contract (checked by tokenweir/model/layers.py): x and w float32, contiguous.
//
// 3. amx_linear: bfloat16 x @ w.T on AMX tiles for batch-invariant mode, every row's sums in
//    one order whatever the rows (contract in amx_linear_impl.h and at amx_linear() below).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

// The in-place paged attention (paged_attention_impl.h), compiled once per instruction set and
// picked at run time (cpu_isa()): the same build runs on AVX2-only and AVX-512 machines.
namespace isa_avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define TW_W 8
#include "paged_attention_impl.h"
#undef TW_W
#pragma GCC pop_options
}  // namespace isa_avx2

namespace isa_avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#define TW_W 16
#include "paged_attention_impl.h"
#undef TW_W
#pragma GCC pop_options
}  // namespace isa_avx512

// AVX-512 with BF16 (Zen 4/5, Cooper Lake, Sapphire Rapids): the AVX-512 variant whose bfloat16
// prefill rows go by vdpbf16ps (TW_BF16_DOT): in one pass with an online softmax where
// head_dim % 64 == 0.
namespace isa_avx512bf16 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")
#define TW_W 16
#define TW_BF16_DOT 1
#include "paged_attention_impl.h"
#undef TW_BF16_DOT
#undef TW_W
#pragma GCC pop_options
}  // namespace isa_avx512bf16

namespace {

// Eight floats: GCC/Clang vector extension, lowered to AVX/NEON/SSE by the target flags.
typedef float vec8 __attribute__((vector_size(32), aligned(4)));

inline vec8 load8(const float* p) { return *reinterpret_cast<const vec8*>(p); }
inline void store8(float* p, vec8 v) { *reinterpret_cast<vec8*>(p) = v; }
inline float hsum(vec8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

}  // namespace

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

// The packed-weight linear (linear_impl.h), one variant per instruction set like the attention.
namespace linear_avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define TW_W 8
#include "linear_impl.h"
#undef TW_W
#pragma GCC pop_options
}  // namespace linear_avx2

namespace linear_avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#define TW_W 16
#include "linear_impl.h"
#undef TW_W
#pragma GCC pop_options
}  // namespace linear_avx512

// Output columns per packed panel for `isa` ("avx2": 16, "avx512": 32; 0: no packed kernel).
int64_t linear_panel_width(std::string isa) {
  if (isa == "avx512" || isa == "avx512bf16") return linear_avx512::kPanel;
  if (isa == "avx2") return linear_avx2::kPanel;
  return 0;
}

// out[M, N] = x[M, K] @ w^T from `packed`, w packed for `isa` (see linear_impl.h):
// [ceil(N / NR), K, NR] float32, NR = linear_panel_width(isa). Contract (checked by
// tokenweir/model/layers.py): x [M, K] float32 contiguous; packed built by pack_linear_weight.
// fixed_order: each row's result is independent of M and of the other rows (linear_impl.h).
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, std::string isa,
                            bool fixed_order) {
  const int64_t M = x.size(0), K = x.size(1), nr = linear_panel_width(isa);
  TORCH_CHECK(nr > 0, "packed_linear: unsupported isa '", isa, "'");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat &&
                  x.is_contiguous() && packed.is_contiguous(),
              "packed_linear: float32, contiguous");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == nr &&
                  packed.size(0) == (N + nr - 1) / nr,
              "packed_linear: packed weight does not match x, N and isa");
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool wide = isa == "avx512" || isa == "avx512bf16";
  at::parallel_for(0, packed.size(0), 1, [&](int64_t p0, int64_t p1) {
    if (wide) linear_avx512::packed_panels(xp, wp, op, M, K, N, p0, p1, fixed_order);
    else linear_avx2::packed_panels(xp, wp, op, M, K, N, p0, p1, fixed_order);
  });
  return out;
}

// ---- amx_linear: bfloat16 x @ w.T on AMX tiles, one order per row (amx_linear_impl.h) -------
#include "amx_linear_impl.h"

// Whether amx_linear runs here: the CPU has AMX-BF16 and the OS granted this process the tiles.
bool amx_linear_available() { return amx_linear_impl::available(); }

// x [M, K] bfloat16 contiguous @ w.T, w packed as amx_linear_impl.h says ([N/16, K/32, 16, 32]
// bfloat16); the result [M, N] in bfloat16, or in float32 holding the bfloat16-rounded values
// (float_out). Each row's bits depend on that row and w only (the header's contract).
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t N, bool float_out) {
  TORCH_CHECK(amx_linear_available(), "amx_linear: no AMX-BF16 on this CPU (or not permitted)");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  x.dim() == 2 && x.is_contiguous() && packed.is_contiguous(),
              "amx_linear: x 2-D bfloat16 contiguous, packed bfloat16 contiguous");
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0 && packed.dim() == 4 && packed.size(0) == N / 16 &&
                  packed.size(1) == K / 32 && packed.size(2) == 16 && packed.size(3) == 32,
              "amx_linear: needs N % 32 == 0, K % 32 == 0 and a weight packed for them");
  auto out = torch::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
#if TW_HAVE_AMX
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  std::vector<uint16_t> tail(size_t(16 * K), 0);  // the last partial 16-row block, zero-padded
  const int64_t full = M / 16 * 16;
  std::memcpy(tail.data(), xp + full * K, size_t((M - full) * K) * sizeof(uint16_t));
  void* op = out.data_ptr();
  at::parallel_for(0, N / 32, 1, [&](int64_t p0, int64_t p1) {
    if (float_out) amx_linear_impl::run_pairs<true>(xp, tail.data(), M, K, wp, op, N, p0, p1);
    else amx_linear_impl::run_pairs<false>(xp, tail.data(), M, K, wp, op, N, p0, p1);
  });
#endif
  return out;
}

// ---- fused elementwise ops of a decoder layer (float32 or bfloat16; compute in float32) ------
//
// Contracts (checked by tokenweir/model/layers.py): every tensor contiguous, on CPU, float32 or
// bfloat16, all of one dtype; norm weight [hidden].
namespace {

inline float bf16_to_float(uint16_t x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t float_to_bf16(float x) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Elements of one row as float32, whatever the storage.
template <typename T>
struct Row;
template <>
struct Row<float> {
  static void load(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }
  static void store(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }
};
template <>
struct Row<uint16_t> {
  static void load(const uint16_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
  }
  static void store(const float* src, uint16_t* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
  }
};

constexpr int64_t kRowsPerTask = 16;

// Rounds like one elementwise op in storage type T would (identity for float32): the fused ops
// match the unfused torch ops bit for bit in float32 and nearly so in bfloat16.
template <typename T>
inline float rd(float x) {
  if constexpr (std::is_same<T, float>::value) return x;
  else return bf16_to_float(float_to_bf16(x));
}

// out[t] = silu(gate_up[t, :I]) * gate_up[t, I:].
template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t b, int64_t e) {
    std::vector<float> g(inter), u(inter);
    for (int64_t t = b; t < e; ++t) {
      Row<T>::load(gu + t * 2 * inter, g.data(), inter);
      Row<T>::load(gu + t * 2 * inter + inter, u.data(), inter);
      for (int64_t i = 0; i < inter; ++i) g[i] = rd<T>(g[i] / (1.f + std::exp(-g[i]))) * u[i];
      Row<T>::store(g.data(), out + t * inter, inter);
    }
  });
}

// residual[t] += x[t] (when x is given); out[t] = rmsnorm(residual[t]) * weight, statistics in
// float32. With bfloat16 storage the sum is rounded to bfloat16 before the norm, as the unfused
// `x + residual` then `norm` would.
template <typename T>
void add_rmsnorm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows,
                      int64_t hidden, float eps) {
  std::vector<float> w(hidden);
  Row<T>::load(weight, w.data(), hidden);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t b, int64_t e) {
    std::vector<float> r(hidden), a(hidden);
    for (int64_t t = b; t < e; ++t) {
      Row<T>::load(residual + t * hidden, r.data(), hidden);
      if (x != nullptr) {
        Row<T>::load(x + t * hidden, a.data(), hidden);
        for (int64_t i = 0; i < hidden; ++i) r[i] += a[i];
        Row<T>::store(r.data(), residual + t * hidden, hidden);
        Row<T>::load(residual + t * hidden, r.data(), hidden);  // the stored (rounded) sum
      }
      float ss = 0.f;
      for (int64_t i = 0; i < hidden; ++i) ss += r[i] * r[i];
      const float inv = 1.f / std::sqrt(ss / float(hidden) + eps);
      // transformers: weight * (normed, rounded to the activation dtype)
      for (int64_t i = 0; i < hidden; ++i) a[i] = rd<T>(r[i] * inv) * w[i];
      Row<T>::store(a.data(), out + t * hidden, hidden);
    }
  });
}

// In place on x [T, heads, D] (a row stride of `stride` elements between tokens): rotate-half
// RoPE with cos/sin [max_pos, D/2] float32 tables at positions[t].
template <typename T>
void rotary_rows(T* x, int64_t rows, int64_t stride, int64_t heads, int64_t d,
                 const int64_t* positions, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t b, int64_t e) {
    std::vector<float> v(d);
    for (int64_t t = b; t < e; ++t) {
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* p = x + t * stride + h * d;
        Row<T>::load(p, v.data(), d);
        float o[512];
        for (int64_t i = 0; i < half; ++i) {
          const float ci = rd<T>(c[i]), si = rd<T>(s[i]);
          o[i] = rd<T>(v[i] * ci) - rd<T>(v[i + half] * si);
          o[i + half] = rd<T>(v[i + half] * ci) + rd<T>(v[i] * si);
        }
        Row<T>::store(o, p, d);
      }
    }
  });
}

}  // namespace

torch::Tensor silu_mul(torch::Tensor gate_up) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16)
    silu_mul_rows(reinterpret_cast<const uint16_t*>(gate_up.data_ptr()),
                  reinterpret_cast<uint16_t*>(out.data_ptr()), rows, inter);
  else
    silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inter);
  return out;
}

// Returns the normed rows; `residual` is updated in place (+= x) when x is defined.
torch::Tensor add_rmsnorm(c10::optional<torch::Tensor> x, torch::Tensor residual,
                          torch::Tensor weight, double eps) {
  auto out = torch::empty_like(residual);
  const int64_t rows = residual.size(0), hidden = residual.size(1);
  if (residual.scalar_type() == at::kBFloat16) {
    auto p = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    add_rmsnorm_rows<uint16_t>(x ? p(*x) : nullptr, p(residual), p(weight), p(out), rows,
                               hidden, float(eps));
  } else {
    add_rmsnorm_rows<float>(x ? x->data_ptr<float>() : nullptr, residual.data_ptr<float>(),
                            weight.data_ptr<float>(), out.data_ptr<float>(), rows, hidden,
                            float(eps));
  }
  return out;
}

// x: a [T, >= heads * D] view whose rows are `x.stride(0)` apart (q and k of the fused qkv).
void rotary_inplace(torch::Tensor x, int64_t heads, int64_t head_dim, torch::Tensor positions,
                    torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(head_dim <= 512 && head_dim % 2 == 0, "rotary_inplace: head_dim");
  const int64_t rows = x.size(0), stride = x.stride(0);
  if (x.scalar_type() == at::kBFloat16)
    rotary_rows(reinterpret_cast<uint16_t*>(x.data_ptr()), rows, stride, heads, head_dim,
                positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>());
  else
    rotary_rows(x.data_ptr<float>(), rows, stride, heads, head_dim,
                positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>());
}

namespace {

// The widest instruction set this CPU runs among those compiled: "avx512bf16" (AVX-512 with
// BF16), "avx512", "avx2" or "" (none: the caller uses the torch path). TOKENWEIR_CPU_ISA names
// a narrower one to force it ("" where this CPU cannot run it).
std::string cpu_isa() {
  __builtin_cpu_init();
  const char* forced = std::getenv("TOKENWEIR_CPU_ISA");
  const std::string want = forced ? forced : "";
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  const bool avx512bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
  if (want == "avx2") return avx2 ? "avx2" : "";
  if (want == "avx512") return avx512 ? "avx512" : "";
  if (want == "avx512bf16") return avx512bf16 ? "avx512bf16" : "";
  if (!want.empty()) return "";
  return avx512bf16 ? "avx512bf16" : avx512 ? "avx512" : avx2 ? "avx2" : "";
}

struct WorkItem {
  int64_t req, row_begin, row_end;
};

// Query rows per work item of a prefill chunk: each K/V block is read from memory once per item
// and reused, from L2, by its rows' tiles; the scores of 16 rows x 9 heads x 1k keys ~ 0.6 MB
// (two-pass paths). The one-pass avx512bf16 path measured no faster with 32 (256 rows of one
// request: slower, the two threads' shares less even).
constexpr int64_t kPrefillRowsPerItem = 16;

// Runs of query rows of every listed request: decodes are one item each; a prefill chunk is cut
// into runs of `rows` rows. (Batch-invariant mode cuts them the same way: its fixed-order items
// give each row the decode's result whatever run it is in; paged_attention_impl.h.)
std::vector<WorkItem> work_items(const int64_t* reqs, int64_t n_reqs, const int64_t* starts,
                                 int64_t rows) {
  std::vector<WorkItem> items;
  for (int64_t i = 0; i < n_reqs; ++i) {
    const int64_t r = reqs[i], q_len = starts[r + 1] - starts[r];
    for (int64_t b = 0; b < q_len; b += rows) items.push_back({r, b, std::min(q_len, b + rows)});
  }
  return items;
}

// Cuts the items (in order) into `parts` runs of about equal cost, cost = the keys an item's
// rows attend (its K/V read and its FLOPs both grow with it): bounds[p]..bounds[p+1]. A static
// split by item count is what at::parallel_for does; with contexts sorted by length (the
// scheduler's running order often is) it gave one of 2 threads ~58% of a 64-decode step.
std::vector<int64_t> balanced_bounds(const std::vector<WorkItem>& items, const int64_t* starts,
                                     const int64_t* seq_lens, int64_t parts) {
  const int64_t n = int64_t(items.size());
  std::vector<double> cum(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const WorkItem& it = items[i];
    const int64_t ctx = seq_lens[it.req] - (starts[it.req + 1] - starts[it.req]);
    const int64_t rows = it.row_end - it.row_begin;
    cum[i + 1] = cum[i] + double(rows) * double(ctx + (it.row_begin + it.row_end + 1) / 2);
  }
  std::vector<int64_t> bounds(parts + 1, n);
  bounds[0] = 0;
  int64_t i = 0;
  for (int64_t p = 1; p < parts; ++p) {
    const double target = cum[n] * double(p) / double(parts);
    while (i < n && cum[i + 1] <= target) ++i;
    bounds[p] = std::max(bounds[p - 1], i);
  }
  return bounds;
}

// Runs every work item, in parallel, one run of about equal cost per thread; `attend` is one
// ISA's attend_item<T>, Scratch its scratch.
template <typename Scratch, typename G, typename T, typename Fn>
void run_paged(const G& g, const T* q, T* out, torch::Tensor& block_tables,
               const int64_t* starts, const int64_t* seq_lens,
               const std::vector<WorkItem>& items, Fn attend) {
  const int64_t per_row = g.num_heads * g.head_dim, max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                               int64_t(items.size())));
  const std::vector<int64_t> bounds = balanced_bounds(items, starts, seq_lens, parts);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    Scratch scratch;
    for (int64_t i = bounds[p0]; i < bounds[p1]; ++i) {
      const WorkItem& it = items[i];
      const int64_t q_len = starts[it.req + 1] - starts[it.req];
      attend(g, tables + it.req * max_blocks, q + starts[it.req] * per_row,
             out + starts[it.req] * per_row, seq_lens[it.req] - q_len, it.row_begin,
             it.row_end, scratch);
    }
  });
}

// One ISA namespace's kernel (NS::Paged, NS::Scratch, NS::attend_item, NS::kMaxTile) on the
// tensors of paged_attention, element type T.
#define TW_RUN_PAGED(NS, T)                                                                    \
  do {                                                                                         \
    const int64_t nb = kv_cache.size(1), bs = kv_cache.size(2), kvh = kv_cache.size(3);       \
    const int64_t d = kv_cache.size(4);                                                        \
    const T* k_base = reinterpret_cast<const T*>(kv_cache.data_ptr());                         \
    NS::Paged<T> g{k_base, k_base + nb * bs * kvh * d, bs, q.size(1), kvh, d,                  \
                   static_cast<float>(scale)};                                                 \
    g.fixed_order = fixed_order;                                                               \
    const int64_t* starts = query_start_loc.data_ptr<int64_t>();                               \
    const auto items = work_items(req_ids.data_ptr<int64_t>(), req_ids.numel(), starts,       \
                                  kPrefillRowsPerItem);                                        \
    run_paged<NS::Scratch>(g, reinterpret_cast<const T*>(q.data_ptr()),                        \
                           reinterpret_cast<T*>(out.data_ptr()), block_tables, starts,         \
                           seq_lens.data_ptr<int64_t>(), items, &NS::attend_item<T>);          \
  } while (0)

}  // namespace

// Causal attention of the listed requests' query rows over their paged context, in place.
// Contract (checked by tokenweir/model/attention.py): q, out [T, H, D] and kv_cache
// [2, num_blocks, block_size, KVH, D] contiguous, all float32 or all bfloat16, D % 8 == 0 (16
// on AVX-512); block_tables int64 [B, max_blocks]; query_start_loc int64 [B + 1]; seq_lens int64
// [B] (context after this step); req_ids int64 [n], the requests to attend. Rows of other
// requests in out are left untouched. `isa` is cpu_isa()'s answer (or a narrower one).
// `fixed_order` (batch-invariant mode): every query row's result is the same bits whatever its
// chunk, its step, its neighbours or its work item: row r of a chunk gets exactly what a decode
// at that position gets (paged_attention_impl.h, "Fixed order").
void paged_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                     torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor req_ids,
                     double scale, torch::Tensor out, std::string isa, bool fixed_order) {
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || q.scalar_type() == at::kFloat, "paged_attention: float32 or bfloat16");
  TORCH_CHECK(kv_cache.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "paged_attention: q, kv_cache and out must share a dtype");
  TORCH_CHECK(kv_cache.size(4) % (isa == "avx2" ? 8 : 16) == 0,
              "paged_attention: head_dim must be a multiple of the vector width");
  if (isa == "avx512bf16" && bf16) TW_RUN_PAGED(isa_avx512bf16, uint16_t);
  else if (isa == "avx512bf16") TW_RUN_PAGED(isa_avx512bf16, float);
  else if (isa == "avx512" && bf16) TW_RUN_PAGED(isa_avx512, uint16_t);
  else if (isa == "avx512") TW_RUN_PAGED(isa_avx512, float);
  else if (isa == "avx2" && bf16) TW_RUN_PAGED(isa_avx2, uint16_t);
  else if (isa == "avx2") TW_RUN_PAGED(isa_avx2, float);
  else TORCH_CHECK(false, "paged_attention: unsupported isa '", isa, "'");
}

// How many threads at::parallel_for really ran `tasks` one-task chunks on (at most
// at::get_num_threads()): 1 when the module was built without OpenMP although torch uses it.
int64_t parallel_width(int64_t tasks) {
  std::vector<char> seen(std::max(1, at::get_num_threads()), 0);
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    const int t = at::get_thread_num();
    if (t >= 0 && t < int(seen.size())) seen[t] = 1;
  });
  return std::count(seen.begin(), seen.end(), 1);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("parallel_width", &parallel_width, "threads at::parallel_for ran the tasks on");
  m.def("cpu_isa", &cpu_isa, "widest compiled instruction set this CPU runs ('' = none)");
  m.def("paged_attention", &paged_attention,
        "causal attention over a block-paged KV cache, read in place (float32/bfloat16, CPU)",
        py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("query_start_loc"),
        py::arg("seq_lens"), py::arg("req_ids"), py::arg("scale"), py::arg("out"),
        py::arg("isa"), py::arg("fixed_order") = false);
  m.def("skinny_linear", &skinny_linear, "x @ w.T for few rows of x (float32, CPU)");
  m.def("linear_panel_width", &linear_panel_width, "output columns per packed panel for an isa");
  m.def("packed_linear", &packed_linear, "x @ w.T from a panel-packed w (float32, CPU)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("isa"),
        py::arg("fixed_order") = false);
  m.def("amx_linear_available", &amx_linear_available, "whether amx_linear runs on this CPU");
  m.def("amx_linear", &amx_linear, "x @ w.T on AMX tiles, one order per row (bfloat16, CPU)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("float_out") = false);
  m.def("silu_mul", &silu_mul, "silu(x[:, :I]) * x[:, I:] (float32/bfloat16, CPU)");
  m.def("add_rmsnorm", &add_rmsnorm, "residual += x; return rmsnorm(residual) * weight",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("rotary_inplace", &rotary_inplace, "rotate-half RoPE of the leading heads, in place");
}
