// The int8-activation side of qlinear (qkernels.h): quantizing x per block of 32 values, and the
// scalar kernel that the SIMD ones (qkernels_q8_x86.cpp) must agree with.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "qkernels.h"

namespace symphony {
namespace qcpu {

void quantize_act(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t group, int8_t* q,
                  float* d, float* s, int64_t ldq, bool permute64, bool bias128) {
  const int64_t nb = ldq / 32, G = K / group;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    int8_t* qr = q + m * ldq;
    float* dr = d + m * nb;
    for (int64_t b = 0; b < nb; ++b) {
      // where value o of block b goes: plain, or (permute64) the u4 nibble order of its step
      const int64_t base = permute64 ? (b & ~int64_t(1)) * 32 + (b & 1) * 16 : b * 32;
      const int64_t hi_off = permute64 ? 32 : 16;
      int8_t blk[32];
      float dv = 0.f;
      if (b * 32 < K) {
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xr[b * 32 + i]));
        dv = amax / 127.f;
        const float id = dv != 0.f ? 1.f / dv : 0.f;
        for (int i = 0; i < 32; ++i) {
          const float r = std::nearbyint(xr[b * 32 + i] * id);  // ties to even (default mode)
          blk[i] = static_cast<int8_t>(std::clamp(r, -127.f, 127.f));
        }
      } else {
        std::memset(blk, 0, sizeof blk);
      }
      dr[b] = dv;
      for (int i = 0; i < 16; ++i) {
        qr[base + i] = bias128 ? static_cast<int8_t>(blk[i] ^ 0x80) : blk[i];  // +128 mod 256
        qr[base + hi_off + i] = bias128 ? static_cast<int8_t>(blk[16 + i] ^ 0x80) : blk[16 + i];
      }
    }
    if (s) {
      float* sr = s + m * G;
      for (int64_t g = 0; g < G; ++g) {
        float acc = 0.f;
        for (int64_t i = 0; i < group; ++i) acc += xr[g * group + i];
        sr[g] = acc;
      }
    }
  }
}

void rows_q8_scalar(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo, int64_t n0,
                    int64_t n1) {
  // a is plain (no permute64, no bias128)
  const int64_t G = w.n_groups, gs = w.group, nb = a.ldq / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qrow = w.qs + n * w.row_bytes;
    const float* sc = w.scales + n * G;
    const float* mn = w.mins ? w.mins + n * G : nullptr;
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xq = a.q + m * a.ldq;
      const float* xd = a.d + m * nb;
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t isum = 0;
        if (w.kind == kQU4) {
          const uint8_t* b = qrow + g * 16;
          for (int j = 0; j < 16; ++j)
            isum += int32_t(b[j] & 0x0F) * xq[g * 32 + j] + int32_t(b[j] >> 4) * xq[g * 32 + 16 + j];
        } else {
          const int8_t* b = reinterpret_cast<const int8_t*>(qrow) + g * gs;
          for (int64_t j = 0; j < gs; ++j) isum += int32_t(b[j]) * xq[g * gs + j];
        }
        acc += sc[g] * xd[(g * gs) / 32] * float(isum);
        if (mn) acc += mn[g] * a.s[m * G + g];
      }
      out[m * ldo + n] = acc;
    }
  }
}

}  // namespace qcpu
}  // namespace symphony
