// CPU implementation of the quantized-weight ops (layout: csrc/quant.h; schemas: csrc/ops.cpp).
//
//   qlinear(x [M, K] float32, W) -> x @ W^T  [M, N] float32
//   qdequant(W) -> W as float32 [N, K]
//
// qlinear has four strategies:
//   * float register kernels (paths 0-2): each group of W is dequantized into registers and
//     multiplied with the float32 activations; only the quantized bytes are read from memory.
//     AVX-512 or AVX2+FMA by cpuid (qkernels_x86.cpp), else scalar.
//   * int8-activation kernels (paths 4-8): x is quantized to int8 per block of 16 values
//     (qlinear_q8.cpp) and each weight group is an integer dot product (AVX-512 VNNI vpdpbusd,
//     AVX-VNNI, AVX2 vpmaddubsw, scalar; qkernels_q8_x86.cpp; path 8: 16 weight rows a register,
//     qkernels_t16_x86.cpp). The result differs from the float product by the rounding of x (at
//     most half a step of its block per value): the result is W times the rounded x.
//   * paths 5 / 12: int8 / 15-bit x, the AVX2 row kernels for a few rows of x (decode): each
//     weight row read once, 4 at a time, two u4 groups a load (qkernels_rows_avx2.cpp).
//   * paths 10 / 11: int8 / 15-bit x in 8-row tiles on AVX2 alone (qkernels_t16_avx2.cpp).
//   * the 15-bit kernels (path 9, AVX-512 VNNI): the same with x rounded to 15 bits per block
//     (two vpdpbusd a product), within ~3e-5 of |x| |W| of the float product; the automatic
//     float-accurate choice below 64 rows on CPUs that have them.
//   * dense (prefill): W is dequantized into a float32 scratch of up to 8 MiB (in pieces of rows
//     beyond that) and multiplied by torch's GEMM (oneDNN/MKL), so prefill runs at the float32
//     path's speed while the model stays quantized in memory.
//   * dense in bfloat16 (path 13; AMX): x and W rounded to bfloat16, oneDNN's GEMM. W's bfloat16
//     copy is kept (Bf16Cache) within SYMPHONY_BF16_CACHE_MB (default 1024; 0: none, each
//     call dequantizes into a scratch as path 3 does), so a prefill step does not dequantize.
// resolve_path below says which the automatic choices (-1, -2) take: the rule written there from
// micro-benchmarks on one CPU, or, once a start-up calibration has timed the paths on this CPU
// (symphony/engine/ops/calibrate.py), the fastest it measured (qlinear_set_auto).
// Rows are split across threads with at::parallel_for (torch's thread pool and thread count).
// A weight with float16 scales and mins, or a u4 one with implied mins (csrc/quant.h), runs the
// same kernels: the row kernels (paths 5, 7, 12, and 9 at one row) read them as they are
// (float16 widened as loaded, -8 * scale computed in registers); for the others each thread
// widens the scales of 64 rows at a time into float32 buffers of its own, and writes out the
// implied mins (with_float_scales), exactly. Both give the same bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "../quant.h"
#include "qkernels.h"
#include "attention_amx.h"
#include "../check.h"

namespace symphony {
namespace qcpu {

void rows_scalar(const QView& w, const float* x, int64_t ldx, int64_t M, float* out, int64_t ldo,
                 int64_t n0, int64_t n1) {
  std::vector<float> row(w.K);
  for (int64_t n = n0; n < n1; ++n) {
    dequant_rows(w, row.data(), n, n + 1);
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * ldx;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t k = 0; k < w.K; k += 8)
        for (int i = 0; i < 8; ++i) acc[i] += xr[k + i] * row[k + i];
      out[m * ldo + n] = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    }
  }
}

void dequant_rows(const QView& w, float* dst, int64_t n0, int64_t n1) {
  // Loops of a fixed trip count per group, so that the compiler vectorizes them.
  const int64_t G = w.n_groups, gs = w.group;
  for (int64_t n = n0; n < n1; ++n) {
    float* d = dst + (n - n0) * w.K;
    const uint8_t* q = w.qs + n * w.row_bytes;
    const float* sc = w.scales + n * G;
    const float* mn = w.mins ? w.mins + n * G : nullptr;
    if (w.kind == kQU4) {
      for (int64_t g = 0; g < G; ++g) {
        const float s = sc[g], o = mn[g];
        const uint8_t* b = q + g * 16;
        float* dg = d + g * 32;
        for (int j = 0; j < 16; ++j) dg[j] = std::fma(float(b[j] & 0x0F), s, o);
        for (int j = 0; j < 16; ++j) dg[16 + j] = std::fma(float(b[j] >> 4), s, o);
      }
    } else {
      const int8_t* qi = reinterpret_cast<const int8_t*>(q);
      for (int64_t g = 0; g < G; ++g) {
        const float s = sc[g], o = mn ? mn[g] : 0.f;
        const int8_t* b = qi + g * gs;
        float* dg = d + g * gs;
        if (mn) {
          for (int64_t j = 0; j < gs; ++j) dg[j] = std::fma(float(b[j]), s, o);
        } else {
          for (int64_t j = 0; j < gs; ++j) dg[j] = float(b[j]) * s;
        }
      }
    }
  }
}

}  // namespace qcpu

