"""Attention of a few new queries per row over a static KV cache, reading only each row's live keys.

Every attention of the serving path has this shape: the decoder step (T = 1) and DFlash2's
verify step (T = 8, causal within the block), the draft head's block pass (T = 8 over its context
cache, non-causal) and the action expert (T = 64 action tokens over the VLM cache, non-causal).
In each, the new tokens' K/V are first written into the cache at positions
[kv_len - T, kv_len) of their row, so the keys a row attends are one contiguous range
[0, kv_len[b]) (causal: query t stops at kv_len[b] - T + t).

On CUDA this is a split-K ("flash-decoding") Triton kernel: grid (rows x KV heads, key splits,
query tiles); each program loads the G*T queries of one KV head (grouped-query heads share their
K/V, read once), streams its split of live keys with an online softmax, and writes a partial
output and log-sum-exp; a second kernel merges the splits. Launches with about one program per
multiprocessor or more (rows x KV heads) do not split and write the output directly. Tiles of
more than 16 query rows (verify(8), the draft's block, the expert at 2-4 rows as one 128-row tile
per KV head) aim at one wave of programs, not two (`split_plan`); the expert's two 64-row tiles
per KV head (1 row, 5 rows and more) split where 3 programs a multiprocessor hold 4 splits or
more (`tiled_splits`). A row's splits divide its live keys (its key steps dealt evenly among them
in the kernel, from the row's length), not the cache capacity: a CUDA graph captured at the
capacity reads only live keys, and every split has work. The merge kernel takes one query of one
head a program.

Elsewhere (CPU, tests) `attend_reference` is the masked matmul over the same keys.

Shapes: B rows, T new tokens per row, Hq query heads, Hkv KV heads (G = Hq / Hkv), L cache
capacity, D head dim.
"""

from __future__ import annotations

import torch

from worker.model.fused_ops import available, launch_args

try:                                   # Triton ships with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl

    from worker.model.fused_ops import gdc_enter
