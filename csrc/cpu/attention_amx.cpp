// Paged attention with bfloat16 products on AMX tiles; see attention_amx.h for the contract.
//
// One work item is (sequence, kv head, tile of 16 query rows), the rows of a kv head's GQA group
// taken token by token (row = token * group + head). Both products run transposed, so that the
// query rows lie across the 16 lanes of every vector the softmax touches and it needs no
// horizontal reduction:
//   S^T [64 keys x 16 rows] = K [64 keys x d] . Q^T       (four 16 x 16 float32 tiles)
//   O^T [d x 16 rows]      += V^T [d x 64 keys] . P^T     (d / 16 float32 tiles, kept in memory)
// K is the A operand in its own row-major layout (each kv head's keys rounded once per call
// into a packed copy); Q^T, the B operand, is packed once per item in the tiles' pair-interleaved
// layout; V^T is packed once per call; P^T is packed per block of 64 keys from the softmax's
// vectors (two keys' weights interleaved per lane). Online softmax in float32 with exp2, as the
// float32 kernels of paged_attention.cpp.
#include "attention_amx.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define SYM_AMX 1
#endif

namespace symphony {

#if defined(SYM_AMX)
namespace {

constexpr int kKeys = 64;  // keys per block (two K steps of 32 in each P^T . V^T product)
constexpr int kRows = 16;  // query rows per item (the N of every tile)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles, every one 16 rows of 64 bytes: Q K^T: 0 a Q^T chunk (B), 1 / 6 / 7 K rows (A), 2-5 S^T
// of keys 0-15, 16-31, 32-47, 48-63; then P V: 2 / 3 P^T of keys 0-31 / 32-63 (B), 0 / 1 V^T
// rows (A), 4-7 up to four O^T blocks (independent chains, so that their products overlap).
void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

// 16 floats rounded to bfloat16 (to nearest even; the inputs are finite).
inline __m256i to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// Two vectors of 16 floats as 16 pairs of bfloat16: lane i holds (a[i], b[i]), a in the low half.
inline __m512i pairs(__m512 a, __m512 b) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  // one rounding instruction for both (b's 16 values in the high half), then interleave
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, both);
#else
  return _mm512_or_si512(_mm512_cvtepu16_epi32(to_bf16(a)),
                         _mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(b)), 16));
#endif
}

// 2^x for x <= 0: a degree-4 polynomial of the fraction, scaled by the integer part (relative
// error < 5e-5, below the bfloat16 rounding that follows); x below -125 (a masked key's -inf)
// counts as -125, a weight of ~2e-38 beside the row's largest, 1 (normal: denormals are slow).
inline __m512 exp2v(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.6181291076284772e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// r[i][j] <- r[j][i] for 16 vectors of 16 32-bit values.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// One (sequence, kv head)'s keys, packed: K as bfloat16 rows [n_keys][D] (n_keys a multiple of
// 64, zero past kv_len) and V^T as [n_keys / 64][D / 16][2 halves][16 d][32 keys].
struct Packed {
  int64_t b, g, n_keys;
  uint16_t* k;
  uint16_t* vt;
};

// 16 cache values from element e of a cache of element type C, as float32 (exact).
template <AmxCache C>
inline __m512 load16(const void* cache, int64_t e) {
  if constexpr (C == AmxCache::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(cache) + e);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(cache) + e));
    if constexpr (C == AmxCache::kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else return _mm512_cvtph_ps(h);
  }
}

// Keys [j0, j1) of p (multiples of 64), from a cache of element type C.
template <AmxCache C>
void pack_as(const AmxAttention& a, const Packed& p, int64_t j0, int64_t j1) {
  const int64_t D = a.head_dim, kv_len = a.kv_lens[p.b];
  const int32_t* pt = a.page_table + p.b * a.max_pages;
  const int64_t slot_stride = a.n_kv_heads * D, off = p.g * D;
  auto row = [&](int64_t j) {  // element index of key j's row
    return (int64_t(pt[j / a.page_size]) * a.page_size + j % a.page_size) * slot_stride + off;
  };
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    uint16_t* dst = p.k + j * D;
    if (j >= kv_len) {
      std::memset(dst, 0, size_t(D) * 2);
    } else if constexpr (C == AmxCache::kBF16) {
      std::memcpy(dst, static_cast<const uint16_t*>(a.k_cache) + row(j), size_t(D) * 2);
    } else {
      const int64_t src = row(j);
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), to_bf16(load16<C>(a.k_cache, src + d)));
    }
  }
  for (int64_t j = j0; j < j1; j += 32) {  // 32 keys: for each 16 d, a V^T tile of 16 rows
    const int64_t blk = j / kKeys, half = (j % kKeys) / 32;
    int64_t v[32];  // element index of each key's row; -1 past kv_len
    for (int i = 0; i < 32; ++i) v[i] = j + i < kv_len ? row(j + i) : -1;
    for (int64_t c = 0; c < D / 16; ++c) {
      __m512i u[16];  // u[kp]: (key 2kp, key 2kp + 1) for each of the 16 d, then transposed
      for (int kp = 0; kp < 16; ++kp)
        u[kp] = pairs(v[2 * kp] >= 0 ? load16<C>(a.v_cache, v[2 * kp] + c * 16) : zero,
                      v[2 * kp + 1] >= 0 ? load16<C>(a.v_cache, v[2 * kp + 1] + c * 16) : zero);
      transpose16(u);
      uint16_t* tile = p.vt + ((blk * (D / 16) + c) * 2 + half) * 16 * 32;
      for (int d = 0; d < 16; ++d) _mm512_store_si512(tile + d * 32, u[d]);  // row d: 32 keys
    }
  }
}

