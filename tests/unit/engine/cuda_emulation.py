"""The CUDA kernels of csrc/cuda/attention_tiled.cu and csrc/cuda/gemv_tc.cu, emulated on the CPU.

A machine without a GPU cannot run those kernels, so these functions replay them in numpy: the
same grid, the same warps and lanes, the same fragment indices, block sizes, masks, split
arithmetic and online-softmax merge order, with every lane of a warp a row of an array. Warp
shuffles are index permutations over the lane axis, shared memory is an array, an
``mma.sync.m16n8k16`` is a 16 x 16 by 16 x 8 product assembled from and scattered back into the
lanes' fragments by the PTX ISA's layout (``MMA`` below, the one assumption these emulations
share with the kernels). Each function mirrors its kernel statement by statement (the comments
name them), so a test of its result against plain attention or a plain product checks the
kernels' index arithmetic; it cannot check the CUDA code's transcription of it, which only a GPU
run does (tests/unit/engine/test_cuda_kernels.py).

Values are float32 arrays holding 16-bit values (``rnd`` rounds to the kernel's dtype where the
kernel rounds: P before P V, the outputs).
"""
from __future__ import annotations

import numpy as np
import torch

LANES = np.arange(32)
GRP, TQ = LANES // 4, LANES % 4
F32 = np.float32


def rounder(dtype: torch.dtype):
    """x -> x rounded to ``dtype`` (nearest even) and widened back to float32."""
    return lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=F32)).to(dtype).float().numpy()


