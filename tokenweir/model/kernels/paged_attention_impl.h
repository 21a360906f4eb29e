// Paged attention that reads K/V blocks in place (no gather), for decodes AND prefill chunks
// with a cached prefix. Torch-free: included by cpu_kernels.cpp once per instruction set, inside
// a namespace and a `#pragma GCC target` region, with TW_W = floats per vector (8: AVX2,
// 16: AVX-512). No include guard on purpose.
//
// Element type T of q, the cache and out: float, or uint16_t holding bfloat16 bits. Compute is
// float32 throughout (bf16 is widened by a 16-bit shift, rounded to nearest-even on store),
// except in TW_BF16_DOT builds (AVX-512 BF16), where bfloat16 prefill rows take their dot
// products by vdpbf16ps (float32 accumulation, bf16 inputs): in one pass with an online
// softmax where head_dim % 64 == 0 (attend_item_flash), else in the two passes below
// (block_dp).
//
// Work item = (request, a run of its query rows), every head. Its query vectors ((row, head)
// pairs) are grouped by kv head (GQA) into tiles of up to kMaxTile that share each K/V row
// load. Row r of a request with `ctx` tokens cached before the chunk attends keys [0, ctx + r]
// (causal). Both passes (scores, then softmax, then values) walk the blocks in order and run
// every tile on a block while it is cache-hot, so each block is read from memory once per pass.

constexpr int kMaxTile = 6;  // query vectors per tile: accumulators + loads fit 16 registers

