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
  const int64_t nb = ldq / 16, G = K / group;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    int8_t* qr = q + m * ldq;
    float* dr = d + m * nb;
    float* sr = s ? s + m * G : nullptr;
    if (sr) std::fill(sr, sr + G, 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t pos = act_block_pos(b, permute64);
      int8_t blk[16] = {0};
      float dv = 0.f;
      if (b * 16 < K) {
        float amax = 0.f;
        for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(xr[b * 16 + i]));
        dv = amax / 127.f;
        const float id = dv != 0.f ? 1.f / dv : 0.f;
        int32_t sum = 0;
        for (int i = 0; i < 16; ++i) {
          const float r = std::nearbyint(xr[b * 16 + i] * id);  // ties to even (default mode)
          blk[i] = static_cast<int8_t>(std::clamp(r, -127.f, 127.f));
          sum += blk[i];
        }
        if (sr) sr[b * 16 / group] += dv * float(sum);
      }
      dr[b] = dv;
      for (int i = 0; i < 16; ++i)
        qr[pos + i] = bias128 ? static_cast<int8_t>(blk[i] ^ 0x80) : blk[i];  // +128 mod 256
    }
  }
}

void rows_q8_scalar(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo, int64_t n0,
                    int64_t n1) {
  // a is plain (no permute64, no bias128)
  const int64_t G = w.n_groups, gs = w.group, nb = a.ldq / 16;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qrow = w.qs + n * w.row_bytes;
    const float* sc = w.scales + n * G;
    const float* mn = w.mins ? w.mins + n * G : nullptr;
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xq = a.q + m * a.ldq;
      const float* xd = a.d + m * nb;
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float gacc = 0.f;  // sum over the group's blocks of 16: d * (integer dot product)
        for (int64_t b0 = g * gs; b0 < (g + 1) * gs; b0 += 16) {
          int32_t isum = 0;
          if (w.kind == kQU4) {  // byte j of a group: element j (low nibble), 16 + j (high)
            const uint8_t* qb = qrow + g * 16;
            const int hi = (b0 - g * gs) ? 4 : 0;
            for (int j = 0; j < 16; ++j) isum += int32_t((qb[j] >> hi) & 0x0F) * xq[b0 + j];
          } else {
            const int8_t* qb = reinterpret_cast<const int8_t*>(qrow) + b0;
            for (int j = 0; j < 16; ++j) isum += int32_t(qb[j]) * xq[b0 + j];
          }
          gacc += xd[b0 / 16] * float(isum);
        }
        acc += sc[g] * gacc;
        if (mn) acc += mn[g] * a.s[m * G + g];
      }
      out[m * ldo + n] = acc;
    }
  }
}

}  // namespace qcpu
}  // namespace symphony