namespace {

using namespace qcpu;

// Paths of qlinear: -1 picks; the others force one (tests run every path the CPU has).
enum Path : int64_t {
  kAutoQ8 = -2, kAuto = -1, kScalar = 0, kAvx2 = 1, kAvx512 = 2, kDense = 3,
  kQ8Scalar = 4, kQ8Avx2 = 5, kQ8AvxVnni = 6, kQ8Avx512Vnni = 7, kQ8T16Avx512Vnni = 8,
  kQ15T16Avx512Vnni = 9, kQ8T8Avx2 = 10, kQ15T8Avx2 = 11, kQ15RowsAvx2 = 12, kDenseBf16 = 13,
};
constexpr int64_t kLastPath = kDenseBf16;

constexpr int64_t kDenseM = 32;  // from this many rows on, dequantize tiles and use torch's GEMM
constexpr int64_t kDenseBf16M = 64;  // int8 activations on AMX: the bfloat16 GEMM from this many rows
constexpr int64_t kRowM = 2;     // the 15-bit path's 16-row tiles from this many rows on
constexpr int64_t kRowsAvx2 = 4;  // AVX2 alone: the row kernels (5, 12) below this many rows

// The SIMD paths this CPU runs (cpuid, once).
struct CpuFeatures {
  bool avx2 = false, avx512 = false, avxvnni = false, avx512vnni = false, f16c = false;
  bool amx_bf16 = false;  // AMX tiles with bfloat16 (oneDNN's bfloat16 GEMM runs on them)
  bool amd = false;       // the vendor: the rule's one-row choice below differs by it
};

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = [] {
    CpuFeatures c;
#if defined(__x86_64__) || defined(_M_X64)
    c.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    c.f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    c.avx512 = c.avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    c.avxvnni = c.avx2 && __builtin_cpu_supports("avxvnni");
    c.avx512vnni = c.avx512 && __builtin_cpu_supports("avx512vnni");
    unsigned a = 0, b = 0, cx = 0, dx = 0;        // cpuid leaf 7: EDX bit 22 AMX-BF16, 24 AMX-TILE
    if (__get_cpuid_count(7, 0, &a, &b, &cx, &dx)) c.amx_bf16 = ((dx >> 22) & 1) && ((dx >> 24) & 1);
    c.amd = __builtin_cpu_is("amd");
#endif
    return c;
  }();
  return f;
}

bool cpu_has_avx2() { return cpu_features().avx2; }
bool cpu_has_avx512() { return cpu_features().avx512; }
bool cpu_has_avxvnni() { return cpu_features().avxvnni; }
bool cpu_has_avx512vnni() { return cpu_features().avx512vnni; }
bool cpu_has_amx_bf16() { return cpu_features().amx_bf16; }

// fn, if this CPU has what path `path` needs; a clear error otherwise
template <class Fn>
Fn require(bool has, Fn fn, int64_t path, const char* name, const char* needs) {
  SYM_CHECK(has, "symphony::qlinear: path ", path, " (", name, ") asked for, but this CPU lacks ",
              needs);
  return fn;
}

// The float32 register kernel of paths 0-2 (a concrete path: resolve_path has resolved -1 / -2).
RowsFn rows_fn(int64_t path) {
#if defined(__x86_64__) || defined(_M_X64)
  if (path == kAvx512) return require(cpu_has_avx512(), rows_avx512, path, "AVX-512", "avx512f/bw/vl/dq");
  if (path == kAvx2) return require(cpu_has_avx2(), rows_avx2, path, "AVX2", "avx2/fma");
#else
  SYM_CHECK(path == kScalar, "symphony::qlinear: path ", path,
              " needs an x86-64 CPU");
#endif
  return rows_scalar;
}

// The int8-activation row kernel of paths 4, 6, 7.
RowsQ8Fn rows_q8_fn(int64_t path) {
#if defined(__x86_64__) || defined(_M_X64)
  if (path == kQ8Avx512Vnni)
    return require(cpu_has_avx512vnni(), rows_q8_avx512vnni, path, "int8, AVX-512 VNNI",
                   "avx512f/bw/vl/dq/vnni");
  if (path == kQ8AvxVnni)
    return require(cpu_has_avxvnni(), rows_q8_avxvnni, path, "int8, AVX-VNNI", "avx_vnni");
#else
  SYM_CHECK(path == kQ8Scalar, "symphony::qlinear: path ", path,
              " needs an x86-64 CPU");
#endif
  return rows_q8_scalar;
}

// Rows of a weight with float16 scales or implied mins are widened this many at a time (a
// multiple of every kernel's row block: 4, 8, 16), into buffers of the calling thread that stay
// in its L1 / L2.
constexpr int64_t kWidenRows = 64;

#if defined(__x86_64__) || defined(_M_X64)
// float16 -> float32 with F16C, 8 at a time; returns how many it converted
__attribute__((target("avx,f16c"))) int64_t widen_f16_f16c(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  return i;
}
#endif

// float16 -> float32 (exact), n values
void widen_f16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__x86_64__) || defined(_M_X64)
  if (cpu_features().f16c) i = widen_f16_f16c(src, dst, n);
#endif
  for (; i < n; ++i) dst[i] = c10::detail::fp16_ieee_to_fp32_value(src[i]);
}

// Whether w is a u4 weight whose mins are implied (-8 * scale: csrc/quant.h).
inline bool implied_mins(const QView& w) { return w.kind == kQU4 && !w.mins && !w.mins16; }