typedef float vf __attribute__((vector_size(TW_W * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(TW_W * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(TW_W * 4), aligned(4)));

inline vf load_vec(const float* p) { return *reinterpret_cast<const vf*>(p); }
inline vf load_vec(const uint16_t* p) {
  const vu wide = __builtin_convertvector(*reinterpret_cast<const vh*>(p), vu) << 16;
  vf out;
  __builtin_memcpy(&out, &wide, sizeof out);
  return out;
}
inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < TW_W; ++i) s += v[i];
  return s;
}
inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
inline void store_elem(float* p, float x) { *p = x; }
inline void store_elem(uint16_t* p, float x) {  // round to nearest even (no NaN inputs here)
  uint32_t bits;
  __builtin_memcpy(&bits, &x, 4);
  *p = uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Geometry of one call, shared by every work item.
template <typename T>
struct Paged {
  const T* k_base;  // cache[0]: [num_blocks, block_size, kv_heads, head_dim]
  const T* v_base;  // cache[1]
  int64_t block_size, num_heads, kv_heads, head_dim;
  float scale;
  // Batch-invariant mode (see "Fixed order" below): every query vector's result is the same
  // bits whatever the item (rows, chunk, step) it arrives in.
  bool fixed_order = false;
  int64_t row() const { return kv_heads * head_dim; }  // elements per token in a block
};

// A tile: N query vectors sharing one kv head. q (scaled) and out are [N, head_dim] float32;
// scores [N, stride].
struct Tile {
  int64_t kv_head;
  const float* q;
  float* out;
  float* scores;
  const uint16_t* qh;  // TW_BF16_DOT, bfloat16 items: the same queries unscaled, as bf16 bits
  uint16_t* ph;        // TW_BF16_DOT values: the probabilities as bf16 (row stride even)
};

// Lane j of the result = the sum of v[j]'s lanes: TW_W dot products finished at once by a
// transpose-add tree (log2(TW_W) rounds of paired shuffles) instead of one horizontal sum each.
inline vf transpose_sum(const vf* v) {
  vf a[TW_W];
  for (int j = 0; j < TW_W; ++j) a[j] = v[j];
#if TW_W == 8
  for (int j = 0; j < 4; ++j)  // lanes: pair sums of a[2j] and a[2j+1], interleaved
    a[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a[2 * j], a[2 * j + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int j = 0; j < 2; ++j)
    a[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(a[2 * j], a[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(a[0], a[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(a[0], a[1], 4, 5, 6, 7, 12, 13, 14, 15);
#elif TW_W == 16
  // Round r adds lane pairs 2^r apart and interleaves two sources, halving the vectors: after
  // round 1 lanes alternate a[2j] / a[2j+1] pair sums, after round 4 lane j is a[j]'s sum.
  for (int j = 0; j < 8; ++j)
    a[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24,
                                   10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(a[2 * j], a[2 * j + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25,
                                   11, 27, 13, 29, 15, 31);
  for (int j = 0; j < 4; ++j)
    a[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                   24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(a[2 * j], a[2 * j + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11,
                                   26, 27, 14, 15, 30, 31);
  for (int j = 0; j < 2; ++j)
    a[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9,
                                   10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * j], a[2 * j + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                   14, 15, 28, 29, 30, 31);
  return __builtin_shufflevector(a[0], a[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                 22, 23) +
         __builtin_shufflevector(a[0], a[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                 29, 30, 31);
#else
  vf out;
  for (int j = 0; j < TW_W; ++j) out[j] = hsum(a[j]);
  return out;
#endif
}

// Blocks sit at unrelated addresses, where the hardware prefetchers (which follow streams
// within a page) do not look, so the next block is prefetched by hand, a few lines each time a
// key or value row is consumed: asked for all at once, its ~100 lines fill the core's miss
// buffers and stall it at the block's start, serialising the fetch with the compute.
struct Trickle {
  const char* next = nullptr;  // the next line to ask for
  const char* end = nullptr;   // one past the last
  int64_t per_step = 0;

  // Spread the lines of [p, p + bytes) over `steps` calls of step().
  void start(const void* p, int64_t bytes, int64_t steps) {
    next = static_cast<const char*>(p);
    end = next + (p ? bytes : 0);
    per_step = steps > 0 ? (bytes / 64 + steps) / steps : bytes / 64 + 1;
  }
  void step() {
    for (int64_t i = 0; i < per_step && next < end; ++i, next += 64) __builtin_prefetch(next);
  }
  void finish() {
    for (; next < end; next += 64) __builtin_prefetch(next);
  }
};

// scores[n, t0 + j] = q_n . k_j for the nt tokens of one block (k_blk at the tile's kv head):
// TW_W keys at a time, their partial sums parked in L1 and finished by transpose_sum.
template <int N, typename T>
void score_block(const T* k_blk, int64_t nt, int64_t row, int64_t d, const float* q,
                 float* scores, int64_t stride, Trickle& pf) {
  vf parked[N][TW_W];
  int64_t j = 0;
  for (; j + TW_W <= nt; j += TW_W) {
    for (int u = 0; u < TW_W; ++u) {
      pf.step();
      const T* k = k_blk + (j + u) * row;
      vf acc[N] = {};
      for (int64_t i = 0; i < d; i += TW_W) {
        const vf kv = load_vec(k + i);
        for (int n = 0; n < N; ++n) acc[n] += load_vec(q + n * d + i) * kv;
      }
      for (int n = 0; n < N; ++n) parked[n][u] = acc[n];
    }
    for (int n = 0; n < N; ++n)
      *reinterpret_cast<vf*>(scores + n * stride + j) = transpose_sum(parked[n]);
  }
  for (; j < nt; ++j) {
    pf.step();
    const T* k = k_blk + j * row;
    vf acc[N] = {};
    for (int64_t i = 0; i < d; i += TW_W) {
      const vf kv = load_vec(k + i);
      for (int n = 0; n < N; ++n) acc[n] += load_vec(q + n * d + i) * kv;
    }
    for (int n = 0; n < N; ++n) scores[n * stride + j] = hsum(acc[n]);
  }
}

// Fixed order (batch-invariant mode, Paged::fixed_order): a query vector's result must not
// depend on the item it is in (one decode row, or a run of prefill rows whose last row sets how
// many keys the item's last block holds). So in this mode (a) tiles never mix rows (plan_item):
// a vector always sits in a tile of its row's GQA group, the size a decode's tile has; (b) every
// group of up to TW_W keys of a block, the last partial one included, goes through ONE
// out-of-line function (score_group), zeros in the missing lanes, so a key's score is the same
// machine code whatever the block's length in this item (score_block finishes a partial group
// by hsum instead, a different order); (c) score rows start 64-byte aligned, their stride a
// multiple of 16 floats, so the softmax loop runs the same way on every row of a given length
// (plan_item); (d) no bf16 dot-product two-pass path (attend_item). Keys past a row's length
// get probability 0 and add exact zeros to its output.
// In TW_BF16_DOT builds, bfloat16 with head_dim % 64 == 0 (bi13): every row, decodes included,
// takes the one-pass attend_item_flash instead, whose result for a query vector depends only on
// its own query, its length and the spans (absolute key positions 0, kSpan, ...): every vector
// accumulates in registers of its own, keys past its length (spans or lanes a longer tile-mate
// needs) add exact zeros, a rescale its tile-mates ask for multiplies it by exactly 1, and with
// `own` its running max rises only by its own scores (flash_span).

// scores[n, j + u] = q_n . k_{j+u} for u < cnt (cnt <= TW_W) of one block: the fixed-order
// group (see above); noinline so every group of every item runs the same instructions.
template <int N, typename T>
__attribute__((noinline)) void score_group(const T* k_blk, int64_t j, int64_t cnt, int64_t row,
                                           int64_t d, const float* q, float* scores,
                                           int64_t stride, Trickle& pf) {
  vf parked[N][TW_W];
  for (int u = 0; u < TW_W; ++u) {
    vf acc[N] = {};
    if (u < cnt) {
      pf.step();
      const T* k = k_blk + (j + u) * row;
      for (int64_t i = 0; i < d; i += TW_W) {
        const vf kv = load_vec(k + i);
        for (int n = 0; n < N; ++n) acc[n] += load_vec(q + n * d + i) * kv;
      }
    }
    for (int n = 0; n < N; ++n) parked[n][u] = acc[n];
  }
  for (int n = 0; n < N; ++n) {
    const vf sums = transpose_sum(parked[n]);
    for (int64_t u = 0; u < cnt; ++u) scores[n * stride + j + u] = sums[u];
  }
}

template <int N, typename T>
void score_block_fixed(const T* k_blk, int64_t nt, int64_t row, int64_t d, const float* q,
                       float* scores, int64_t stride, Trickle& pf) {
  for (int64_t j = 0; j < nt; j += TW_W)
    score_group<N>(k_blk, j, std::min<int64_t>(TW_W, nt - j), row, d, q, scores, stride, pf);
}

// out[n, :] += sum_j p[n, j] * v_j over one block, CH vectors of head_dim at a time.
template <int N, int CH, typename T>
void value_block(const T* v_blk, int64_t nt, int64_t row, int64_t d, const float* p,
                 int64_t stride, float* out, Trickle& pf) {
  for (int64_t c = 0; c < d; c += CH * TW_W) {
    vf acc[N][CH];
    for (int n = 0; n < N; ++n)
      for (int u = 0; u < CH; ++u) acc[n][u] = load_vec(out + n * d + c + u * TW_W);
    for (int64_t j = 0; j < nt; ++j) {
      pf.step();
      vf v[CH];
      for (int u = 0; u < CH; ++u) v[u] = load_vec(v_blk + j * row + c + u * TW_W);
      for (int n = 0; n < N; ++n) {
        const float w = p[n * stride + j];
        for (int u = 0; u < CH; ++u) acc[n][u] += w * v[u];
      }
    }
    for (int n = 0; n < N; ++n)
      for (int u = 0; u < CH; ++u)
        *reinterpret_cast<vf*>(out + n * d + c + u * TW_W) = acc[n][u];
  }
}

// In place: s[0, len) -> softmax, s[len, max_len) -> 0.
inline void masked_softmax(float* s, int64_t len, int64_t max_len) {
  float m = s[0];
  for (int64_t t = 1; t < len; ++t) m = s[t] > m ? s[t] : m;
  float sum = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    s[t] = __builtin_expf(s[t] - m);
    sum += s[t];
  }
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  for (int64_t t = len; t < max_len; ++t) s[t] = 0.f;
}

// One tile's share of a pass over one block (nt tokens of it).
template <int N, typename T>
void tile_scores(const Paged<T>& g, const T* k_blk, int64_t nt, const Tile& tile, int64_t stride,
                 Trickle& pf) {
  if (g.fixed_order)
    score_block_fixed<N>(k_blk + tile.kv_head * g.head_dim, nt, g.row(), g.head_dim, tile.q,
                         tile.scores, stride, pf);
  else
    score_block<N>(k_blk + tile.kv_head * g.head_dim, nt, g.row(), g.head_dim, tile.q,
                   tile.scores, stride, pf);
}

template <int N, typename T>
void tile_values(const Paged<T>& g, const T* v_blk, int64_t nt, const Tile& tile, int64_t stride,
                 Trickle& pf) {
  const T* v = v_blk + tile.kv_head * g.head_dim;
  if (g.head_dim % (4 * TW_W) == 0 && N <= 3)
    value_block<N, 4>(v, nt, g.row(), g.head_dim, tile.scores, stride, tile.out, pf);
  else if (g.head_dim % (2 * TW_W) == 0)
    value_block<N, 2>(v, nt, g.row(), g.head_dim, tile.scores, stride, tile.out, pf);
  else
    value_block<N, 1>(v, nt, g.row(), g.head_dim, tile.scores, stride, tile.out, pf);
}

template <typename T, bool kScores>
void tile_pass(const Paged<T>& g, const T* blk, int64_t nt, const Tile& tile, int n,
               int64_t stride, Trickle& pf) {
  switch (n) {
#define TW_CASE(K)                                                  \
    case K:                                                         \
      if (kScores) tile_scores<K>(g, blk, nt, tile, stride, pf);    \
      else tile_values<K>(g, blk, nt, tile, stride, pf);            \
      break;
    TW_CASE(1) TW_CASE(2) TW_CASE(3) TW_CASE(4) TW_CASE(5) TW_CASE(6)
#undef TW_CASE
  }
}

#ifdef TW_BF16_DOT
// The two-pass AVX-512 BF16 path of prefill items (bfloat16, head_dim % 64 != 0; the one-pass
// path below takes head_dim % 64 == 0).
// The score pass: q.k as a small GEMM, 16 keys
// in the lanes of one vector and one vdpbf16ps per (query, pair of dims), so a key costs no
// widening and no horizontal sum. The keys are copied into that layout once per chunk of 16
// and kv head, and reused by every query vector of the kv head (the item's rows x group).
constexpr int kKeyLanes = 16;

// kp[p * 16 + n] = the bf16 pair (k_n[2p], k_n[2p + 1]) of key n < nt (k_n = k + n * row);
// lanes n >= nt are zero.
inline void pack_keys(const uint16_t* k, int64_t nt, int64_t row, int64_t d, uint32_t* kp,
                      Trickle& pf) {
  const int64_t pairs = d / 2;
  for (int64_t n = 0; n < kKeyLanes; ++n) {
    if (n >= nt) {
      for (int64_t p = 0; p < pairs; ++p) kp[p * kKeyLanes + n] = 0u;
      continue;
    }
    pf.step();
    const uint32_t* src = reinterpret_cast<const uint32_t*>(k + n * row);
    for (int64_t p = 0; p < pairs; ++p) kp[p * kKeyLanes + n] = src[p];
  }
}

// scores[m, 0..nt) = scale * q_m . k_n for the N queries of a tile (qh: [N, d] bf16) against
// one packed chunk of keys.
template <int N>
void score_chunk_dp(const uint32_t* kp, int64_t d, const uint16_t* qh, float scale,
                    float* scores, int64_t stride, int64_t nt) {
  const int64_t pairs = d / 2;
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(qh);
  __m512 acc[N];
  for (int m = 0; m < N; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh keys = (__m512bh)_mm512_loadu_si512(kp + p * kKeyLanes);
    for (int m = 0; m < N; ++m)
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(int(q32[m * pairs + p])),
                                keys);
  }
  const __mmask16 valid = nt >= kKeyLanes ? __mmask16(0xffff) : __mmask16((1u << nt) - 1u);
  const __m512 s = _mm512_set1_ps(scale);
  for (int m = 0; m < N; ++m)
    _mm512_mask_storeu_ps(scores + m * stride, valid, _mm512_mul_ps(acc[m], s));
}

inline void score_chunk_tile(const uint32_t* kp, int64_t d, const Tile& tile, int n, float scale,
                             int64_t stride, int64_t nt) {
  switch (n) {
#define TW_CASE(K) \
    case K: score_chunk_dp<K>(kp, d, tile.qh, scale, tile.scores, stride, nt); break;
    TW_CASE(1) TW_CASE(2) TW_CASE(3) TW_CASE(4) TW_CASE(5) TW_CASE(6)
#undef TW_CASE
  }
}

// The value pass the same way (head_dim % 64 == 0, even block size): the probabilities rounded
// to bf16 (as flash attention does for its P.V product) in pairs of keys, each pair broadcast
// against the two keys' values interleaved, 16 dims per vector.
// vp[jp * d + i] = the bf16 pair (v_{2jp}[i], v_{2jp+1}[i]) of keys < nt (v_n = v + n * row);
// a missing last odd key is zero.
inline void pack_values(const uint16_t* v, int64_t nt, int64_t row, int64_t d, uint32_t* vp,
                        Trickle& pf) {
  for (int64_t jp = 0; jp < (nt + 1) / 2; ++jp) {
    const uint16_t* a = v + 2 * jp * row;
    const uint16_t* b = a + row;
    uint32_t* o = vp + jp * d;
    pf.step();
    if (2 * jp + 1 < nt) {
      pf.step();
      for (int64_t i = 0; i < d; ++i) o[i] = uint32_t(a[i]) | (uint32_t(b[i]) << 16);
    } else {
      for (int64_t i = 0; i < d; ++i) o[i] = uint32_t(a[i]);
    }
  }
}

// out[m, :] += sum_n p[m, n] v_n for the N queries of a tile over `pairs` packed key pairs;
// p: the tile's bf16 probabilities from the chunk's first key (even), rows pstride apart.
template <int N>
void value_chunk_dp(const uint32_t* vp, int64_t pairs, int64_t d, const uint16_t* p,
                    int64_t pstride, float* out) {
  for (int64_t c = 0; c < d; c += 64) {
    __m512 acc[N][4];
    for (int m = 0; m < N; ++m)
      for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_loadu_ps(out + m * d + c + 16 * u);
    for (int64_t jp = 0; jp < pairs; ++jp) {
      __m512bh vals[4];
      for (int u = 0; u < 4; ++u)
        vals[u] = (__m512bh)_mm512_loadu_si512(vp + jp * d + c + 16 * u);
      for (int m = 0; m < N; ++m) {
        int32_t pair;
        std::memcpy(&pair, p + m * pstride + 2 * jp, sizeof pair);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
        for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_dpbf16_ps(acc[m][u], w, vals[u]);
      }
    }
    for (int m = 0; m < N; ++m)
      for (int u = 0; u < 4; ++u) _mm512_storeu_ps(out + m * d + c + 16 * u, acc[m][u]);
  }
}

inline void value_chunk_tile(const uint32_t* vp, int64_t pairs, int64_t d, const Tile& tile,
                             int n, int64_t pstride) {
  switch (n) {
#define TW_CASE(K) \
    case K: value_chunk_dp<K>(vp, pairs, d, tile.ph, pstride, tile.out); break;
    TW_CASE(1) TW_CASE(2) TW_CASE(3) TW_CASE(4) TW_CASE(5) TW_CASE(6)
#undef TW_CASE
  }
}

// ph[0, len) = the bf16 of p[0, len) (round to nearest even), ph[len, padded) = 0.
inline void probabilities_to_bf16(const float* p, int64_t len, int64_t padded, uint16_t* ph) {
  int64_t t = 0;
  for (; t + 16 <= len; t += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ph + t),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + t)));
  for (; t < len; ++t) store_elem(ph + t, p[t]);
  for (; t < padded; ++t) ph[t] = 0;
}
#endif  // TW_BF16_DOT

#ifdef TW_BF16_DOT
// ---- The AVX-512 BF16 prefill path (bfloat16, head_dim % 64 == 0, rows > 1): one pass. ----
// Each tile (up to kMaxTile query vectors of one kv head) walks the keys in spans of kSpan with
// an online softmax (flash attention): scores of the span by vdpbf16ps into registers, the
// running max and sum updated, the probabilities exp(s - max) rounded to bf16 and multiplied
// into the float32 output by vdpbf16ps; the output is divided by the sum at the end. The
// scores never leave L1 (the two-pass path above wrote, re-read and normalised a [vectors,
// keys] float32 array in L2). A span's keys and values of one kv head are packed once (keys
// transposed 16 to a vector, values in key pairs) and used by every tile of the kv head, which
// keeps its state (max, sum, output) in the scratch between spans.
constexpr int kSpan = 64;  // keys per online-softmax step: 4 vectors of 16 keys
constexpr float kSlack = 8.f;  // log2 units a score may exceed the running max by

// kp[(c * pairs + p) * 16 + i] = the bf16 pair (k[2p], k[2p + 1]) of key 16c + i of the span
// (zero for keys >= n); pairs = d / 2 (a multiple of 16). keys[i]: the span's key rows.
inline void pack_span_keys(const uint16_t* const* keys, int64_t n, int64_t d, uint32_t* kp) {
  const int64_t pairs = d / 2;
  for (int64_t c = 0; c * 16 < n; ++c) {
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      __m512i r[16], a[16];
      for (int i = 0; i < 16; ++i)
        r[i] = 16 * c + i < n ? _mm512_loadu_si512(keys[16 * c + i] + 2 * p0)
                              : _mm512_setzero_si512();
      // 16 x 16 transpose of 32-bit pairs: r[i] lane j = (key i, pair j) -> out[j] lane i.
      for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
      }
      for (int k = 0; k < 16; k += 4) {  // r[k + j]: pair 4L + j of keys k..k+3, 128-bit lane L
        r[k] = _mm512_unpacklo_epi64(a[k], a[k + 2]);
        r[k + 1] = _mm512_unpackhi_epi64(a[k], a[k + 2]);
        r[k + 2] = _mm512_unpacklo_epi64(a[k + 1], a[k + 3]);
        r[k + 3] = _mm512_unpackhi_epi64(a[k + 1], a[k + 3]);
      }
      uint32_t* o = kp + (c * pairs + p0) * 16;
      for (int j = 0; j < 4; ++j) {
        const __m512i x0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44);
        const __m512i x1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xee);
        const __m512i y0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
        const __m512i y1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xee);
        _mm512_storeu_si512(o + (0 + j) * 16, _mm512_shuffle_i32x4(x0, y0, 0x88));
        _mm512_storeu_si512(o + (4 + j) * 16, _mm512_shuffle_i32x4(x0, y0, 0xdd));
        _mm512_storeu_si512(o + (8 + j) * 16, _mm512_shuffle_i32x4(x1, y1, 0x88));
        _mm512_storeu_si512(o + (12 + j) * 16, _mm512_shuffle_i32x4(x1, y1, 0xdd));
      }
    }
  }
}

// vp[jp * d + i] = the bf16 pair (v_{2jp}[i], v_{2jp+1}[i]) for the span's n values (a missing
// last odd value: zero); d % 32 == 0.
inline void pack_span_values(const uint16_t* const* vals, int64_t n, int64_t d, uint32_t* vp) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37,
                                                  6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43,
                                                  12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t jp = 0; 2 * jp < n; ++jp) {
    const uint16_t* a = vals[2 * jp];
    const uint16_t* b = 2 * jp + 1 < n ? vals[2 * jp + 1] : nullptr;
    uint32_t* o = vp + jp * d;
    for (int64_t i = 0; i < d; i += 32) {
      const __m512i va = _mm512_loadu_si512(a + i);
      const __m512i vb = b ? _mm512_loadu_si512(b + i) : _mm512_setzero_si512();
      _mm512_storeu_si512(o + i, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(o + i + 16, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// 2^x for finite x <= 8 (below 2^-149 it flushes to 0 in vscalefps): 2^round(x) * a degree-6
// Taylor polynomial of 2^f, |f| <= 1/2; relative error < 2e-7 (the remainder (ln2 / 2)^7 / 7!
// = 1.2e-7 over 2^f >= 0.7, plus float rounding of the Horner steps).
inline __m512 exp2_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);  // ln2^6 / 720
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));  // ln2^5 / 120
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));  // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The state of one tile between spans: per query vector the running max (log2 units) and sum.
struct FlashTile {
  int64_t first;  // its first query vector (index into the item's vectors)
  int n;          // query vectors
  int64_t len;    // keys its last (longest) vector attends
};

// One span (keys t0 + [0, nt), packed in kp / vp) for the N query vectors of a tile:
// q32 [N][d/2] bf16 pairs; lens: keys each attends; m [N]: running max (log2 units); l
// [N][16]: running sums, lane-wise; out [N][d] float32 accumulators (scaled by 2^-m); pb: room
// for [N][kSpan] bf16.
template <int N, int NC>
void flash_span(const uint32_t* kp, const uint32_t* vp, int64_t nt, int64_t t0, int64_t d,
                const uint32_t* q32, const int64_t* lens, float scale_log2, float* m, float* l,
                float* out, uint16_t* pb, bool own) {
  const int64_t pairs = d / 2;
  __m512 acc[N][NC];
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh keys[NC];
    for (int c = 0; c < NC; ++c)
      keys[c] = (__m512bh)_mm512_loadu_si512(kp + (c * pairs + p) * 16);
    for (int i = 0; i < N; ++i) {
      const __m512bh q = (__m512bh)_mm512_set1_epi32(int(q32[i * pairs + p]));
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], q, keys[c]);
    }
  }
  // The online softmax, with lazy rescaling: a vector's max m (log2 units) is raised only when
  // a score exceeds it by more than kSlack, so most spans skip the horizontal max and the
  // rescaling of the output; the probabilities 2^(s - m) are then <= 2^kSlack, which float32
  // and bf16 hold with the same relative precision.
  const float inv_sc = 1.f / scale_log2;
  const __m512 sc = _mm512_set1_ps(scale_log2);
  const bool full = nt == 16 * NC && lens[0] >= t0 + nt;  // every lane a key of every vector
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 valid[N][NC];
  __mmask16 above = 0;  // raw scores above (m + kSlack) / scale: m must rise (m = -inf at first)
  bool vec_above[N];    // the same, vector by vector (`own`: only those vectors may raise m)
  for (int i = 0; i < N; ++i) {
    vec_above[i] = false;
    const __m512 thr = _mm512_set1_ps((m[i] + kSlack) * inv_sc);
    for (int c = 0; c < NC; ++c) {
      if (full) {
        valid[i][c] = 0xffff;
      } else {
        const int64_t limit = std::min<int64_t>(lens[i], t0 + nt) - t0 - 16 * c;
        valid[i][c] = _mm512_cmplt_epi32_mask(
            lane, _mm512_set1_epi32(int(std::max<int64_t>(limit, 0))));
      }
      const __mmask16 up = _mm512_mask_cmp_ps_mask(valid[i][c], acc[i][c], thr, _CMP_GT_OQ);
      above |= up;
      vec_above[i] = vec_above[i] || up != 0;
    }
  }
  float alpha[N];
  for (int i = 0; i < N; ++i) alpha[i] = 1.f;
  if (above) {  // rare after the first span: the max of each vector, the rescaling factors
    for (int i = 0; i < N; ++i) {
      if (own && !vec_above[i]) continue;  // fixed order: m moves by the vector's own scores
      __m512 mx = _mm512_set1_ps(-__builtin_inff());
      for (int c = 0; c < NC; ++c) mx = _mm512_mask_max_ps(mx, valid[i][c], mx, acc[i][c]);
      const float m_new = std::max(m[i], _mm512_reduce_max_ps(mx) * scale_log2);
      if (m_new > m[i] + kSlack || m[i] == -__builtin_inff()) {
        alpha[i] = m[i] == -__builtin_inff() ? 0.f : __builtin_exp2f(m[i] - m_new);
        m[i] = m_new;
      }
    }
  }
  const bool rescale = above != 0;
  for (int i = 0; i < N; ++i) {  // p = 2^(s * scale - m), <= 2^kSlack
    const __m512 mv = _mm512_set1_ps(m[i]);
    for (int c = 0; c < NC; ++c) {
      const __m512 e = exp2_ps(_mm512_fmsub_ps(acc[i][c], sc, mv));
      acc[i][c] = full ? e : _mm512_maskz_mov_ps(valid[i][c], e);
    }
  }
  for (int i = 0; i < N; ++i) {
    __m512 sum = acc[i][0];
    for (int c = 1; c < NC; ++c) sum = _mm512_add_ps(sum, acc[i][c]);
    float* li = l + 16 * i;  // lane-wise running sums
    if (t0 == 0)  // the first span: l and out start here
      _mm512_storeu_ps(li, sum);
    else if (rescale)
      _mm512_storeu_ps(li, _mm512_fmadd_ps(_mm512_loadu_ps(li), _mm512_set1_ps(alpha[i]), sum));
    else
      _mm512_storeu_ps(li, _mm512_add_ps(_mm512_loadu_ps(li), sum));
    uint16_t* row = pb + i * kSpan;
    for (int c = 0; c + 1 < NC; c += 2)
      _mm512_storeu_si512(row + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(acc[i][c + 1], acc[i][c]));
    if (NC % 2)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16 * (NC - 1)),
                          (__m256i)_mm512_cvtneps_pbh(acc[i][NC - 1]));
  }
  // out[i] = alpha[i] * out[i] + sum_j p[i, j] v_j, 64 dims at a time, pairs of keys.
  const int64_t vpairs = (nt + 1) / 2;
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    __m512 o[N][4];
    if (t0 == 0) {  // the first span
      for (int i = 0; i < N; ++i)
        for (int u = 0; u < 4; ++u) o[i][u] = _mm512_setzero_ps();
    } else if (rescale) {
      for (int i = 0; i < N; ++i)
        for (int u = 0; u < 4; ++u)
          o[i][u] = _mm512_mul_ps(_mm512_loadu_ps(out + i * d + c0 + 16 * u),
                                  _mm512_set1_ps(alpha[i]));
    } else {
      for (int i = 0; i < N; ++i)
        for (int u = 0; u < 4; ++u) o[i][u] = _mm512_loadu_ps(out + i * d + c0 + 16 * u);
    }
    for (int64_t jp = 0; jp < vpairs; ++jp) {
      __m512bh v[4];
      for (int u = 0; u < 4; ++u) v[u] = (__m512bh)_mm512_loadu_si512(vp + jp * d + c0 + 16 * u);
      for (int i = 0; i < N; ++i) {
        int32_t pair;
        std::memcpy(&pair, pb + i * kSpan + 2 * jp, sizeof pair);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
        for (int u = 0; u < 4; ++u) o[i][u] = _mm512_dpbf16_ps(o[i][u], w, v[u]);
      }
    }
    for (int i = 0; i < N; ++i)
      for (int u = 0; u < 4; ++u) _mm512_storeu_ps(out + i * d + c0 + 16 * u, o[i][u]);
  }
}

