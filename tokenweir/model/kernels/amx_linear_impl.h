// amx_linear: out[M, N] = x[M, K] @ w[N, K]^T in bfloat16 on AMX tiles (Sapphire Rapids and
// later), for batch-invariant mode (tokenweir/model/layers.py, tiled_onednn_op).
//
// Contract: x [M, K] bfloat16 contiguous; w packed by pack_amx_weight (layers.py's
// kernels.pack_amx_weight): [N / 16][K / 32][16][32] bfloat16, element [nb][kb][p][2j + e] =
// w[16 nb + j][32 kb + 2p + e] (one AMX B tile per 16 columns x 32 k); N % 32 == 0, K % 32 == 0.
// Every output element is ONE float32 sum: tile products over k blocks 0, 1, ..., K/32 - 1 in
// that order, accumulated in an AMX tile, then rounded once to bfloat16 (to nearest even); a
// float32 output holds those bfloat16 values widened. A row's result therefore depends on its
// own x row and w only: not on M, on the other rows, or on its place in a tile (rows past M in
// the last 16-row block are zeros read from a copy and never stored). The bits equal oneDNN's
// bfloat16 inner product on 16-row calls (torch 2.13.0, this CPU's brg_matmul:avx10_1_512_amx):
// checked on every run by tests/model/test_batch_invariant_ops.py, and layers.py uses oneDNN's
// big calls beside it only where a run-time probe finds they give this kernel's bits.
//
// Work split: threads take pairs of 16-column panels; a thread runs every 32-row block of x
// against its pair (4 accumulator tiles: 2 row blocks x 2 panels), so each weight byte is read
// from memory once per call whatever M.

#if defined(__linux__) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define TW_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>
#else
#define TW_HAVE_AMX 0
#endif

namespace amx_linear_impl {

#if TW_HAVE_AMX
#define TW_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))

// CPUID leaf 7: AMX-BF16 (EDX bit 22) and AMX-TILE (bit 24); the OS must then grant this
// process the tile data state (Linux >= 5.16, arch_prctl ARCH_REQ_XCOMP_PERM).
inline bool available() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: float32 accumulators (16 x 16); 4-5: x rows (16 x 32 bf16); 6-7: w panels.
TW_AMX_TARGET inline void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// c [16 * MT rows, 32] float32 = rows a0 (and a1) against panels b0, b1, k blocks in order.
template <int MT>
TW_AMX_TARGET inline void tile_block(const uint16_t* a0, const uint16_t* a1, int64_t lda_bytes,
                                     const uint16_t* b0, const uint16_t* b1, int64_t kblocks,
                                     float* c) {
  _tile_zero(0);
  _tile_zero(1);
  if (MT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    _tile_loadd(6, b0 + kb * 512, 64);
    _tile_loadd(7, b1 + kb * 512, 64);
    _tile_loadd(4, a0 + kb * 32, lda_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (MT == 2) {
      _tile_loadd(5, a1 + kb * 32, lda_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if (MT == 2) {
    _tile_stored(2, c + 512, 128);
    _tile_stored(3, c + 512 + 16, 128);
  }
}

// `rows` rows of c [., 32] float32, rounded to bfloat16 (nearest even), into out (bfloat16, or
// float32 holding the bfloat16 values when F32), row stride ldo elements.
template <bool F32>
TW_AMX_TARGET inline void store_rows(const float* c, int64_t rows, void* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_loadu_ps(c + r * 32), hi = _mm512_loadu_ps(c + r * 32 + 16);
    if (F32) {
      float* o = static_cast<float*>(out) + r * ldo;
      const __m512i lo16 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
      const __m512i hi16 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
      _mm512_storeu_ps(o, _mm512_castsi512_ps(_mm512_slli_epi32(lo16, 16)));
      _mm512_storeu_ps(o + 16, _mm512_castsi512_ps(_mm512_slli_epi32(hi16, 16)));
    } else {
      uint16_t* o = static_cast<uint16_t*>(out) + r * ldo;
      _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// Panel pairs [p0, p1) of the output for every row of x. Row block b (16 rows) is read from
// x, or from `tail` (16 x K, zero-padded) for the last partial block.
template <bool F32>
TW_AMX_TARGET void run_pairs(const uint16_t* x, const uint16_t* tail, int64_t m, int64_t k,
                             const uint16_t* w, void* out, int64_t n, int64_t p0, int64_t p1) {
  configure();
  alignas(64) float c[32 * 32];
  const int64_t kblocks = k / 32, panel = kblocks * 512, blocks = (m + 15) / 16;
  const int64_t elem = F32 ? 4 : 2;
  auto rows_of = [&](int64_t b) { return b * 16 + 16 <= m ? x + b * 16 * k : tail; };
  auto out_at = [&](int64_t b, int64_t p) {
    return static_cast<char*>(out) + (b * 16 * n + p * 32) * elem;
  };
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* b0 = w + 2 * p * panel;
    const uint16_t* b1 = b0 + panel;
    for (int64_t b = 0; b < blocks; b += 2) {
      const int64_t rows = std::min<int64_t>(m - b * 16, 32);
      if (b + 1 < blocks) {
        tile_block<2>(rows_of(b), rows_of(b + 1), k * 2, b0, b1, kblocks, c);
      } else {
        tile_block<1>(rows_of(b), nullptr, k * 2, b0, b1, kblocks, c);
      }
      store_rows<F32>(c, rows, out_at(b, p), n);
    }
  }
  _tile_release();
}
#else
inline bool available() { return false; }
#endif

}  // namespace amx_linear_impl