// f(v, r0, r1, s0) over rows [n0, n1) of w, where rows r0..r1 of view v are w's rows from s0 on:
// one call with v = w (r0 = s0 = n0, r1 = n1) when the kernels can read w as it is; otherwise
// (float16 scales, implied mins) one call a piece of at most `step` rows, v viewing that piece alone (r0 = 0,
// r1 its rows, N = r1) with float32 scales and mins: float16 ones widened, and a u4 weight's
// implied mins (-8 * scale) written out, in this thread's buffers.
template <class F>
void with_float_scales(const QView& w, int64_t n0, int64_t n1, int64_t step, const F& f) {
  const bool implied = implied_mins(w);
  if (!w.scales16 && !implied) return f(w, n0, n1, n0);
  static thread_local std::vector<float> sbuf, mbuf;
  const int64_t G = w.n_groups;
  for (int64_t s0 = n0; s0 < n1; s0 += step) {
    const int64_t s1 = std::min(n1, s0 + step), n = (s1 - s0) * G;
    QView v = w;
    v.qs = w.qs + s0 * w.row_bytes;
    v.N = s1 - s0;
    v.scales16 = v.mins16 = nullptr;
    if (w.scales16) {
      sbuf.resize(size_t(step * G));
      widen_f16(w.scales16 + s0 * G, sbuf.data(), n);
      v.scales = sbuf.data();
    } else {
      v.scales = w.scales + s0 * G;
    }
    if (w.mins16) {
      mbuf.resize(size_t(step * G));
      widen_f16(w.mins16 + s0 * G, mbuf.data(), n);
      v.mins = mbuf.data();
    } else if (implied) {
      mbuf.resize(size_t(step * G));
      for (int64_t i = 0; i < n; ++i) mbuf[i] = -8.f * v.scales[i];  // exact
      v.mins = mbuf.data();
    } else if (w.mins) {
      v.mins = w.mins + s0 * G;
    }
    f(v, int64_t(0), s1 - s0, s0);
  }
}

// fn(v, n0, n1, o) over W's rows in blocks of `rb` rows, split across threads: at least ~64K
// weights a thread (smaller matrices are not worth waking a second thread for). The kernel
// computes rows n0..n1 of view v into columns n0..n1 of o: v = w and o = out, or (float16
// scales, implied mins) a view of kWidenRows rows at most (with_float_scales) and o = out + its
// first row. A kernel that reads float16 scales and implied mins itself (`as_is`) always gets
// v = w.
template <class Fn>
void for_row_blocks(const QView& w, int64_t M, int64_t rb, float* out, const Fn& fn, bool as_is = false) {
  const int64_t blocks = (w.N + rb - 1) / rb;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (rb * w.K * std::max<int64_t>(M, 1)));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    if (as_is) return fn(w, b0 * rb, std::min(w.N, b1 * rb), out);
    with_float_scales(w, b0 * rb, std::min(w.N, b1 * rb), kWidenRows,
                      [&](const QView& v, int64_t r0, int64_t r1, int64_t s0) { fn(v, r0, r1, out + (s0 - r0)); });
  });
}

// x @ W^T by the integer-activation kernels: quantize x once (this thread), then split W's rows.
void qlinear_q8(const at::Tensor& x, const QView& w, int64_t path, float* out) {
  const int64_t M = x.size(0), ldq = (w.K + 63) / 64 * 64, nb = ldq / 16;
  static thread_local std::vector<int8_t> qbuf, lbuf;
  static thread_local std::vector<float> dbuf, sbuf;
  static thread_local std::vector<int32_t> cbuf;
  qbuf.resize(M * ldq);
  dbuf.resize(M * nb);
  const bool has_min = w.mins || w.mins16 || implied_mins(w);
  if (has_min) sbuf.resize(M * w.n_groups);
  float* s = has_min ? sbuf.data() : nullptr;
#if defined(__x86_64__) || defined(_M_X64)
  if (path == kQ8Avx512Vnni || path == kQ8T16Avx512Vnni || path == kQ15T16Avx512Vnni) {
    require(cpu_has_avx512vnni(), 0, path, path == kQ15T16Avx512Vnni ? "15-bit, AVX-512 VNNI"
            : path == kQ8T16Avx512Vnni ? "int8, AVX-512 VNNI, 16-row tiles" : "int8, AVX-512 VNNI",
            "avx512f/bw/vl/dq/vnni");
    // the 15-bit path runs the row kernel below kRowM rows (faster for a GEMV as the engine
    // streams the weights: perf/RESULTS.md), the 16-row tiles from there
    const bool split = path == kQ15T16Avx512Vnni;
    const bool t16 = path == kQ8T16Avx512Vnni || (split && M >= kRowM);
    QAct a{qbuf.data(), dbuf.data(), s, ldq};
    if (split) {
      lbuf.resize(M * ldq);
      a.lo = lbuf.data();
    }
    cbuf.resize(M * nb);
    quantize_act_avx512(x.data_ptr<float>(), x.stride(0), M, w.K, w.group, qbuf.data(),
                        split ? lbuf.data() : nullptr, dbuf.data(), s, cbuf.data(), ldq,
                        !t16 && w.kind == kQU4, !t16 && w.kind == kQI8);
    const int32_t* xcorr = cbuf.data();  // (the lambda runs on other threads: their cbuf is not ours)
    if (t16)
      for_row_blocks(w, M, 16, out, [&](const QView& v, int64_t n0, int64_t n1, float* o) {
        rows_q8_t16_avx512vnni(v, a, xcorr, M, o, w.N, n0, n1);
      });
    else  // (the row kernel reads float16 scales and implied mins as they are: no widening pass)
      for_row_blocks(w, M, 4, out, [&](const QView& v, int64_t n0, int64_t n1, float* o) {
        rows_q8_avx512vnni(v, a, M, o, w.N, n0, n1);
      }, true);
    return;
  }
  if (path == kQ8Avx2 || path == kQ15RowsAvx2 || path == kQ8T8Avx2 || path == kQ15T8Avx2) {
    // AVX2: the row kernels (5, 12; qkernels_rows_avx2.cpp) or the 8-row tiles (10, 11;
    // qkernels_t16_avx2.cpp); 15-bit x for 12 and 11
    const bool split = path == kQ15RowsAvx2 || path == kQ15T8Avx2;
    const bool rows = path == kQ8Avx2 || path == kQ15RowsAvx2;
    require(cpu_has_avx2(), 0, path, rows ? (split ? "15-bit, AVX2, row kernel" : "int8, AVX2, row kernel")
                                          : (split ? "15-bit, AVX2, 8-row tiles" : "int8, AVX2, 8-row tiles"),
            "avx2/fma");
    QAct a{qbuf.data(), dbuf.data(), s, ldq};
    if (split) {
      lbuf.resize(M * ldq);
      a.lo = lbuf.data();
    }
    quantize_act_avx2(x.data_ptr<float>(), x.stride(0), M, w.K, w.group, qbuf.data(), split ? lbuf.data() : nullptr,
                      dbuf.data(), s, ldq, rows && w.kind == kQU4);
    if (rows)  // (these read float16 scales and implied mins as they are: no widening pass)
      for_row_blocks(w, M, 4, out, [&](const QView& v, int64_t n0, int64_t n1, float* o) {
        rows_q8_r4_avx2(v, a, M, o, w.N, n0, n1);
      }, cpu_features().f16c);
    else
      for_row_blocks(w, M, 8, out, [&](const QView& v, int64_t n0, int64_t n1, float* o) {
        rows_q8_t8_avx2(v, a, M, o, w.N, n0, n1);
      });
    return;
  }
#endif
  const RowsQ8Fn fn = rows_q8_fn(path);
#if defined(__x86_64__) || defined(_M_X64)
  const bool wide = fn == rows_q8_avx512vnni;  // its x layout: see qkernels_q8_x86.cpp
#else
  const bool wide = false;
#endif
  quantize_act(x.data_ptr<float>(), x.stride(0), M, w.K, w.group, qbuf.data(), dbuf.data(), s, ldq,
               wide && w.kind == kQU4, wide && w.kind == kQI8);
  const QAct a{qbuf.data(), dbuf.data(), s, ldq};
  for_row_blocks(w, M, 4, out, [&](const QView& v, int64_t n0, int64_t n1, float* o) {
    fn(v, a, M, o, w.N, n0, n1);
  });
}