template <int N>
void flash_span_n(int nc, const uint32_t* kp, const uint32_t* vp, int64_t nt, int64_t t0,
                  int64_t d, const uint32_t* q32, const int64_t* lens, float scale_log2,
                  float* m, float* l, float* out, uint16_t* pb, bool own) {
  switch (nc) {
#define TW_SPAN(C) flash_span<N, C>(kp, vp, nt, t0, d, q32, lens, scale_log2, m, l, out, pb, own)
    case 1: TW_SPAN(1); break;
    case 2: TW_SPAN(2); break;
    case 3: TW_SPAN(3); break;
    default: TW_SPAN(4); break;
#undef TW_SPAN
  }
}

// Scratch of the one-pass path (one per thread).
struct FlashScratch {
  std::vector<uint16_t> qh;  // [vectors][d] the item's queries, kv head by kv head
  std::vector<float> out, m, l;
  std::vector<int64_t> lens, dest;
  std::vector<FlashTile> tiles;
  // The request's keys and values as packed so far, kv head by kv head: [kv_heads][span]
  // [kSpan * d / 2] each; spans [0, packed_len) are whole, reused by its next items (a
  // thread's items of one request come in order, each attending a longer context).
  std::vector<uint32_t> kp, vp;
  const int64_t* packed_table = nullptr;  // the request packed (its block table)
  int64_t packed_len = 0, packed_cap = 0;  // keys packed; spans of room per kv head
  std::vector<const uint16_t*> krows, vrows;
  std::vector<uint16_t> pb;  // [kMaxTile][kSpan] probabilities of one tile and span
};