void pack(const AmxAttention& a, const Packed& p, int64_t j0, int64_t j1) {
  switch (a.cache) {
    case AmxCache::kBF16: return pack_as<AmxCache::kBF16>(a, p, j0, j1);
    case AmxCache::kF16: return pack_as<AmxCache::kF16>(a, p, j0, j1);
    default: return pack_as<AmxCache::kF32>(a, p, j0, j1);
  }
}

// O^T blocks c .. c + N - 1 (N = 2 or 4; ot and vt at block c) += V^T . P^T, P^T in tiles 2 / 3.
template <int N>
inline void pv_blocks(float* ot, const uint16_t* vt) {
  constexpr int64_t kBlock = 16 * kRows, kV = 2 * 16 * 32;  // floats of an O^T block, bf16 of V^T's
  _tile_loadd(4, ot, 64);
  _tile_loadd(5, ot + kBlock, 64);
  if constexpr (N == 4) {
    _tile_loadd(6, ot + 2 * kBlock, 64);
    _tile_loadd(7, ot + 3 * kBlock, 64);
  }
  _tile_loadd(0, vt, 64);
  _tile_loadd(1, vt + kV, 64);
  _tile_dpbf16ps(4, 0, 2);
  _tile_dpbf16ps(5, 1, 2);
  _tile_loadd(0, vt + 16 * 32, 64);
  _tile_loadd(1, vt + kV + 16 * 32, 64);
  _tile_dpbf16ps(4, 0, 3);
  _tile_dpbf16ps(5, 1, 3);
  if constexpr (N == 4) {
    _tile_loadd(0, vt + 2 * kV, 64);
    _tile_loadd(1, vt + 3 * kV, 64);
    _tile_dpbf16ps(6, 0, 2);
    _tile_dpbf16ps(7, 1, 2);
    _tile_loadd(0, vt + 2 * kV + 16 * 32, 64);
    _tile_loadd(1, vt + 3 * kV + 16 * 32, 64);
    _tile_dpbf16ps(6, 0, 3);
    _tile_dpbf16ps(7, 1, 3);
    _tile_stored(6, ot + 2 * kBlock, 64);
    _tile_stored(7, ot + 3 * kBlock, 64);
  }
  _tile_stored(4, ot, 64);
  _tile_stored(5, ot + kBlock, 64);
}

struct Item {
  int32_t pack;  // index into the packed (sequence, kv head)s
  int32_t r0;    // the first of its 16 rows
};

// Per-thread scratch, 64-byte aligned.
struct Scratch {
  explicit Scratch(int64_t D) : buf(size_t(D / 2 * kRows + kKeys * kRows + kKeys / 2 * kRows + D * kRows + 64)) {
    auto addr = reinterpret_cast<uintptr_t>(buf.data());
    float* base = reinterpret_cast<float*>((addr + 63) & ~uintptr_t(63));
    qt = reinterpret_cast<uint32_t*>(base);               // [D / 32][16 dp][16 rows] pairs
    st = base + D / 2 * kRows;                             // [64 keys][16 rows]
    pt = reinterpret_cast<uint32_t*>(st + kKeys * kRows);  // [32 kp][16 rows] pairs
    ot = st + kKeys * kRows + kKeys / 2 * kRows;           // [D][16 rows]
  }
  std::vector<float> buf;
  uint32_t* qt;
  float* st;
  uint32_t* pt;
  float* ot;
};