// The path an automatic choice (-1, -2) takes for M rows of x and this weight; a forced path as is.
// From micro-benchmarks on the AVX-512 VNNI Xeon, one thread (perf/RESULTS.md):
//   -1 (results equal to the float32 product up to ~3e-5 of |x| |W|): the 15-bit kernels below
//      64 rows (the row kernel at one row: ~1.1x the float register kernel in the engine's
//      decode; 16-row tiles from 2 rows: 1.4x the dense GEMM at 32), the dense GEMM from 64
//      rows on. AVX-512 without VNNI (or no AVX2): the float register kernel below 32 rows, dense
//      from there (AVX2 alone: below).
//   -2 (x rounded to int8): the int8 row kernel (path 7) at one row, the int8 16-row tiles
//      (path 8) from 2 rows on, prefills included (1.2-2.9x the dense GEMM up to 256 rows,
//      1.0-1.4x at 512). Without AVX-512 VNNI: the int8 kernels (below) under 32
//      rows (64 for matrices of 3 x 2^18 weights or more), dense from there.
// Without AVX-512 VNNI (AVX2: the 8-row tiles, paths 10 / 11), from micro-benchmarks of
// SmolLM2-135M's matrices on the Xeon with those paths forced, one thread (README.avx2t16.md):
//   -2: the int8 8-row tiles (path 10), 1.2-1.3x the int8 row kernels (paths 5 / 6) at one row
//       and 1.4-1.9x at 4 rows, up to the dense GEMM's rows above (an i8 weight (Q8_0) at one
//       row: a tie within +-5% over three runs; the tiles still, see below).
//   -1, AVX2 without AVX-512: the 15-bit 8-row tiles (path 11) where the float AVX2 kernel ran,
//       below 32 rows (1.2-1.4x its speed at one row, 1.05-1.9x from 4 rows), dense from 32 as
//       before. An i8 weight at one row was a tie with the float kernel; it takes the tiles too,
//       so that a sequence's logits do not depend on how many others share its batch (the
//       float kernel and the 15-bit tiles differ by x's rounding: ~1.5e-3 on SmolLM2's logits). Against the dense GEMM,
//       a layer's four matrices take 14% less time at 16 rows; at 24 and 32 4% and 15% less
//       with MKL kept to AVX2 (MKL_ENABLE_INSTRUCTIONS=AVX2, as on an AVX2 CPU), 8% and 28%
//       more with its AVX-512 code here. With AVX-512 but no VNNI the float AVX-512 kernel
//       (path 2) is 1.1-1.8x faster than path 11 at 4 rows: as before.
// Below kRowsAvx2 rows on AVX2 without AVX-512 VNNI: the row kernels (path 5 for -2, 12 for
// -1), from micro-benchmarks on an AMD EPYC Zen 3, one thread (perf/RESULTS.md): at one row
// 1.9-2.1x the 8-row tiles on SmolLM2-135M's layer matrices read from memory, 1.3-1.4x at two;
// at four rows and more the tiles are faster.
void check_path(const char* op, int64_t path) {
  SYM_CHECK(path >= kAutoQ8 && path <= kLastPath, op, ": path must be -2 (auto, int8 "
              "activations), -1 (auto, float), 0 (scalar), 1 (AVX2), 2 (AVX-512), 3 (dense), "
              "4 (int8 scalar), 5 (int8 AVX2), 6 (int8 AVX-VNNI), 7 (int8 AVX-512 VNNI), "
              "8 (int8 AVX-512 VNNI, 16-row tiles), 9 (15-bit AVX-512 VNNI, 16-row tiles), "
              "10 (int8 AVX2, 8-row tiles), 11 (15-bit AVX2, 8-row tiles), 12 (15-bit AVX2, row "
              "kernel) or 13 (dense, bfloat16), got ", path);
}