// The one-pass path for one work item (see attend_item).
inline void attend_item_flash(const Paged<uint16_t>& g, const int64_t* table,
                              const uint16_t* q_req, uint16_t* out_req, int64_t ctx, int64_t r0,
                              int64_t r1, FlashScratch& s) {
  const int64_t d = g.head_dim, group = g.num_heads / g.kv_heads, row = g.row();
  const int64_t bs = g.block_size, max_len = ctx + r1;
  const int64_t nv = (r1 - r0) * g.num_heads, per_head = (r1 - r0) * group;
  s.qh.resize(nv * d);
  s.out.resize(nv * d);  // out and l: written by each tile's first span
  s.m.assign(nv, -__builtin_inff());
  s.l.resize(nv * 16);
  s.lens.resize(nv);
  s.dest.resize(nv);
  const int64_t span_elems = kSpan * d / 2, spans = (max_len + kSpan - 1) / kSpan;
  if (s.packed_table != table) {
    s.packed_table = table;
    s.packed_len = 0;
  }
  if (spans > s.packed_cap) {  // more room: keep what is packed
    const int64_t cap = std::max(spans, 2 * s.packed_cap);
    std::vector<uint32_t> kp(g.kv_heads * cap * span_elems), vp(kp.size());
    for (int64_t kh = 0; kh < g.kv_heads && s.packed_len > 0; ++kh) {
      const int64_t n = (s.packed_len / kSpan) * span_elems;
      std::memcpy(kp.data() + kh * cap * span_elems, s.kp.data() + kh * s.packed_cap * span_elems,
                  n * 4);
      std::memcpy(vp.data() + kh * cap * span_elems, s.vp.data() + kh * s.packed_cap * span_elems,
                  n * 4);
    }
    s.kp.swap(kp);
    s.vp.swap(vp);
    s.packed_cap = cap;
  }
  s.krows.resize(kSpan);
  s.vrows.resize(kSpan);
  s.pb.resize(kMaxTile * kSpan);
  int64_t v = 0;
  for (int64_t kh = 0; kh < g.kv_heads; ++kh)
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t mm = 0; mm < group; ++mm, ++v) {
        s.lens[v] = ctx + r + 1;
        s.dest[v] = (r * g.num_heads + kh * group + mm) * d;
        for (int64_t k = 0; k < d; k += 32)
          _mm512_storeu_si512(s.qh.data() + v * d + k, _mm512_loadu_si512(q_req + s.dest[v] + k));
      }
  s.tiles.clear();
  for (int64_t t = 0; t < per_head; t += kMaxTile) {
    const int n = int(std::min<int64_t>(kMaxTile, per_head - t));
    s.tiles.push_back({t, n, s.lens[t + n - 1]});
  }
  const float scale_log2 = g.scale * 1.4426950408889634f;
  for (int64_t kh = 0; kh < g.kv_heads; ++kh) {
    const int64_t base_v = kh * per_head;
    for (int64_t t0 = 0; t0 < max_len; t0 += kSpan) {
      const int64_t nt = std::min<int64_t>(kSpan, max_len - t0);
      const int64_t at = (kh * s.packed_cap + t0 / kSpan) * span_elems;
      if (t0 + kSpan > s.packed_len) {  // not packed whole yet
        for (int64_t j = 0; j < nt;) {  // the span's rows, block by block
          const int64_t b = (t0 + j) / bs, o = t0 + j - b * bs;
          const int64_t run = std::min(bs - o, nt - j);
          const int64_t off = (table[b] * bs + o) * row + kh * d;
          for (int64_t u = 0; u < run; ++u, ++j) {
            s.krows[j] = g.k_base + off + u * row;
            s.vrows[j] = g.v_base + off + u * row;
          }
        }
        pack_span_keys(s.krows.data(), nt, d, s.kp.data() + at);
        pack_span_values(s.vrows.data(), nt, d, s.vp.data() + at);
      }
      for (const FlashTile& tile : s.tiles) {
        if (tile.len <= t0) continue;
        const int64_t tn = std::min<int64_t>(nt, tile.len - t0);
        const int nc = int((tn + 15) / 16);
        const int64_t f = base_v + tile.first;
        const uint32_t* q32 = reinterpret_cast<const uint32_t*>(s.qh.data() + f * d);
        switch (tile.n) {
#define TW_CASE(K)                                                                        \
          case K:                                                                         \
            flash_span_n<K>(nc, s.kp.data() + at, s.vp.data() + at, tn, t0, d, q32,       \
                            s.lens.data() + f, scale_log2, s.m.data() + f,                \
                            s.l.data() + 16 * f, s.out.data() + f * d, s.pb.data(),       \
                            g.fixed_order);                                               \
            break;
          TW_CASE(1) TW_CASE(2) TW_CASE(3) TW_CASE(4) TW_CASE(5) TW_CASE(6)
#undef TW_CASE
        }
      }
    }
  }
  s.packed_len = (max_len / kSpan) * kSpan;  // whole spans (a last partial one: packed again)
  for (int64_t i = 0; i < nv; ++i) {
    const float inv = 1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(s.l.data() + 16 * i));
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t k = 0; k < d; k += 16)  // round to nearest even, as store_elem
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_req + s.dest[i] + k),
                          (__m256i)_mm512_cvtneps_pbh(
                              _mm512_mul_ps(_mm512_loadu_ps(s.out.data() + i * d + k), iv)));
  }
}
#endif  // TW_BF16_DOT

