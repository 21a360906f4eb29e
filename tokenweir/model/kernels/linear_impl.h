// Packed-weight linear for few rows (decode batches, M <= ~64): out[M, N] = x[M, K] @ w[N, K]^T
// on a weight packed ONCE into panels of NR = 2 * TW_W output columns: panel p holds
// w[p*NR + j, k] at packed[(p * K + k) * NR + j] (rows past N are zeros). Torch-free: included by
// cpu_kernels.cpp once per instruction set, inside a namespace and a `#pragma GCC target` region,
// with TW_W = floats per vector (8: AVX2, 16: AVX-512). No include guard on purpose.
//
// Broadcast form, no horizontal sums: a microkernel keeps MR x 2 vector accumulators (MR rows of
// x times one panel's NR columns), and for every k loads the panel's NR weights once and
// broadcasts x[m, k] to each row. A thread walks a contiguous run of panels, so at M = 1 each
// core streams one sequential run of memory (software-prefetched ahead from 2 rows); at larger
// M the panel (K * NR * 4 bytes: 36 KB at K = 576 on AVX2) stays in L1/L2 while every block of
// MR rows passes over it.

typedef float lvf __attribute__((vector_size(TW_W * 4), aligned(4)));

constexpr int kPanel = 2 * TW_W;   // NR: output columns per panel
constexpr int kMaxRows = 6;        // MR: 12 accumulators + 2 weight vectors + 1 broadcast
#ifndef TW_LINEAR_PREFETCH_STEPS  // k-steps the weight stream is prefetched ahead (benchmarks)
#define TW_LINEAR_PREFETCH_STEPS 16
#endif
constexpr int64_t kPrefetchFloats = TW_LINEAR_PREFETCH_STEPS * kPanel;  // 1 KB AVX2 at 16

inline lvf lload(const float* p) { return *reinterpret_cast<const lvf*>(p); }
inline void lstore(float* p, lvf v) { *reinterpret_cast<lvf*>(p) = v; }

// Rows [0, MR) of x (row stride ldx) times one panel, k in [0, K); KU independent accumulator
// sets over k (k % KU) hide the FMA latency when MR is small. The result goes to out (row stride
// ldo), its first `cols` columns only (cols < kPanel on the last panel of a ragged N); with
// `accumulate` it is added to what out holds (a later block of k).
template <int MR, int KU>
void panel_rows(const float* x, int64_t ldx, const float* panel, int64_t K, float* out,
                int64_t ldo, int cols, bool accumulate) {
  lvf acc[KU][MR][2] = {};
  const int64_t k_main = K - K % KU;
  for (int64_t k = 0; k < k_main; k += KU) {
    if (MR > 1)  // measured: at one row the hardware prefetcher alone streams faster
      for (int l = 0; l < KU * kPanel; l += 16)
        __builtin_prefetch(panel + k * kPanel + kPrefetchFloats + l);
    for (int u = 0; u < KU; ++u) {
      const float* wp = panel + (k + u) * kPanel;
      const lvf w0 = lload(wp), w1 = lload(wp + TW_W);
      for (int m = 0; m < MR; ++m) {
        const lvf b = lvf{} + x[m * ldx + k + u];
        acc[u][m][0] += w0 * b;
        acc[u][m][1] += w1 * b;
      }
    }
  }
  for (int64_t k = k_main; k < K; ++k) {
    const lvf w0 = lload(panel + k * kPanel), w1 = lload(panel + k * kPanel + TW_W);
    for (int m = 0; m < MR; ++m) {
      const lvf b = lvf{} + x[m * ldx + k];
      acc[0][m][0] += w0 * b;
      acc[0][m][1] += w1 * b;
    }
  }
  for (int u = 1; u < KU; ++u)
    for (int m = 0; m < MR; ++m) {
      acc[0][m][0] += acc[u][m][0];
      acc[0][m][1] += acc[u][m][1];
    }
  for (int m = 0; m < MR; ++m) {
    float* row = out + m * ldo;
    if (cols == kPanel) {
      if (accumulate) {
        acc[0][m][0] += lload(row);
        acc[0][m][1] += lload(row + TW_W);
      }
      lstore(row, acc[0][m][0]);
      lstore(row + TW_W, acc[0][m][1]);
    } else {
      float tmp[kPanel];
      lstore(tmp, acc[0][m][0]);
      lstore(tmp + TW_W, acc[0][m][1]);
      for (int j = 0; j < cols; ++j) row[j] = accumulate ? row[j] + tmp[j] : tmp[j];
    }
  }
}