except ImportError:                    # pragma: no cover - exercised only on Triton-less installs
    triton = None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention for few queries over a long cache, reading each K/V head once.

    q (B, Hq, T, D); k, v (B, Hkv, S, D); mask (B, 1, T, S) bool (True = attend).
    Query head h uses KV head h // (Hq / Hkv), as transformers' repeat_kv does. Scores and
    softmax in fp32.
    """
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, hkv, g * t, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * (d ** -0.5)       # (B, Hkv, G*T, S)
    m = mask.expand(b, 1, t, s)
    if g > 1:
        m = m[:, :, None].expand(b, 1, g, t, s).reshape(b, 1, g * t, s)
    probs = torch.softmax(scores.masked_fill(~m, float("-inf")), dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(b, hq, t, d)


def attend_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: torch.Tensor,
                     causal: bool) -> torch.Tensor:
    """The same function as `cache_attention`, as masked matmuls over the cache capacity.

    q (B, T, Hq, D); k_cache, v_cache (B, Hkv, L, D); kv_len (B,) -> (B, T, Hq, D) in q's dtype.
    """
    b, t, hq, d = q.shape
    cap = k_cache.shape[2]
    limit = kv_len[:, None].expand(b, t)
    if causal:
        limit = limit - (t - 1) + torch.arange(t, device=q.device)
    visible = torch.arange(cap, device=q.device)[None, None, :] < limit[:, :, None]     # (B, T, L)
    out = attend(q.transpose(1, 2), k_cache, v_cache, visible[:, None])
    return out.transpose(1, 2).to(q.dtype)


if triton is not None:
    @triton.jit
    def _split_steps(kv_len, split, splits, BLOCK_N: tl.constexpr):
        """The BLOCK_N-key steps [first, last) of split `split` (any int tensor) of `splits`: a row's
        ceil(kv_len / BLOCK_N) steps dealt evenly, so that every split has one or more where the row
        has as many steps as there are splits."""
        steps = tl.cdiv(kv_len, BLOCK_N)
        return split * steps // splits, (split + 1) * steps // splits

    @triton.jit
    def _split_kernel(Q, K, V, KVLEN, OPART, LPART, OUT,
                      sq_b, sq_t, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l,
                      so_b, so_h, so_t, so_s, sl_b, sl_h, sl_t, sout_b, sout_t, sout_h,
                      qk_scale,
                      T: tl.constexpr, G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                      DIRECT: tl.constexpr, GDC: tl.constexpr):
        gdc_enter(GDC)
        pid_bh = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_m = tl.program_id(2)
        b = pid_bh // HKV
        hkv = pid_bh % HKV
        kv_len = tl.load(KVLEN + b).to(tl.int32)
        first, last = _split_steps(kv_len, pid_s, tl.num_programs(1), BLOCK_N)
        start = first * BLOCK_N
        end = tl.minimum(last * BLOCK_N, kv_len)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)          # query row m = g * T + t
        m_valid = offs_m < G * T
        g = offs_m // T
        t = offs_m % T
        hq = hkv * G + g
        offs_d = tl.arange(0, D)
        q = tl.load(Q + b * sq_b + t[:, None] * sq_t + hq[:, None] * sq_h + offs_d[None, :],
                    mask=m_valid[:, None] & (offs_d[None, :] < D), other=0.0)
        if CAUSAL:
            limit = kv_len - (T - 1) + t
        else:
            limit = kv_len + t * 0

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        k_base = K + b * sk_b + hkv * sk_h
        v_base = V + b * sv_b + hkv * sv_h
        for i in range(0, last - first):          # counted from 0: a 32-bit loop (from `start` to
            offs_n = start + i * BLOCK_N + tl.arange(0, BLOCK_N)    # `end` it compiled to 64-bit compares)
            n_valid = offs_n < end
            k = tl.load(k_base + offs_n[:, None] * sk_l + offs_d[None, :], mask=n_valid[:, None] & (offs_d[None, :] < D), other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(offs_n[None, :] < limit[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * sv_l + offs_d[None, :], mask=n_valid[:, None] & (offs_d[None, :] < D), other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        if DIRECT:                           # one split: the final output, no merge
            tl.store(OUT + b * sout_b + t[:, None] * sout_t + hq[:, None] * sout_h + offs_d[None, :],
                     out.to(OUT.dtype.element_ty), mask=m_valid[:, None] & (offs_d[None, :] < D))
        else:
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            live = m_valid & ((offs_m * 0 + first) < last)
            tl.store(OPART + b * so_b + hq[:, None] * so_h + t[:, None] * so_t + pid_s * so_s + offs_d[None, :],
                     out, mask=live[:, None] & (offs_d[None, :] < D))
            tl.store(LPART + b * sl_b + hq * sl_h + t * sl_t + pid_s, lse, mask=live)

    @triton.jit
    def _merge_kernel(OPART, LPART, KVLEN, OUT,
                      so_b, so_h, so_t, so_s, sl_b, sl_h, sl_t, sout_b, sout_t, sout_h,
                      SPLITS, HQ: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, S_MAX: tl.constexpr,
                      GDC: tl.constexpr):
        gdc_enter(GDC)
        pid = tl.program_id(0)                   # (b, hq); one query t per program: its splits' loads
        hq = pid % HQ                            # are all a program waits for (8 queries in turn took
        b = pid // HQ                            # 6.2 us against 2.5, verify(8) at batch 1, H200)
        t = tl.program_id(1)
        kv_len = tl.load(KVLEN + b).to(tl.int32)
        offs_s = tl.arange(0, S_MAX)
        first, last = _split_steps(kv_len, offs_s, SPLITS, BLOCK_N)
        s_valid = (offs_s < SPLITS) & (first < last)
        offs_d = tl.arange(0, D)
        lse = tl.load(LPART + b * sl_b + hq * sl_h + t * sl_t + offs_s, mask=s_valid, other=float("-inf"))
        m = tl.max(lse, 0)
        w = tl.where(s_valid, tl.exp2(lse - m), 0.0)
        o = tl.load(OPART + b * so_b + hq * so_h + t * so_t + offs_s[:, None] * so_s + offs_d[None, :],
                    mask=s_valid[:, None] & (offs_d[None, :] < D), other=0.0)
        out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(OUT + b * sout_b + t * sout_t + hq * sout_h + offs_d, out.to(OUT.dtype.element_ty))


_SMS = 132                      # an H100/H200's multiprocessors
# keys per step where the queries of a KV head span several tiles (the expert: 8 rows, 64 tokens,
# 2 heads per KV head), 2-byte K/V, unsplit: 57.9 against 62.2 us with 64 keys (H200, 2026-12-01;
# the expert loop 98.4-98.8 against 100.1-111.9 ms)
TILED_BLOCK_N = 128
# the expert's tiles (several query tiles per KV head) split their keys 8 or 4 ways where programs
# x splits stay within TILED_WAVES per multiprocessor (they co-reside), else not at all. H200,
# 2026-12-02, 4,751 live keys of 8,192, 64 keys a step, us unsplit / 4 / 8 splits: 1 row 58.9 /
# 32.1 / 21.3, 2 rows 60.0 / 35.5 / 30.5, 3 rows 59.9 / 50.7 / 35.9, 4 rows 60.5 / 54.7 / 57.2; 8 rows
# 69.2 unsplit against 120.4 with 2 splits
TILED_SPLIT_CHOICES = (8, 4)
# rows x KV heads at which the expert's 128 queries of a KV head run as one 128-row tile split for
# one wave (`split_plan`'s wide tiles: 8, 5 and 4 splits at 2, 3 and 4 rows of 8 KV heads). H200,
# 2026-12-04, 4,631 live keys, us, two 64-row tiles as planned before / one tile: 2 rows 25.6 /
# 25.2, 3 rows 45.2 / 34.2 (4,864 columns; at 8,192 35.8 / 33.9), 4 rows 43.9 / 42.5; 1 row (16
# splits) 18.2 / 19.7 and 8 rows (2 splits) 66.4 / 78.7 keep two tiles
ONE_TILE_PROGRAMS = (16, 32)
TILED_WAVES = 3
_MAX_SPLITS = 64


WIDE_SPLIT_KEYS = 256           # fewest keys per split for tiles of more than 16 query rows (verify(8), the
                                # draft's block, the expert), which aim at one wave, not two: their fp32
                                # partials are 8x a decode tile's. Verify(8) at batch 1, 4,864 columns,
                                # H200 2026-12-02, us (merge one query a program): 4 splits 20.3, 8 14.2,
                                # 16 12.0 (and 24.2 as shipped before: 4 splits, 8 queries a merge program);
                                # batch 4: 4 splits 31.3, 8 32.8, 16 37.0


def pipeline_stages(block_m: int, block_n: int, direct: bool, itemsize: int) -> int:
    """K/V tiles in flight per program: 4 where one split reads a row's keys whole in 64-key steps
    (decode and verify from about a program per multiprocessor up), 3 for split tiles of 64 query
    rows (the expert's, verify(8) at batches 1-8) and the expert's unsplit 128-key steps (4 stages of those
    would need 256 KB of shared memory, more than a multiprocessor has), else 2. H200, 2026-12-04, 4,631 live keys of 4,864, K/V
    cycled past the L2 cache (`kernel_check --sweep`), us, 3 against 4 stages: verify(8) at batch
    16 78.4 / 74.7, decode at batch 16 75.5 / 72.2; batch 1-4 split tiles within 0.6 either way."""
    if itemsize != 2:
        return 2
    if direct:
        return 4 if block_n <= 64 else 3
    return 3 if block_m >= 64 else 2


def tiled_splits(programs: int) -> int:
    """Key splits for `programs` multi-tile programs (the expert's): the most of TILED_SPLIT_CHOICES
    that keeps programs x splits within TILED_WAVES x the multiprocessors, else 1."""
    return next((s for s in TILED_SPLIT_CHOICES if programs * s <= TILED_WAVES * _SMS), 1)


def split_plan(rows: int, kv_heads: int, m_tiles: int, capacity: int, block_n: int,
               query_rows: int = 1) -> int:
    """-> the number of key splits for a launch over `capacity` cache columns (each row's live
    keys are divided among them in the kernel).

    About one program per multiprocessor or more without splitting: one split, no merge kernel.
    Fewer programs than that: split the keys so that about 2 waves of programs run (a power of two
    of splits: decode at batch 1, 32 splits 11.9 us against 33 12.3, H200 2026-12-04), or one wave
    of splits of at least WIDE_SPLIT_KEYS keys (at full capacity) where a tile holds more than 16
    query rows. Several query tiles per KV head (the expert): `tiled_splits`."""
    programs = rows * kv_heads * m_tiles
    if m_tiles >= 2:
        want = tiled_splits(programs)
    elif programs >= _SMS - 8:
        want = 1
    elif query_rows > 16:                # wide tiles: one wave of programs
        want = min(_SMS // programs, max(1, capacity // WIDE_SPLIT_KEYS))
    else:                                # about two waves, a power of two (the merge's S_MAX is one)
        want = 1 << max(0, (2 * _SMS // programs).bit_length() - 1)
    return max(1, min(want, _MAX_SPLITS, -(-capacity // block_n)))


def cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: torch.Tensor,
                    causal: bool, out: torch.Tensor | None = None, *, block_n: int | None = None,
                    num_stages: int | None = None, splits: int | None = None,
                    block_m: int | None = None, warps: int | None = None) -> torch.Tensor:
    """softmax(q K^T / sqrt(D)) V over keys [0, kv_len[b]) of each row (causal: query t of T stops
    at kv_len[b] - T + t), grouped-query heads reading their KV head once.

    q (B, T, Hq, D) (any strides with D contiguous); k_cache, v_cache (>= B, Hkv, L, D) with D
    contiguous; kv_len (B,) integer -> (B, T, Hq, D) in q's dtype (or written into `out`).
    Triton kernel where `fused_ops.available` (a GPU, or Triton's interpreter); `attend_reference`
    otherwise. block_n, num_stages, splits, block_m (query rows per tile) and warps override the
    launch configuration (the kernel check's sweep).
    """
    if not available(q):
        res = attend_reference(q, k_cache[:q.shape[0]], v_cache[:q.shape[0]], kv_len, causal)
        return res if out is None else out.copy_(res)
    b, t, hq, d = q.shape
    hkv, cap = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    rows_m = g * t
    # the G*T queries of a KV head in tiles of up to 64 rows (the expert's 128: two tiles, faster
    # than one at batch 1 and from 8 rows), or one 128-row tile where 4-8 splits of it fill one wave
    if block_m is None:
        block_m = 16 if rows_m <= 16 else 32 if rows_m <= 32 else 64
        if rows_m > 64 and q.element_size() == 2 and ONE_TILE_PROGRAMS[0] <= b * hkv <= ONE_TILE_PROGRAMS[1]:
            block_m = 128
    m_tiles = -(-rows_m // block_m)
    if block_n is None:                               # split tiles step 64 keys (faster split, measured)
        tiled = m_tiles >= 2 and q.element_size() == 2 and tiled_splits(b * hkv * m_tiles) == 1
        block_n = TILED_BLOCK_N if tiled else 64
    if splits is None:
        splits = split_plan(b, hkv, m_tiles, cap, block_n, min(rows_m, block_m))
    if out is None:
        out = torch.empty(b, t, hq, d, dtype=q.dtype, device=q.device)
    direct = splits == 1
    if direct:                                        # no partials: the kernel writes `out` itself
        opart, lpart = out.new_empty(1, 1, 1, 1, 1, dtype=torch.float32), out.new_empty(1, 1, 1, 1, dtype=torch.float32)
    else:
        opart = torch.empty(b, hq, t, splits, d, dtype=torch.float32, device=q.device)
        lpart = torch.empty(b, hq, t, splits, dtype=torch.float32, device=q.device)
    assert q.stride(3) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and out.stride(3) == 1
    qk_scale = d ** -0.5 * 1.4426950408889634        # log2(e): the kernel works in base 2
    _split_kernel[(b * hkv, splits, m_tiles)](
        q, k_cache, v_cache, kv_len, opart, lpart, out,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        opart.stride(0), opart.stride(1), opart.stride(2), opart.stride(3),
        lpart.stride(0), lpart.stride(1), lpart.stride(2), out.stride(0), out.stride(1), out.stride(2), qk_scale,
        T=t, G=g, HKV=hkv, D=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, DIRECT=direct,
        num_warps=warps or (8 if block_m == 128 else 4),
        num_stages=num_stages or pipeline_stages(block_m, block_n, direct, q.element_size()), **launch_args(q))
    if direct:
        return out
    _merge_kernel[(b * hq, t)](
        opart, lpart, kv_len, out,
        opart.stride(0), opart.stride(1), opart.stride(2), opart.stride(3),
        lpart.stride(0), lpart.stride(1), lpart.stride(2), out.stride(0), out.stride(1), out.stride(2),
        splits, HQ=hq, D=d, BLOCK_N=block_n, S_MAX=max(16, triton.next_power_of_2(splits)), num_warps=4,
        **launch_args(q))
    return out