// Which passes of a work item go by vdpbf16ps (block_dp).
struct DotPasses {
  bool scores = false, values = false;
};

// Scratch of one thread: the item's scaled queries, scores and float32 outputs.
struct Scratch {
  std::vector<float> q, scores, out;
  float* scores0 = nullptr;  // row 0 of the scores in `scores` (64-byte aligned: fixed order)
  std::vector<uint16_t> qh;  // TW_BF16_DOT: the bf16 queries as they came (Tile::qh)
  std::vector<uint16_t> ph;  // TW_BF16_DOT: the probabilities as bf16 (Tile::ph)
  std::vector<uint32_t> packed;  // TW_BF16_DOT: one chunk of keys or values (block_dp)
  std::vector<Tile> tiles;
  std::vector<int> sizes;
  std::vector<int64_t> lens, dest;  // per vector: keys attended, element offset in out
#ifdef TW_BF16_DOT
  FlashScratch flash;  // the one-pass path's
#endif
};

// Lays out the item's vectors kv head by kv head, (row, member) pairs in order, cut into tiles
// of <= kMaxTile; fills s.lens / s.dest and the scaled float32 queries.
// For dot passes (T = uint16_t only) it also keeps the bf16 queries (s.qh) and room for the
// bf16 probabilities (s.ph, rows `pstride` apart).
template <typename T>
void plan_item(const Paged<T>& g, const T* q_req, int64_t ctx, int64_t r0, int64_t r1,
               int64_t stride, int64_t pstride, DotPasses dot, Scratch& s) {
  const int64_t d = g.head_dim, group = g.num_heads / g.kv_heads;
  const int64_t nv = (r1 - r0) * g.num_heads;
  s.q.resize(nv * d);
  if (dot.scores) s.qh.resize(nv * d);
  if (dot.values) s.ph.resize(nv * pstride);
  s.out.assign(nv * d, 0.f);
  // fixed order: rows 64-byte aligned (the caller makes stride a multiple of 16 floats)
  const int64_t pad = g.fixed_order ? 16 : 0;
  s.scores.resize(nv * stride + pad);
  s.scores0 = s.scores.data();
  if (pad) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(s.scores0);
    s.scores0 += ((64 - addr % 64) % 64) / sizeof(float);
  }
  s.lens.resize(nv);
  s.dest.resize(nv);
  s.tiles.clear();
  s.sizes.clear();
  int64_t v = 0;
  for (int64_t kh = 0; kh < g.kv_heads; ++kh) {
    const int64_t first = v;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t m = 0; m < group; ++m, ++v) {
        s.lens[v] = ctx + r + 1;
        s.dest[v] = (r * g.num_heads + kh * group + m) * d;
        for (int64_t i = 0; i < d; ++i) s.q[v * d + i] = to_float(q_req[s.dest[v] + i]) * g.scale;
        if (dot.scores) std::memcpy(s.qh.data() + v * d, q_req + s.dest[v], d * sizeof(T));
      }
    // tiles of <= kMaxTile vectors; fixed order: never across a row (see "Fixed order")
    const int64_t run = g.fixed_order ? group : v - first;
    for (int64_t r = first; r < v; r += run)
      for (int64_t t = r; t < std::min(v, r + run); t += kMaxTile) {
        s.tiles.push_back({kh, s.q.data() + t * d, s.out.data() + t * d, s.scores0 + t * stride,
                           dot.scores ? s.qh.data() + t * d : nullptr,
                           dot.values ? s.ph.data() + t * pstride : nullptr});
        s.sizes.push_back(int(std::min<int64_t>(kMaxTile, std::min(v, r + run) - t)));
      }
  }
}