// Whether this CPU runs path p (>= 0): what rows_fn / qlinear_q8 require of it.
bool cpu_runs(int64_t p) {
  switch (p) {
    case kScalar: case kDense: case kQ8Scalar: case kDenseBf16: return true;
    case kAvx2: case kQ8Avx2: case kQ8T8Avx2: case kQ15T8Avx2: case kQ15RowsAvx2: return cpu_has_avx2();
    case kAvx512: return cpu_has_avx512();
    case kQ8AvxVnni: return cpu_has_avxvnni();
    case kQ8Avx512Vnni: case kQ8T16Avx512Vnni: case kQ15T16Avx512Vnni: return cpu_has_avx512vnni();
    default: return false;
  }
}

// Whether the automatic choice `mode` (-1, -2) may take path p: -1 the float-accurate paths
// (float32 register kernels, the dense GEMM, the 15-bit kernels), -2 the int8-activation
// kernels and the dense GEMMs (float32, and bfloat16: x and W rounded to 8 significant bits,
// products ~3e-3 of their scale, well inside the int8 kernels' error).
bool auto_may_take(int64_t mode, int64_t p) {
  if (mode == kAuto)
    return p == kScalar || p == kAvx2 || p == kAvx512 || p == kDense || p == kQ15T16Avx512Vnni ||
           p == kQ15T8Avx2 || p == kQ15RowsAvx2;
  return p == kDense || p == kDenseBf16 || (p >= kQ8Scalar && p <= kQ8T16Avx512Vnni) || p == kQ8T8Avx2;
}

// The automatic choices measured on this CPU (symphony/engine/ops/calibrate.py sets them with
// qlinear_set_auto): for each mode (-1, -2), weight kind (u4, i8) and bucket of rows (bucket b:
// from lo[b] rows up to the next bucket's first), a concrete path. n_buckets == 0: none set, the
// rule of resolve_path applies. Set once at start-up; atomics so that a qlinear running on
// another thread meanwhile reads a valid path (the old choice or the new) for every cell.
constexpr int kMaxBuckets = 8;
struct AutoTable {
  std::atomic<int64_t> n_buckets{0};
  std::atomic<int64_t> lo[kMaxBuckets];
  std::atomic<int64_t> path[2][2][kMaxBuckets];  // [mode: -1, -2][kind][bucket]
};
AutoTable g_auto;

// The table's path for an automatic choice, or -1 where none is set.
int64_t table_path(int64_t mode, int64_t M, int64_t kind) {
  const int64_t nb = g_auto.n_buckets.load(std::memory_order_acquire);
  if (nb == 0) return -1;
  int64_t b = 0;
  while (b + 1 < nb && M >= g_auto.lo[b + 1].load(std::memory_order_relaxed)) ++b;
  return g_auto.path[mode == kAuto ? 0 : 1][kind][b].load(std::memory_order_relaxed);
}

// Always a concrete path (>= 0): what the kernel's log line and the tests read is the kernel
// that runs. A measured table (qlinear_set_auto) takes precedence over the rule below.
int64_t resolve_path(int64_t path, int64_t M, const QDims& d) {
  if (path >= 0) return path;
  if (const int64_t p = table_path(path, M, d.kind); p >= 0) return p;
  const bool t16 = cpu_has_avx512vnni();
  const bool t8 = !t16 && cpu_has_avx2();
  if (path == kAutoQ8) {
    // AMX: oneDNN's bfloat16 GEMM multiplies ~6x faster than float32 (2 cores of a Sapphire
    // Rapids: 2.0 vs 0.33 TFLOP/s at [256, 576] x [576, 1536]); on the cached bfloat16 weight it
    // passes the int8 16-row tiles from ~48 rows on (1536 x 576 Q4_1, 2 threads: 0.23 vs 0.30 ms
    // at 64 rows, 0.49 vs 1.17 ms at 256; dequantizing each call instead, from ~80 rows)
    if (cpu_has_amx_bf16() && M >= kDenseBf16M) return kDenseBf16;
    if (t16) return M < kRowM ? kQ8Avx512Vnni : kQ8T16Avx512Vnni;
    if (M < kDenseM || (M < 2 * kDenseM && d.N * d.K >= (int64_t(3) << 18)))
      return t8 ? (M < kRowsAvx2 ? kQ8Avx2 : kQ8T8Avx2) : kQ8Scalar;  // (no AVX2 without t8)
    return kDense;
  }
  if (M >= (t16 ? 2 * kDenseM : kDenseM)) return kDense;
  if (t8 && !cpu_has_avx512()) return M < kRowsAvx2 ? kQ15RowsAvx2 : kQ15T8Avx2;
  // one row of a 4-bit weight: the AVX2 row kernel beats the VNNI one (its 1-row row kernel) on a
  // Sapphire Rapids by ~6 % a decode step (perf/RESULTS.md); on an AMD Zen 4 the VNNI one is
  // 8-13 % faster (1536 x 576 Q4_1, one row: 39.6 vs 45.4 us at one thread, 41.3 vs 44.8 at two,
  // the start-up calibration's medians); 8-bit weights keep the VNNI kernel everywhere
  if (t16) return M == 1 && d.kind == kQU4 && !cpu_features().amd ? kQ15RowsAvx2 : kQ15T16Avx512Vnni;
  return cpu_has_avx512() ? kAvx512 : cpu_has_avx2() ? kAvx2 : kScalar;
}