void run_item(const AmxAttention& a, const Packed& p, int64_t r0, Scratch& s) {
  const int64_t D = a.head_dim, G = a.n_heads / a.n_kv_heads;
  const int64_t b = p.b, q_len = int64_t(a.cu_q_lens[b + 1]) - a.cu_q_lens[b];
  const int64_t base = int64_t(a.kv_lens[b]) - q_len, R = q_len * G;
  const int64_t n_valid = std::min<int64_t>(kRows, R - r0);
  // Q^T: lane r is row r0 + r (rows past the last are zero and see what the last one sees)
  alignas(64) int32_t pos[kRows];
  std::memset(s.qt, 0, size_t(D / 2 * kRows) * 4);
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t rr = std::min(r0 + r, R - 1), t = rr / G, h = rr % G;
    pos[r] = int32_t(base + t);
    if (r >= n_valid) continue;
    const float* q = a.q + (a.cu_q_lens[b] + t) * a.q_stride + (p.g * G + h) * D;
    for (int64_t d = 0; d < D; d += 32) {
      // 32 values as 16 pairs: even d in the low halves, odd in the high
      const __m512 lo = _mm512_loadu_ps(q + d), hi = _mm512_loadu_ps(q + d + 16);
      const __m512i idx_even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
      const __m512i idx_odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
      const __m512 ev = _mm512_permutex2var_ps(lo, idx_even, hi), od = _mm512_permutex2var_ps(lo, idx_odd, hi);
      alignas(64) uint32_t u[16];
      _mm512_store_si512(u, pairs(ev, od));
      uint32_t* col = s.qt + (d / 32) * 16 * kRows + r;
      for (int dp = 0; dp < 16; ++dp) col[dp * kRows] = u[dp];
    }
  }
  const __m512i posv = _mm512_load_si512(pos);
  const int64_t first_pos = pos[0], n_keys = pos[kRows - 1] + 1;  // keys any row sees
  const int64_t n_blocks = (n_keys + kKeys - 1) / kKeys;
  const __m512 scale = _mm512_set1_ps(a.scale * 1.4426950408889634f);
  __m512 m = _mm512_set1_ps(kNegInf), l = _mm512_setzero_ps();
  std::memset(s.ot, 0, size_t(D * kRows) * 4);
  for (int64_t blk = 0; blk < n_blocks; ++blk) {
    const int64_t j0 = blk * kKeys;
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t c = 0; c < D / 32; ++c) {
      const uint16_t* k = p.k + j0 * D + c * 32;
      _tile_loadd(0, s.qt + c * 16 * kRows, 64);
      _tile_loadd(1, k, D * 2);
      _tile_loadd(6, k + 16 * D, D * 2);
      _tile_loadd(7, k + 32 * D, D * 2);
      _tile_dpbf16ps(2, 1, 0);
      _tile_dpbf16ps(3, 6, 0);
      _tile_loadd(1, k + 48 * D, D * 2);
      _tile_dpbf16ps(4, 7, 0);
      _tile_dpbf16ps(5, 1, 0);
    }
    _tile_stored(2, s.st, 64);
    _tile_stored(3, s.st + 16 * kRows, 64);
    _tile_stored(4, s.st + 32 * kRows, 64);
    _tile_stored(5, s.st + 48 * kRows, 64);
    // the online softmax, 16 rows a vector: scaled (and masked) scores back in place, then weights
    __m512 bm = _mm512_set1_ps(kNegInf);
    const bool masked = j0 + kKeys - 1 > first_pos;
    for (int jj = 0; jj < kKeys; ++jj) {
      __m512 x = _mm512_mul_ps(_mm512_load_ps(s.st + jj * kRows), scale);
      if (masked)
        x = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf),
                               _mm512_cmp_epi32_mask(posv, _mm512_set1_epi32(int32_t(j0 + jj)), _MM_CMPINT_NLT), x);
      _mm512_store_ps(s.st + jj * kRows, x);
      bm = _mm512_max_ps(bm, x);
    }
    const __m512 mx = _mm512_max_ps(m, bm);  // finite: key 0 is in every row's first block
    const __m512 alpha = exp2v(_mm512_sub_ps(m, mx));
    __m512 sum = _mm512_setzero_ps();
    for (int jj = 0; jj < kKeys; jj += 2) {
      const __m512 p0 = exp2v(_mm512_sub_ps(_mm512_load_ps(s.st + jj * kRows), mx));
      const __m512 p1 = exp2v(_mm512_sub_ps(_mm512_load_ps(s.st + (jj + 1) * kRows), mx));
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      _mm512_store_si512(s.pt + (jj / 2) * kRows, pairs(p0, p1));
    }
    l = _mm512_fmadd_ps(l, alpha, sum);
    m = mx;
    if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0)
      for (int64_t d = 0; d < D; ++d) _mm512_store_ps(s.ot + d * kRows, _mm512_mul_ps(_mm512_load_ps(s.ot + d * kRows), alpha));
    _tile_loadd(2, s.pt, 64);
    _tile_loadd(3, s.pt + 16 * kRows, 64);
    const uint16_t* vt = p.vt + blk * (D / 16) * 2 * 16 * 32;
    int64_t c = 0;
    for (; c + 4 <= D / 16; c += 4) pv_blocks<4>(s.ot + c * 16 * kRows, vt + c * 2 * 16 * 32);
    if (c < D / 16) pv_blocks<2>(s.ot + c * 16 * kRows, vt + c * 2 * 16 * 32);  // D / 16 is even
  }
  alignas(64) float inv[kRows];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
  for (int64_t r = 0; r < n_valid; ++r) {
    const int64_t rr = r0 + r, t = rr / G, h = rr % G;
    float* o = a.out + ((a.cu_q_lens[b] + t) * a.n_heads + p.g * G + h) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = s.ot[d * kRows + r] * inv[r];
  }
}