#ifdef TW_BF16_DOT
// One pass's work on one block by packed chunks of 16 keys (kScores: pack_keys, then every
// tile's scores; else pack_values, then every tile's values; t0 is even then). A chunk is
// packed once per kv head (the tiles come kv head by kv head) and used by every tile of it.
template <bool kScores>
void block_dp(const Paged<uint16_t>& g, const uint16_t* blk, int64_t t0, int64_t nt,
              int64_t stride, int64_t pstride, Trickle& pf, Scratch& s) {
  const int64_t d = g.head_dim, row = g.row();
  s.packed.resize(d / 2 * kKeyLanes);  // keys: d/2 pairs x 16 lanes; values: 8 pairs x d
  for (int64_t j0 = 0; j0 < nt; j0 += kKeyLanes) {
    const int64_t chunk = std::min<int64_t>(kKeyLanes, nt - j0);
    int64_t packed_head = -1;
    for (size_t i = 0; i < s.tiles.size(); ++i) {
      Tile tile = s.tiles[i];
      if (tile.kv_head != packed_head) {
        const uint16_t* src = blk + j0 * row + tile.kv_head * d;
        if (kScores) pack_keys(src, chunk, row, d, s.packed.data(), pf);
        else pack_values(src, chunk, row, d, s.packed.data(), pf);
        packed_head = tile.kv_head;
      }
      if (kScores) {
        tile.scores += t0 + j0;
        score_chunk_tile(s.packed.data(), d, tile, s.sizes[i], g.scale, stride, chunk);
      } else {
        tile.ph += t0 + j0;
        value_chunk_tile(s.packed.data(), (chunk + 1) / 2, d, tile, s.sizes[i], pstride);
      }
    }
  }
}
#endif