# ------------------------------------------------------------------ mma.m16n8k16 (csrc/cuda/mma.cuh)
class MMA:
    """Fragment layouts: for lane (grp, tq), A register r holds two values (half h = 0 low, 1
    high) at row grp + 8 (r % 2), column 2 tq + h + 8 (r // 2); B register r at k row
    2 tq + h + 8 r, column grp; C value i at row grp + 8 (i // 2), column 2 tq + i % 2."""

    A_ROW = (GRP[:, None, None] + 8 * (np.arange(4) % 2)[None, :, None]) + 0 * np.arange(2)[None, None, :]
    A_COL = 2 * TQ[:, None, None] + np.arange(2)[None, None, :] + 8 * (np.arange(4) // 2)[None, :, None]
    B_ROW = 2 * TQ[:, None, None] + np.arange(2)[None, None, :] + 8 * np.arange(2)[None, :, None]
    B_COL = GRP[:, None, None] + 0 * B_ROW
    C_ROW = GRP[:, None] + 8 * (np.arange(4) // 2)[None, :]
    C_COL = 2 * TQ[:, None] + (np.arange(4) % 2)[None, :]

    @classmethod
    def run(cls, c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """c [32, 4] += A B with a [32, 4, 2] and b [32, 2, 2] the lanes' fragments."""
        A = np.zeros((16, 16), F32)
        B = np.zeros((16, 8), F32)
        A[cls.A_ROW, cls.A_COL] = a
        B[cls.B_ROW, cls.B_COL] = b
        assert (np.bincount((cls.A_ROW * 16 + cls.A_COL).ravel(), minlength=256) == 1).all()
        D = (A.astype(np.float64) @ B.astype(np.float64)).astype(F32)
        return c + D[cls.C_ROW, cls.C_COL]


def shfl_xor(x: np.ndarray, off: int) -> np.ndarray:
    """__shfl_xor_sync over the lane axis (axis 0)."""
    return x[LANES ^ off]


def exp2(x):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.exp2(x).astype(F32)


def weight_of(m, ref):
    """attention_tiled.cu's weight_of: 2^(m - ref), 0 for an empty state."""
    m = np.asarray(m, F32)
    return np.where(m == -np.inf, F32(0), exp2(np.where(m == -np.inf, 0, m - ref)))


def find_last_le(starts, n, x) -> int:
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if starts[mid] <= x:
            lo = mid
        else:
            hi = mid
    return lo


# ------------------------------------------------------------------ paged_attention_tiled
K_ROWS, K_MIN_Q, K_THREADS, K_MAX_SPLITS = 64, 32, 128, 32
LOG2E = 1.4426950408889634


def prefill_tiles(cu: np.ndarray, tile_tokens: int) -> np.ndarray:
    """prefill_tiles_kernel: tile_start[b] (exclusive prefix sum of each sequence's tiles)."""
    q_len = np.diff(cu)
    n = np.where(q_len >= K_MIN_Q, (q_len + tile_tokens - 1) // tile_tokens, 0)
    return np.concatenate([[0], np.cumsum(n)]).astype(np.int64)


def attention_tiled(q, k_cache, v_cache, page_table, cu, kv_lens, scale, rnd, prefill=True,
                    decode=True, sms=132):
    """The op's host code and kernels: out [T, H, D] (NaN where no kernel wrote: the general
    kernels' share when ``prefill`` / ``decode`` is off) and which (kernel, token) wrote."""
    T, H, D = q.shape
    n_kv = k_cache.shape[2]
    G = H // n_kv
    out = np.full((T, H, D), np.nan, F32)
    prefill = prefill and T >= K_MIN_Q
    p = dict(q=q, kc=k_cache, vc=v_cache, pt=page_table, cu=cu, kv_lens=kv_lens, T=T, B=len(kv_lens),
             n_heads=H, n_kv=n_kv, G=G, D=D, page_size=k_cache.shape[1], max_pages=page_table.shape[1],
             num_pages=k_cache.shape[0], scale_log2=F32(scale * LOG2E), tile_tokens=K_ROWS // G,
             skip_long=prefill, rnd=rnd, out=out)
    if prefill:
        p["tile_start"] = prefill_tiles(cu, p["tile_tokens"])
        grid = (T + p["tile_tokens"] - 1) // p["tile_tokens"] + T // K_MIN_Q + 1
        for tile in range(grid):
            for g in range(n_kv):
                prefill_block(p, tile, g)
    if decode:
        U = 4 if G <= 4 else 2
        step = 4 * (32 // (D // 8)) * U
        S = decode_splits(T, n_kv, p["max_pages"] * p["page_size"], sms, step)
        p.update(splits=S, U=U, MG=4 if G <= 4 else 8)
        if S > 1:
            p["part_o"] = np.full((T, H, S, D), np.nan, F32)
            p["part_ml"] = np.full((T, H, S, 2), np.nan, F32)
        for t in range(T):
            for g in range(n_kv):
                for split in range(S):
                    decode_block(p, t, g, split)
        if S > 1:
            for row in range(T * H):
                combine_row(p, row)
    return out


def decode_splits(T, n_kv, max_keys, sms, step):
    blocks, want = T * n_kv, 4 * sms
    if blocks >= want:
        return 1
    s = min(-(-want // blocks), K_MAX_SPLITS, -(-max_keys // step))
    return max(int(s), 1)


def key_offset(p, b, j):
    """(page, slot) of key j of sequence b, or None for a bad page id."""
    page = int(p["pt"][b, j // p["page_size"]])
    if not 0 <= page < p["num_pages"]:
        return None
    return page, j % p["page_size"]


def prefill_block(p, tile, g):
    """prefill_tiled_kernel for block (tile, g)."""
    D, G, B = p["D"], p["G"], p["B"]
    BN, CH = 4096 // D, D // 8
    LOADS, NT, KS, DT = BN * CH // K_THREADS, BN // 8, D // 16, D // 8
    ts = p["tile_start"]
    if tile >= ts[B]:
        return
    b = find_last_le(ts, B, tile)
    q_start = int(p["cu"][b])
    q_len = int(p["cu"][b + 1]) - q_start
    n_tiles = int(ts[b + 1] - ts[b])
    lt = n_tiles - 1 - (tile - int(ts[b]))
    i0 = lt * p["tile_tokens"]
    i1 = min(i0 + p["tile_tokens"], q_len)
    kv_len = int(p["kv_lens"][b])
    max_keys = p["max_pages"] * p["page_size"]
    base = kv_len - q_len
    n_keys = min(max(base + i1, 0), max_keys)
    n_rows = (i1 - i0) * G

    # per warp: the lanes' rows, Q fragments, state
    warps = []
    for warp in range(4):
        rA, rB = warp * 16 + GRP, warp * 16 + GRP + 8
        tokA, tokB = q_start + i0 + rA // G, q_start + i0 + rB // G
        okA = (rA < n_rows) & (tokA >= 0) & (tokA < p["T"])
        okB = (rB < n_rows) & (tokB >= 0) & (tokB < p["T"])
        hA, hB = g * G + rA % G, g * G + rB % G
        limA = np.where(okA, base + i0 + rA // G, -1)
        limB = np.where(okB, base + i0 + rB // G, -1)
        qrowA = np.where(okA[:, None], p["q"][np.where(okA, tokA, 0), hA], 0)    # [32, D]
        qrowB = np.where(okB[:, None], p["q"][np.where(okB, tokB, 0), hB], 0)
        qf = []
        for kk in range(KS):
            c = kk * 16 + 2 * TQ
            pair = lambda row, col: np.stack([row[LANES, col], row[LANES, col + 1]], -1)   # noqa: E731
            qf.append(np.stack([pair(qrowA, c), pair(qrowB, c), pair(qrowA, c + 8), pair(qrowB, c + 8)], 1))
        warps.append(dict(rA=rA, rB=rB, tokA=tokA, tokB=tokB, okA=okA, okB=okB, hA=hA, hB=hB, limA=limA,
                          limB=limB, qf=qf, o=np.zeros((DT, 32, 4), F32), mA=np.full(32, -np.inf, F32),
                          mB=np.full(32, -np.inf, F32), lA=np.zeros(32, F32), lB=np.zeros(32, F32)))

    def load(j0):
        """load(): the 128 threads' chunks of tile j0 (zeros past n_keys or on a bad page)."""
        ks, vs = np.zeros((BN, D), F32), np.zeros((BN, D), F32)
        for i in range(LOADS):
            for tid in range(K_THREADS):
                c = tid + i * K_THREADS
                key, ch = c // CH, c % CH
                j = j0 + key
                if j < n_keys:
                    at = key_offset(p, b, j)
                    if at is not None:
                        ks[key, ch * 8:ch * 8 + 8] = p["kc"][at[0], at[1], g, ch * 8:ch * 8 + 8]
                        vs[key, ch * 8:ch * 8 + 8] = p["vc"][at[0], at[1], g, ch * 8:ch * 8 + 8]
        return ks, vs

    nxt = load(0) if n_keys > 0 else None
    for j0 in range(0, n_keys, BN):
        k_s, v_s = nxt                              # stored to shared memory
        if j0 + BN < n_keys:
            nxt = load(j0 + BN)
        for w in warps:
            s = np.zeros((NT, 32, 4), F32)
            for nt in range(NT):
                krow = k_s[nt * 8 + GRP]                # [32, D]: B column grp is key nt * 8 + grp
                for kk in range(KS):
                    col = kk * 16 + 2 * TQ
                    b0 = np.stack([krow[LANES, col], krow[LANES, col + 1]], -1)
                    b1 = np.stack([krow[LANES, col + 8], krow[LANES, col + 9]], -1)
                    s[nt] = MMA.run(s[nt], w["qf"][kk], np.stack([b0, b1], 1))
            mxA, mxB = np.full(32, -np.inf, F32), np.full(32, -np.inf, F32)
            for nt in range(NT):
                for e in range(4):
                    key = j0 + nt * 8 + 2 * TQ + (e & 1)
                    lim = w["limA"] if e < 2 else w["limB"]
                    v = np.where((key <= lim) & (key < n_keys), s[nt][:, e] * p["scale_log2"], -np.inf).astype(F32)
                    s[nt][:, e] = v
                    if e < 2:
                        mxA = np.maximum(mxA, v)
                    else:
                        mxB = np.maximum(mxB, v)
            for off in (1, 2):
                mxA = np.maximum(mxA, shfl_xor(mxA, off))
                mxB = np.maximum(mxB, shfl_xor(mxB, off))
            nA, nB = np.maximum(w["mA"], mxA), np.maximum(w["mB"], mxB)
            uA, uB = np.where(nA == -np.inf, 0, nA).astype(F32), np.where(nB == -np.inf, 0, nB).astype(F32)
            alA, alB = weight_of(w["mA"], uA), weight_of(w["mB"], uB)
            w["mA"], w["mB"] = nA, nB
            pf = np.zeros((NT // 2, 32, 4, 2), F32)
            sumA, sumB = np.zeros(32, F32), np.zeros(32, F32)
            for nt in range(NT):
                p0, p1 = exp2(s[nt][:, 0] - uA), exp2(s[nt][:, 1] - uA)
                p2, p3 = exp2(s[nt][:, 2] - uB), exp2(s[nt][:, 3] - uB)
                sumA, sumB = sumA + p0 + p1, sumB + p2 + p3
                pf[nt // 2][:, (nt & 1) * 2] = p["rnd"](np.stack([p0, p1], -1))
                pf[nt // 2][:, (nt & 1) * 2 + 1] = p["rnd"](np.stack([p2, p3], -1))
            w["lA"], w["lB"] = w["lA"] * alA + sumA, w["lB"] * alB + sumB
            w["o"][:, :, 0:2] *= alA[None, :, None]
            w["o"][:, :, 2:4] *= alB[None, :, None]
            for ks in range(NT // 2):
                keys = ks * 16 + 2 * TQ                 # B rows of the k-step
                for dt in range(DT):
                    col = dt * 8 + GRP
                    b0 = np.stack([v_s[keys, col], v_s[keys + 1, col]], -1)
                    b1 = np.stack([v_s[keys + 8, col], v_s[keys + 9, col]], -1)
                    w["o"][dt] = MMA.run(w["o"][dt], pf[ks], np.stack([b0, b1], 1))
    for w in warps:
        lA, lB = w["lA"], w["lB"]
        for off in (1, 2):
            lA, lB = lA + shfl_xor(lA, off), lB + shfl_xor(lB, off)
        invA = np.where(lA > 0, 1 / np.where(lA > 0, lA, 1), 0).astype(F32)
        invB = np.where(lB > 0, 1 / np.where(lB > 0, lB, 1), 0).astype(F32)
        for dt in range(DT):
            c = dt * 8 + 2 * TQ
            for lane in range(32):
                if w["okA"][lane]:
                    row = p["out"][w["tokA"][lane], w["hA"][lane]]
                    assert np.isnan(row[c[lane]:c[lane] + 2]).all(), "a value written twice"
                    row[c[lane]:c[lane] + 2] = p["rnd"](w["o"][dt][lane, 0:2] * invA[lane])
                if w["okB"][lane]:
                    row = p["out"][w["tokB"][lane], w["hB"][lane]]
                    assert np.isnan(row[c[lane]:c[lane] + 2]).all(), "a value written twice"
                    row[c[lane]:c[lane] + 2] = p["rnd"](w["o"][dt][lane, 2:4] * invB[lane])


def decode_block(p, t, g, split):
    """decode_split_kernel for block (t, g, split)."""
    D, G, S, U, MG = p["D"], p["G"], p["splits"], p["U"], p["MG"]
    L = D // 8
    KPW = 32 // L
    STEP = 4 * KPW * U
    sub, slot = LANES % L, LANES // L
    b = find_last_le(p["cu"], p["B"], t)
    q_start = int(p["cu"][b])
    q_len = int(p["cu"][b + 1]) - q_start
    if p["skip_long"] and q_len >= K_MIN_Q:
        if S > 1:
            for h in range(G):
                p["part_ml"][t, g * G + h, split, 1] = -1.0
        return
    kv_len = int(p["kv_lens"][b])
    n_keys = min(max(kv_len - q_len + (t - q_start) + 1, 0), p["max_pages"] * p["page_size"])
    k_begin, k_end = 0, n_keys
    if S > 1:
        chunk = -(-n_keys // S)
        chunk = -(-chunk // STEP) * STEP
        k_begin = split * chunk
        k_end = min(k_begin + chunk, n_keys)
    if k_begin >= k_end:
        for h in range(G):
            if S == 1:
                assert np.isnan(p["out"][t, g * G + h]).all()
                p["out"][t, g * G + h] = 0
            else:
                p["part_ml"][t, g * G + h, split] = (-np.inf, 0)
        return
    # per warp, arrays over lanes: qf [MG, 32, 8], acc [MG, 32, 8], m, l [MG, 32]
    qf = np.zeros((MG, 32, 8), F32)
    for h in range(G):
        qf[h] = p["q"][t, g * G + h][sub[:, None] * 8 + np.arange(8)] * p["scale_log2"]
    red_o, red_m, red_l = np.zeros((4, MG, D), F32), np.zeros((4, MG), F32), np.zeros((4, MG), F32)
    for warp in range(4):
        acc = np.zeros((MG, 32, 8), F32)
        m, l = np.full((MG, 32), -np.inf, F32), np.zeros((MG, 32), F32)
        for js in range(k_begin, k_end, STEP):
            jb = js + (warp * KPW + slot) * U
            kq, vq, ok = np.zeros((U, 32, 8), F32), np.zeros((U, 32, 8), F32), np.zeros((U, 32), bool)
            for u in range(U):
                for lane in range(32):
                    j = int(jb[lane]) + u
                    if j < k_end:
                        at = key_offset(p, b, j)
                        if at is not None:
                            cols = slice(sub[lane] * 8, sub[lane] * 8 + 8)
                            kq[u, lane] = p["kc"][at[0], at[1], g, cols]
                            vq[u, lane] = p["vc"][at[0], at[1], g, cols]
                            ok[u, lane] = True
            sc = np.zeros((U, MG, 32), F32)
            for u in range(U):
                for h in range(MG):
                    d = (qf[h] * kq[u]).sum(-1, dtype=F32)
                    off = L // 2
                    while off > 0:
                        d = d + shfl_xor(d, off)
                        off >>= 1
                    sc[u, h] = np.where(ok[u], d, -np.inf)
            for h in range(MG):
                mx = sc[:, h].max(0)
                mn = np.maximum(m[h], mx)
                use = np.where(mn == -np.inf, 0, mn).astype(F32)
                al = weight_of(m[h], use)
                m[h] = mn
                sc[:, h] = exp2(sc[:, h] - use)
                l[h] = l[h] * al + sc[:, h].sum(0)
                acc[h] *= al[:, None]
            for u in range(U):
                for h in range(MG):
                    acc[h] += sc[u, h][:, None] * vq[u]
        off = L
        while off < 32:
            for h in range(MG):
                mo, lo = shfl_xor(m[h], off), shfl_xor(l[h], off)
                mn = np.maximum(m[h], mo)
                use = np.where(mn == -np.inf, 0, mn).astype(F32)
                a, ao = weight_of(m[h], use), weight_of(mo, use)
                l[h] = l[h] * a + lo * ao
                m[h] = mn
                acc[h] = acc[h] * a[:, None] + shfl_xor(acc[h], off) * ao[:, None]
            off <<= 1
        for lane in range(L):                   # slot 0: lanes 0 .. L - 1
            for h in range(G):
                red_o[warp, h, lane * 8:lane * 8 + 8] = acc[h, lane]
                if lane == 0:
                    red_m[warp, h], red_l[warp, h] = m[h, 0], l[h, 0]
    for h in range(G):
        M = red_m[:, h].max()
        use = F32(0) if M == -np.inf else M
        a = weight_of(red_m[:, h], use)
        total = (red_l[:, h] * a).sum(dtype=F32)
        o = (red_o[:, h] * a[:, None]).sum(0, dtype=F32)
        if S == 1:
            assert np.isnan(p["out"][t, g * G + h]).all(), "a value written twice"
            p["out"][t, g * G + h] = p["rnd"](o / total if total > 0 else np.zeros(D, F32))
        else:
            p["part_o"][t, g * G + h, split] = o
            p["part_ml"][t, g * G + h, split] = (M, total)


def combine_row(p, row):
    """combine_kernel's warp for one (token, head) row."""
    S, D, H = p["splits"], p["D"], p["n_heads"]
    t, h = divmod(row, H)
    ml = p["part_ml"][t, h]                       # [S, 2]
    if ml[0, 1] < 0:
        return
    lv = np.zeros(32, F32)
    mv = np.full(32, -np.inf, F32)
    lv[:S] = ml[:, 1]
    mv[:S] = np.where(ml[:, 1] > 0, ml[:, 0], -np.inf)
    lv = np.where(lv > 0, lv, 0).astype(F32)
    M = mv.max()
    use = F32(0) if M == -np.inf else M
    w = weight_of(mv, use)
    total = (lv * w).sum(dtype=F32)
    inv = 1 / total if total > 0 else 0
    acc = np.zeros(D, F32)
    for s in range(S):
        if w[s] != 0:
            acc += p["part_o"][t, h, s] * w[s]
    assert np.isnan(p["out"][t, h]).all(), "a value written twice"
    p["out"][t, h] = p["rnd"](acc * inv)


# ------------------------------------------------------------------ dense_gemv_tc
K_WARPS = 8


def gemv_auto_splits(N, K, sms):
    groups, kblocks, s = -(-N // 16), -(-K // 64), 1
    while s < K_WARPS and groups * s < 16 * sms and kblocks >= 4 * s:
        s *= 2
    return s


def gemv_tc(x: np.ndarray, w: np.ndarray, splits: int) -> np.ndarray:
    """gemv_tc_kernel: x [M, K] @ w [N, K]^T (float32 out, before its rounding)."""
    M, K = x.shape
    N = w.shape[0]
    groups_a_block = K_WARPS // splits
    blocks = -(-N // (16 * groups_a_block))
    kblocks = -(-K // 64)
    out = np.full((M, N), np.nan, F32)
    for blk in range(blocks):
        red = np.zeros((K_WARPS, 32, 4), F32)
        for warp in range(K_WARPS):
            rg, sp = warp // splits, warp % splits
            n0 = (blk * groups_a_block + rg) * 16
            ra, rb = n0 + GRP, n0 + GRP + 8
            oka, okb, okx = ra < N, rb < N, GRP < M
            c = np.zeros((32, 4), F32)
            for kb in range(sp, kblocks, splits):   # the kernel's pairs, then the remainder
                k0 = kb * 64 + 16 * TQ                           # load_kblock
                span = k0[:, None] + np.arange(16)[None, :]      # [32, 16]: this lane's k
                inside = (k0[:, None] + 8 * (np.arange(16)[None, :] // 8)) < K   # per 16-byte chunk
                col = np.minimum(span, K - 1)

                def rows_of(mat, rows, ok):
                    return np.where(ok[:, None] & inside, mat[np.where(ok, rows, 0)[:, None], col], 0).astype(F32)
                a, bb, xv = rows_of(w, ra, oka), rows_of(w, rb, okb), rows_of(x, GRP, okx)
                for s in range(4):                               # mma_kblock; word i = values 2i, 2i + 1
                    afrag = np.stack([a[:, 4 * s:4 * s + 2], bb[:, 4 * s:4 * s + 2],
                                      a[:, 4 * s + 2:4 * s + 4], bb[:, 4 * s + 2:4 * s + 4]], 1)
                    bfrag = np.stack([xv[:, 4 * s:4 * s + 2], xv[:, 4 * s + 2:4 * s + 4]], 1)
                    c = MMA.run(c, afrag, bfrag)
            red[warp] = c
        for warp in range(K_WARPS):
            rg, sp = warp // splits, warp % splits
            if sp != 0:
                continue
            c = red[warp].copy()
            for s in range(1, splits):
                c += red[warp + s]
            n0 = (blk * groups_a_block + rg) * 16
            ra, rb = n0 + GRP, n0 + GRP + 8
            m0, m1 = 2 * TQ, 2 * TQ + 1
            for lane in range(32):
                for m, n, v in ((m0[lane], ra[lane], c[lane, 0]), (m1[lane], ra[lane], c[lane, 1]),
                                (m0[lane], rb[lane], c[lane, 2]), (m1[lane], rb[lane], c[lane, 3])):
                    if n < N and m < M:
                        assert np.isnan(out[m, n]), "a value written twice"
                        out[m, n] = v
    return out