DequantFn dequant_fn() {
#if defined(__x86_64__) || defined(_M_X64)
  if (cpu_has_avx512()) return dequant_rows_avx512;
  if (cpu_has_avx2()) return dequant_rows_avx2;
#endif
  return dequant_rows;
}

QView view_of(const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins,
              const QDims& d) {
  QView v{static_cast<const uint8_t*>(qs.data_ptr()), nullptr, nullptr,
          d.N, d.K, d.group, d.n_groups, qs.size(1), d.kind};
  if (d.half) {
    v.scales16 = static_cast<const uint16_t*>(scales.data_ptr());
    v.mins16 = d.has_min ? static_cast<const uint16_t*>(mins.data_ptr()) : nullptr;
  } else {
    v.scales = scales.data_ptr<float>();
    v.mins = d.has_min ? mins.data_ptr<float>() : nullptr;
  }
  return v;
}

// deq(rows n0..n1 of w) into dst ([n1 - n0, K]), through with_float_scales
void dequant_into(DequantFn deq, const QView& w, float* dst, int64_t n0, int64_t n1) {
  with_float_scales(w, n0, n1, kWidenRows, [&](const QView& v, int64_t r0, int64_t r1, int64_t s0) {
    deq(v, dst + (s0 - n0) * w.K, r0, r1);
  });
}

// The dense paths dequantize W in tiles of at most 8 MiB of float32 rows (any of SmolLM2's layer
// matrices whole; an output head in pieces of thousands of rows): rows a tile.
int64_t dense_tile_rows(const QDims& d) {
  return std::clamp<int64_t>((int64_t(8) << 20) / (4 * d.K), 16, d.N);
}

// Rows [n0, n1) of W as float32 into dst ([n1 - n0, K]), split across threads.
void dequant_tile(DequantFn deq, const QView& w, float* dst, int64_t n0, int64_t n1) {
  at::parallel_for(n0, n1, 8, [&](int64_t a, int64_t b) { dequant_into(deq, w, dst + (a - n0) * w.K, a, b); });
}

// Path 13's bfloat16 copies of quantized weights, dequantized on first use and kept while the
// weight lives (its quantized bytes' and scales' storages, held weakly: a weight freed and
// another allocated at the same address is never mistaken for it) and the budget allows.
// Weights are immutable once loaded, so a copy stays right for as long as its weight lives.
struct Bf16Cache {
  struct Entry {
    c10::weak_intrusive_ptr<c10::StorageImpl> qs, scales;
    int64_t N = 0, K = 0, bytes = 0;
    at::Tensor w;
  };
  std::mutex mu;
  std::unordered_map<const void*, Entry> map;  // keyed by qs.data_ptr()
  int64_t bytes = 0;
  int64_t budget = [] {
    const char* e = std::getenv("SYMPHONY_BF16_CACHE_MB");
    const long long mb = e && *e ? std::atoll(e) : 1024;
    return int64_t(std::max<long long>(mb, 0)) << 20;
  }();

  void drop_dead() {  // (mu held)
    for (auto it = map.begin(); it != map.end();) {
      if (it->second.qs.expired() || it->second.scales.expired()) {
        bytes -= it->second.bytes;
        it = map.erase(it);
      } else {
        ++it;
      }
    }
  }
};
Bf16Cache g_bf16;

// W as bfloat16 [N, K] from the cache, made (and kept, within the budget) if missing; an
// undefined tensor when it does not fit (the caller dequantizes into its scratch).
at::Tensor bf16_weight(const at::Tensor& qs, const at::Tensor& scales, const QView& w,
                       const QDims& d, DequantFn deq) {
  const void* key = qs.data_ptr();
  const int64_t need = d.N * d.K * 2;
  {
    std::lock_guard<std::mutex> lock(g_bf16.mu);
    auto it = g_bf16.map.find(key);
    if (it != g_bf16.map.end()) {
      const auto& e = it->second;
      if (!e.qs.expired() && !e.scales.expired() && e.N == d.N && e.K == d.K &&
          e.scales.lock().get() == scales.storage().unsafeGetStorageImpl())
        return e.w;
      g_bf16.bytes -= e.bytes;
      g_bf16.map.erase(it);
    }
    g_bf16.drop_dead();  // (a miss: rare once a model's weights are in)
    if (g_bf16.bytes + need > g_bf16.budget) return at::Tensor();
  }
  at::Tensor out = at::empty({d.N, d.K}, scales.options().dtype(at::kBFloat16));
  const int64_t tn = dense_tile_rows(d);
  at::Tensor tile = at::empty({tn, d.K}, scales.options().dtype(at::kFloat));
  for (int64_t n0 = 0; n0 < d.N; n0 += tn) {
    const int64_t n1 = std::min(d.N, n0 + tn);
    dequant_tile(deq, w, tile.data_ptr<float>(), n0, n1);
    out.narrow(0, n0, n1 - n0).copy_(tile.narrow(0, 0, n1 - n0));
  }
  std::lock_guard<std::mutex> lock(g_bf16.mu);
  if (g_bf16.map.count(key) == 0 && g_bf16.bytes + need <= g_bf16.budget) {
    g_bf16.map.emplace(key, Bf16Cache::Entry{qs.storage().getWeakStorageImpl(),
                                             scales.storage().getWeakStorageImpl(), d.N, d.K, need, out});
    g_bf16.bytes += need;
  }
  return out;
}