// One pass (kScores: q.k over the K blocks; else p.v over the V blocks) of every tile over the
// item's blocks in order; while block b is worked on, the next one (`after`: the block that
// follows the pass, or null) trickles in. `dot`: this pass by block_dp.
template <typename T, bool kScores>
void pass_over_blocks(const Paged<T>& g, const int64_t* table, int64_t max_len, int64_t stride,
                      int64_t pstride, const T* base, const T* after, bool dot, Scratch& s) {
  const int64_t bs = g.block_size, row = g.row(), elem = int64_t(sizeof(T));
  const size_t n_tiles = s.tiles.size();
  const int64_t steps_per_key = dot ? g.kv_heads : int64_t(n_tiles);
  Trickle pf;
  for (int64_t t0 = 0; t0 < max_len; t0 += bs) {
    const int64_t nt = std::min(bs, max_len - t0), t1 = t0 + bs;
    const T* next = t1 < max_len ? base + table[t1 / bs] * bs * row : after;
    const int64_t next_rows = t1 < max_len ? std::min(bs, max_len - t1) : std::min(bs, max_len);
    pf.start(next, next_rows * row * elem, nt * steps_per_key);
    const T* blk = base + table[t0 / bs] * bs * row;
#ifdef TW_BF16_DOT
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (dot) {
        block_dp<kScores>(g, blk, t0, nt, stride, pstride, pf, s);
        pf.finish();
        continue;
      }
    }
#endif
    for (size_t i = 0; i < n_tiles; ++i) {
      Tile tile = s.tiles[i];
      tile.scores += t0;
      tile_pass<T, kScores>(g, blk, nt, tile, s.sizes[i], stride, pf);
    }
    pf.finish();
  }
}