// `rows` (1..kMaxRows) rows of x against one panel: the microkernel instantiated for that count.
// `fixed_order` (batch-invariant mode): one accumulator set over k for every count, so a row's
// sums run in the same order whichever block of rows it falls in (KU > 1 splits k by k % KU).
inline void panel_block(int rows, const float* x, int64_t ldx, const float* panel, int64_t K,
                        float* out, int64_t ldo, int cols, bool acc, bool fixed_order) {
  if (fixed_order) {
    switch (rows) {
      case 1: panel_rows<1, 1>(x, ldx, panel, K, out, ldo, cols, acc); break;
      case 2: panel_rows<2, 1>(x, ldx, panel, K, out, ldo, cols, acc); break;
      case 3: panel_rows<3, 1>(x, ldx, panel, K, out, ldo, cols, acc); break;
      case 4: panel_rows<4, 1>(x, ldx, panel, K, out, ldo, cols, acc); break;
      case 5: panel_rows<5, 1>(x, ldx, panel, K, out, ldo, cols, acc); break;
      default: panel_rows<6, 1>(x, ldx, panel, K, out, ldo, cols, acc); break;
    }
    return;
  }
  switch (rows) {
    case 1: panel_rows<1, 4>(x, ldx, panel, K, out, ldo, cols, acc); break;
    case 2: panel_rows<2, 2>(x, ldx, panel, K, out, ldo, cols, acc); break;
    case 3: panel_rows<3, 2>(x, ldx, panel, K, out, ldo, cols, acc); break;
    case 4: panel_rows<4, 1>(x, ldx, panel, K, out, ldo, cols, acc); break;
    case 5: panel_rows<5, 1>(x, ldx, panel, K, out, ldo, cols, acc); break;
    default: panel_rows<6, 1>(x, ldx, panel, K, out, ldo, cols, acc); break;
  }
}

// k-steps per block: a block of one panel is 16 KB (KC * NR * 4 bytes), so it stays in L1
// while every block of rows passes over it (a whole panel, 36 KB at K = 576, would not).
constexpr int64_t kKBlock = 2048 / TW_W;

// Rows of x per chunk: a thread runs all its panels over one chunk of rows before the next, so
// the chunk (96 x K floats: 216 KB at K = 576) stays in L2 while the panels pass; unchunked, a
// prefill step's x (4.5 MB at 2048 x 576) was read again from L3 or memory for every panel.
// Measured (AVX-512 Xeon, 2 threads, exclusive, fixed_order, SmolLM2's shapes, min of 5):
// 2048 rows 61.3 -> 40.2 ms at N = 3072, K = 576, 31.7 -> 22.1 ms at N = 576, K = 1536;
// 1024 rows 26.9 -> 20.2 ms; 64 rows unchanged. A multiple of kMaxRows, so the row blocks, and
// with them every row's order of sums, are those of the unchunked loop (bits unchanged).
constexpr int64_t kRowChunk = 96;
static_assert(kRowChunk % kMaxRows == 0, "chunks must keep the row blocks' boundaries");

// Panels [p0, p1) against every row of x, chunk by chunk of kRowChunk rows: each block of k of
// a panel meets the chunk's rows (blocks of kMaxRows, the remainder in one smaller block) while
// it is L1-hot. At one block of rows the k blocks run in order, so the weight is still read as
// one sequential stream. `fixed_order` (batch-invariant mode): k is always cut at kKBlock and
// every row block uses one accumulator set, so out[m] is the same bits for any M and any
// position of row m in x (the split of panels across threads never splits k). Without it,
// M <= kMaxRows runs k unsplit.
inline void packed_panels(const float* x, const float* packed, float* out, int64_t M, int64_t K,
                          int64_t N, int64_t p0, int64_t p1, bool fixed_order) {
  const int64_t kc = (M > kMaxRows || fixed_order) ? kKBlock : K;
  for (int64_t mc = 0; mc < M; mc += kRowChunk) {
    const int64_t mend = std::min(M, mc + kRowChunk);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel;
      const int cols = int(std::min<int64_t>(kPanel, N - n0));
      for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const float* block = packed + (p * K + k0) * kPanel;
        const int64_t klen = std::min(kc, K - k0);
        for (int64_t m0 = mc; m0 < mend; m0 += kMaxRows) {
          const int rows = int(std::min<int64_t>(kMaxRows, mend - m0));
          panel_block(rows, x + m0 * K + k0, K, block, klen, out + m0 * N + n0, N, cols,
                      k0 > 0, fixed_order);
        }
      }
    }
  }
}