at::Tensor qdequant_cpu(const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins,
                        int64_t kind, int64_t group) {
  const QDims d = check_qweight("symphony::qdequant", qs, scales, mins, kind, group);
  SYM_CHECK(qs.device().is_cpu(), "symphony::qdequant: CPU tensors expected");
  at::Tensor out = at::empty({d.N, d.K}, scales.options().dtype(at::kFloat));
  if (d.N == 0) return out;
  const QView w = view_of(qs, scales, mins, d);
  float* o = out.data_ptr<float>();
  const DequantFn deq = dequant_fn();
  at::parallel_for(0, d.N, std::max<int64_t>(1, 16384 / d.K),
                   [&](int64_t n0, int64_t n1) { dequant_into(deq, w, o + n0 * d.K, n0, n1); });
  return out;
}

at::Tensor qlinear_cpu(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t kind, int64_t group, int64_t path) {
  constexpr const char* op = "symphony::qlinear";
  const QDims d = check_qweight(op, qs, scales, mins, kind, group);
  check_path(op, path);
  SYM_CHECK(x.dim() == 2, op, ": x must be 2-D [M, K], got shape ", x.sizes());
  SYM_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  SYM_CHECK(x.size(1) == d.K, op, ": x has ", x.size(1), " columns but the weight has K = ", d.K);
  SYM_CHECK(x.device().is_cpu() && qs.device().is_cpu(), op, ": CPU tensors expected");
  SYM_CHECK(x.size(1) <= 1 || x.stride(1) == 1, op, ": x rows must be contiguous");
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, d.N}, x.options());
  if (M == 0 || d.N == 0) return out;
  const QView w = view_of(qs, scales, mins, d);
  const int64_t eff = resolve_path(path, M, d);
  if (eff == kDense || eff == kDenseBf16) {
    // Dequantizing is ~0.3% of the GEMM's time at prefill sizes, but splitting the GEMM into
    // narrow tiles cost 20-40%: dequantize up to 8 MiB of rows at once (dense_tile_rows) and
    // multiply each piece. The scratch is kept per thread (8 MiB at most), so no call pays page
    // faults for it.
    // bfloat16: the float32 tile rounded (to nearest even) into a second scratch, x once, and
    // the product (float32 accumulation in oneDNN, rounded to bfloat16) widened into out.
    const bool bf = eff == kDenseBf16;
    if (bf) {
      const at::Tensor wb = bf16_weight(qs, scales, w, d, dequant_fn());
      if (wb.defined()) return at::mm(x.to(at::kBFloat16), wb.t()).to(at::kFloat);
    }
    const int64_t tn = dense_tile_rows(d);
    static thread_local at::Tensor scratch, scratch_bf;
    if (!scratch.defined() || scratch.numel() < tn * d.K) scratch = at::empty({tn * d.K}, scales.options().dtype(at::kFloat));
    if (bf && (!scratch_bf.defined() || scratch_bf.numel() < tn * d.K))
      scratch_bf = at::empty({tn * d.K}, scales.options().dtype(at::kBFloat16));
    const at::Tensor xm = bf ? x.to(at::kBFloat16) : x;
    const DequantFn deq = dequant_fn();
    for (int64_t n0 = 0; n0 < d.N; n0 += tn) {
      const int64_t n1 = std::min(d.N, n0 + tn);
      at::Tensor t = scratch.narrow(0, 0, (n1 - n0) * d.K).view({n1 - n0, d.K});
      dequant_tile(deq, w, t.data_ptr<float>(), n0, n1);
      if (bf) t = scratch_bf.narrow(0, 0, (n1 - n0) * d.K).view({n1 - n0, d.K}).copy_(t);
      if (n1 - n0 == d.N && !bf) return at::mm(xm, t.t());
      out.narrow(1, n0, n1 - n0).copy_(at::mm(xm, t.t()));
    }
    return out;
  }
  if (eff >= kQ8Scalar) {
    qlinear_q8(x, w, eff, out.data_ptr<float>());
    return out;
  }
  const RowsFn fn = rows_fn(eff);
  const float* xp = x.data_ptr<float>();
  float* op_ = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  for_row_blocks(w, M, 4, op_, [&](const QView& v, int64_t n0, int64_t n1, float* o) {
    fn(v, xp, ldx, M, o, d.N, n0, n1);
  });
  return out;
}

int64_t qcpu_features() {
  return (cpu_has_avx2() ? 1 : 0) | (cpu_has_avx512() ? 2 : 0) | (cpu_has_avxvnni() ? 4 : 0) |
         (cpu_has_avx512vnni() ? 8 : 0) | (cpu_has_amx_bf16() ? 16 : 0) | (amx_bf16_usable() ? 32 : 0);
}