// Which passes of an item go by vdpbf16ps: in TW_BF16_DOT builds, bfloat16 prefill rows (a
// decode's few query vectors per kv head do not pay for packing); the scores always then, the
// values where head_dim % 64 == 0 and a block holds whole key pairs. (attend_item sends
// bfloat16 prefill rows with head_dim % 64 == 0 to the one-pass attend_item_flash first.)
template <typename T>
DotPasses bf16_dot_passes(const Paged<T>& g, int64_t rows) {
  DotPasses dot;
#ifdef TW_BF16_DOT
  dot.scores = std::is_same_v<T, uint16_t> && rows > 1 && !g.fixed_order;
  dot.values = dot.scores && g.head_dim % 64 == 0 && g.block_size % 2 == 0;
#else
  (void)g;
  (void)rows;
#endif
  return dot;
}

// One work item: query rows [r0, r1) of one request (q_req / out_req point at its row 0),
// `ctx` tokens cached before its row 0, every head.
template <typename T>
void attend_item(const Paged<T>& g, const int64_t* table, const T* q_req, T* out_req,
                 int64_t ctx, int64_t r0, int64_t r1, Scratch& s) {
#ifdef TW_BF16_DOT
  if constexpr (std::is_same_v<T, uint16_t>) {
    if ((r1 - r0 > 1 || g.fixed_order) && g.head_dim % 64 == 0) {  // fixed order: decodes too
      attend_item_flash(g, table, q_req, out_req, ctx, r0, r1, s.flash);
      return;
    }
  }
#endif
  const int64_t max_len = ctx + r1, bs = g.block_size, row = g.row();
  // score rows: max_len apart; fixed order: a multiple of 16 floats (see "Fixed order")
  const int64_t stride = g.fixed_order ? (max_len + 15) / 16 * 16 : max_len;
  const int64_t pstride = max_len + (max_len & 1);  // bf16 probability rows: whole pairs
  const DotPasses dot = bf16_dot_passes(g, r1 - r0);
  plan_item(g, q_req, ctx, r0, r1, stride, pstride, dot, s);
  pass_over_blocks<T, true>(g, table, max_len, stride, pstride, g.k_base,
                            g.v_base + table[0] * bs * row, dot.scores, s);
  for (size_t v = 0; v < s.lens.size(); ++v)
    masked_softmax(s.scores0 + v * stride, s.lens[v], max_len);
#ifdef TW_BF16_DOT
  if (dot.values)
    for (size_t v = 0; v < s.lens.size(); ++v)
      probabilities_to_bf16(s.scores0 + v * stride, max_len, pstride, s.ph.data() + v * pstride);
#endif
  pass_over_blocks<T, false>(g, table, max_len, stride, pstride, g.v_base, nullptr, dot.values,
                             s);
  const int64_t d = g.head_dim;
  for (size_t v = 0; v < s.dest.size(); ++v)
    for (int64_t i = 0; i < d; ++i) store_elem(out_req + s.dest[v] + i, s.out[v * d + i]);
}