bool os_grants_tiles() {
  // the kernel enables the tile state in XCR0 (bits 17, 18) and grants this process its data
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;  // AMX-BF16, AMX-TILE
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

bool amx_bf16_usable() {
  static const bool ok = os_grants_tiles();
  return ok;
}

bool amx_attention_takes(int64_t head_dim) { return head_dim > 0 && head_dim % 32 == 0 && head_dim <= 256; }

void amx_attention(const AmxAttention& a, const int64_t* seqs, int64_t n_seqs, const ParallelFor& pfor) {
  if (!amx_bf16_usable()) return;  // (the caller checked; this also asks for the tiles once)
  const int64_t D = a.head_dim, G = a.n_heads / a.n_kv_heads;
  std::vector<Packed> packs;
  std::vector<Item> items;
  int64_t elems = 0;
  for (int64_t i = 0; i < n_seqs; ++i) {
    const int64_t b = seqs[i], q_len = int64_t(a.cu_q_lens[b + 1]) - a.cu_q_lens[b];
    if (q_len <= 0) continue;
    const int64_t n_keys = (int64_t(a.kv_lens[b]) + kKeys - 1) / kKeys * kKeys;
    for (int64_t g = 0; g < a.n_kv_heads; ++g) {
      for (int64_t r0 = 0; r0 < q_len * G; r0 += kRows) items.push_back({int32_t(packs.size()), int32_t(r0)});
      packs.push_back({b, g, n_keys, nullptr, reinterpret_cast<uint16_t*>(elems)});
      elems += 2 * n_keys * D;
    }
  }
  if (items.empty()) return;
  // every element is written by pack; the buffer is kept between calls up to kKeepBytes (a step's
  // first touch of fresh pages costs more than its attention on a virtual machine), a larger one
  // is the call's own
  constexpr size_t kKeepBytes = size_t(64) << 20;
  static thread_local std::vector<uint16_t> kept;
  std::vector<uint16_t> own;
  std::vector<uint16_t>& store = (size_t(elems) + 32) * 2 <= kKeepBytes ? kept : own;
  if (store.size() < size_t(elems) + 32) store.resize(size_t(elems) + 32);
  uint16_t* base = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(store.data()) + 63) & ~uintptr_t(63));
  for (Packed& p : packs) {
    p.k = base + reinterpret_cast<int64_t>(p.vt);
    p.vt = p.k + p.n_keys * D;
  }
  // packing reads each kv head's context once (memory-bound): in pieces of kPackKeys keys, so
  // that one long sequence's few heads still keep every thread busy
  constexpr int64_t kPackKeys = 512;
  std::vector<std::pair<int32_t, int64_t>> pieces;  // (pack, first key)
  for (size_t i = 0; i < packs.size(); ++i)
    for (int64_t j = 0; j < packs[i].n_keys; j += kPackKeys) pieces.emplace_back(int32_t(i), j);
  pfor(int64_t(pieces.size()), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Packed& p = packs[size_t(pieces[size_t(i)].first)];
      const int64_t j = pieces[size_t(i)].second;
      pack(a, p, j, std::min(p.n_keys, j + kPackKeys));
    }
  });
  // the longest items first (their rows see the most keys), pulled from a shared counter
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) {
    const auto keys = [&](const Item& it) {
      const Packed& p = packs[size_t(it.pack)];
      return p.n_keys - (int64_t(a.cu_q_lens[p.b + 1]) - a.cu_q_lens[p.b]) + it.r0 / G;
    };
    return keys(x) > keys(y);
  });
  std::atomic<int64_t> next{0};
  const int64_t n_items = int64_t(items.size());
  pfor(n_items, [&](int64_t, int64_t) {
    configure_tiles();
    Scratch s(D);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
      const Item& it = items[size_t(i)];
      run_item(a, packs[size_t(it.pack)], it.r0, s);
    }
    _tile_release();
  });
}

#else  // built without AMX support

bool amx_bf16_usable() { return false; }
bool amx_attention_takes(int64_t) { return false; }
void amx_attention(const AmxAttention&, const int64_t*, int64_t, const ParallelFor&) {}

#endif

}  // namespace symphony