// The path qlinear's choice ``path`` (-2, -1: automatic; others are returned as they are)
// takes for an [M, K] x on an [N, K] weight of ``kind`` on this CPU: resolve_path itself, for
// the kernel's log and the tests (3 is the dense GEMM).
int64_t qlinear_path_for(int64_t path, int64_t M, int64_t N, int64_t K, int64_t kind) {
  constexpr const char* op = "symphony::qlinear_path_for";
  check_path(op, path);
  check_qkind(op, kind);
  SYM_CHECK(M >= 1 && N >= 1 && K >= 1, op, ": M, N and K must be >= 1, got ", M, ", ", N,
              ", ", K);
  QDims d{};
  d.N = N;
  d.K = K;
  d.kind = static_cast<QKind>(kind);
  return resolve_path(path, M, d);
}

// The paths the automatic choice `mode` (-1, -2) may take on this CPU, ascending: what a
// calibration times and what qlinear_set_auto accepts.
std::vector<int64_t> qlinear_auto_paths(int64_t mode) {
  SYM_CHECK(mode == kAuto || mode == kAutoQ8, "symphony::qlinear_auto_paths: mode must be -1 or -2, got ",
              mode);
  std::vector<int64_t> out;
  for (int64_t p = kScalar; p <= kLastPath; ++p)
    if (cpu_runs(p) && auto_may_take(mode, p)) out.push_back(p);
  return out;
}

// Sets the automatic choices (see AutoTable): `rows` the buckets' first row counts (ascending,
// rows[0] == 1, at most kMaxBuckets), `paths` [mode -1, -2][kind u4, i8][bucket] flattened, each
// one qlinear_auto_paths(mode) holds. Empty `rows` (and `paths`) clears the table: the rule.
void qlinear_set_auto(at::IntArrayRef rows, at::IntArrayRef paths) {
  constexpr const char* op = "symphony::qlinear_set_auto";
  const int64_t nb = int64_t(rows.size());
  SYM_CHECK(nb <= kMaxBuckets && int64_t(paths.size()) == 4 * nb, op, ": expected at most ",
              kMaxBuckets, " buckets and 4 paths a bucket, got ", nb, " buckets and ", paths.size(),
              " paths");
  for (int64_t b = 0; b < nb; ++b)
    SYM_CHECK(b == 0 ? rows[0] == 1 : rows[b] > rows[b - 1], op,
                ": bucket rows must start at 1 and ascend, got ", rows);
  for (int64_t i = 0; i < 4 * nb; ++i) {
    const int64_t mode = i < 2 * nb ? kAuto : kAutoQ8;
    SYM_CHECK(cpu_runs(paths[i]) && auto_may_take(mode, paths[i]), op, ": path ", paths[i],
                " (mode ", mode, ", kind ", (i / nb) % 2, ", bucket ", i % nb,
                ") is not one the automatic choice may take on this CPU");
  }
  g_auto.n_buckets.store(0, std::memory_order_release);  // the rule while the cells change
  for (int64_t b = 0; b < nb; ++b) {
    g_auto.lo[b].store(rows[b], std::memory_order_relaxed);
    for (int64_t i = 0; i < 4; ++i)
      g_auto.path[i / 2][i % 2][b].store(paths[i * nb + b], std::memory_order_relaxed);
  }
  g_auto.n_buckets.store(nb, std::memory_order_release);
}

// Path 13's cache of bfloat16 weights: [bytes held, weights held, budget in bytes].
std::vector<int64_t> qlinear_bf16_cache() {
  std::lock_guard<std::mutex> lock(g_bf16.mu);
  g_bf16.drop_dead();
  return {g_bf16.bytes, int64_t(g_bf16.map.size()), g_bf16.budget};
}

// Sets the cache's budget (bytes >= 0); copies over it are dropped, 0 empties it.
void qlinear_set_bf16_cache(int64_t budget) {
  SYM_CHECK(budget >= 0, "symphony::qlinear_set_bf16_cache: the budget must be >= 0 bytes, got ", budget);
  std::lock_guard<std::mutex> lock(g_bf16.mu);
  g_bf16.budget = budget;
  g_bf16.drop_dead();
  for (auto it = g_bf16.map.begin(); it != g_bf16.map.end() && g_bf16.bytes > budget;) {
    g_bf16.bytes -= it->second.bytes;
    it = g_bf16.map.erase(it);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(symphony, CPU, m) {
  m.impl("qlinear", &qlinear_cpu);
  m.impl("qdequant", &qdequant_cpu);
}

// Bit 0: the AVX2 paths run here, bit 1: the AVX-512 path, bit 2: AVX-VNNI, bit 3: AVX-512 VNNI,
// bit 4: AMX with bfloat16 (the rule's choice of path 13), bit 5: this process may use the AMX
// tiles itself and the ops were built with them (paged_attention_bf16's tiled path; attention_amx.h). No tensor arguments, so a catch-all
// kernel defined here rather than a schema in ops.cpp with per-backend implementations.
TORCH_LIBRARY_FRAGMENT(symphony, m) {
  m.def("qcpu_features() -> int", &qcpu_features);
  m.def("qlinear_path_for(int path, int M, int N, int K, int kind) -> int", &qlinear_path_for);
  m.def("qlinear_auto_paths(int mode) -> int[]", &qlinear_auto_paths);
  m.def("qlinear_set_auto(int[] rows, int[] paths) -> ()", &qlinear_set_auto);
  m.def("qlinear_bf16_cache() -> int[]", &qlinear_bf16_cache);
  m.def("qlinear_set_bf16_cache(int budget) -> ()", &qlinear_set_bf16_cache);
}

}  // namespace symphony
