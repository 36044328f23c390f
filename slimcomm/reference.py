"""Pure-PyTorch (and NumPy) versions of every slimcomm op: the test oracle.

These functions define the semantics of :mod:`slimcomm.ops` executably and
have the same names and signatures. They are deliberately simple (full sorts,
materialised scores, Python loops over segments) and are never the fast path:
library code calls :mod:`slimcomm.ops`, tests compare the two.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

__all__ = [
    "local_adamw_step",
    "score_of",
    "significance_topk",
    "significance_topk_segmented",
    "philox4x32_10",
    "explore_keys",
    "explore_sample",
    "explore_sample_segmented",
    "pack",
    "unpack",
    "gather_slices",
    "scatter_slices",
    "gather_slices_multi",
    "scatter_slices_multi",
    "step_encode",
    "step_commit",
    "step_commit_local",
    "step_undo",
    "sgd_apply_indexed",
    "quantize_chunks",
    "dequantize_chunks_mean",
]

_MASK32 = np.uint64(0xFFFFFFFF)


def score_of(weight: torch.Tensor, grad: torch.Tensor, score: str = "product") -> torch.Tensor:
    """The fp32 significance score: ``|w|*|g|``, ``|g|`` or ``|w|``."""
    if score == "product":
        return weight.float().abs() * grad.float().abs()
    if score == "grad":
        return grad.float().abs()
    if score == "weight":
        return weight.float().abs()
    raise ValueError(f"score must be one of 'product', 'grad', 'weight', got {score!r}")


def significance_topk(weight, grad, k, score="product"):
    """Reference top-k: sort by (score descending, NaN above +inf, index ascending)."""
    s = score_of(weight, grad, score)
    # Non-negative fp32 values order like their int32 bit patterns; NaN goes on top.
    bits = s.view(torch.int32).to(torch.int64)
    bits = torch.where(torch.isnan(s), torch.full_like(bits, 0x7FFFFFFF), bits)
    idx = torch.arange(s.numel(), dtype=torch.int64)
    composite = bits * (1 << 32) + ((1 << 32) - 1 - idx)  # ties: lowest index ranks higher
    order = torch.sort(composite, descending=True).indices
    chosen = torch.sort(order[:k]).values
    return chosen, grad[chosen]


def significance_topk_segmented(weight, grad, offsets, ks, score="product"):
    """Reference segmented top-k: one :func:`significance_topk` per segment."""
    idx_parts, val_parts = [], []
    for s, k in enumerate(ks):
        lo, hi = offsets[s], offsets[s + 1]
        i, _ = significance_topk(weight[lo:hi], grad[lo:hi], k, score)
        idx_parts.append(i + lo)
        val_parts.append(grad[i + lo])
    if not idx_parts:
        return torch.empty(0, dtype=torch.int64), grad[:0].clone()
    return torch.cat(idx_parts), torch.cat(val_parts)


def philox4x32_10(counter: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """Philox4x32-10 (Salmon et al., SC'11) on ``counter`` ``[n, 4]`` uint32 words.

    Returns ``[n, 4]`` uint64 arrays holding the 32-bit output words.
    """
    m0, m1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    w0, w1 = 0x9E3779B9, 0xBB67AE85
    c = [counter[:, j].astype(np.uint64) for j in range(4)]
    k0, k1 = key[0] & 0xFFFFFFFF, key[1] & 0xFFFFFFFF
    for r in range(10):
        p0 = c[0] * m0
        p1 = c[2] * m1
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
        k0 = (k0 + w0) & 0xFFFFFFFF
        k1 = (k1 + w1) & 0xFFFFFFFF
    return np.stack(c, axis=1)


def explore_keys(n: int, seed: int, offset: int) -> np.ndarray:
    """The 64-bit Philox value of every explore draw ``j`` in ``[0, n)`` (uint64 array)."""
    seed &= (1 << 64) - 1
    offset &= (1 << 64) - 1
    pairs = np.arange((n + 1) // 2, dtype=np.uint64)
    ctr = np.stack(
        [
            pairs & _MASK32,
            pairs >> np.uint64(32),
            np.full_like(pairs, offset & 0xFFFFFFFF),
            np.full_like(pairs, offset >> 32),
        ],
        axis=1,
    )
    out = philox4x32_10(ctr, (seed & 0xFFFFFFFF, seed >> 32))
    even = (out[:, 0] << np.uint64(32)) | out[:, 1]
    odd = (out[:, 2] << np.uint64(32)) | out[:, 3]
    keys = np.empty(2 * len(pairs), dtype=np.uint64)
    keys[0::2] = even
    keys[1::2] = odd
    return keys[:n]


def _scale_draws(keys: np.ndarray, a: int) -> np.ndarray:
    """``floor(key * a / 2**64)`` for uint64 keys, exactly (uint64 array)."""
    if a < 2**32:  # (hi * a + (lo * a >> 32)) >> 32 never overflows 64 bits here
        hi, lo = keys >> np.uint64(32), keys & _MASK32
        return (hi * np.uint64(a) + ((lo * np.uint64(a)) >> np.uint64(32))) >> np.uint64(32)
    return np.array([(int(k) * a) >> 64 for k in keys], dtype=np.uint64)


def explore_sample(n, exclude, m, seed, offset):
    """Reference explore sample, straight from the definition in ``ops.explore_sample``.

    Draw ``j`` is the rank ``d_j = floor(key_j * a / 2**64)`` among the
    ``a = n - len(exclude)`` non-excluded indices; the first ``t`` distinct
    draws are kept (``t = m``, or ``a - m`` whose complement is returned when
    ``2m > a``) and the ranks mapped to indices.
    """
    ex = exclude.cpu().numpy().astype(np.int64)
    a = n - len(ex)
    if m == a:
        ranks = np.arange(a, dtype=np.int64)
    elif m == 0:
        ranks = np.zeros(0, dtype=np.int64)
    else:
        complement = 2 * m > a
        t = a - m if complement else m
        draws = 2 * t + 64
        while True:
            d = _scale_draws(explore_keys(draws, seed, offset), a)
            values, first = np.unique(d, return_index=True)
            if len(values) >= t:
                break
            draws *= 2
        kept = np.sort(d[np.sort(first)[:t]].astype(np.int64))
        ranks = np.setdiff1d(np.arange(a, dtype=np.int64), kept) if complement else kept
    # rank r -> index r + #{e : ex[e] - e <= r}
    index = ranks + np.searchsorted(ex - np.arange(len(ex)), ranks, side="right")
    return torch.from_numpy(index.astype(np.int64)).to(exclude.device)


def explore_sample_segmented(offsets, exclude, exclude_offsets, ms, seed, rng_offsets):
    """Reference segmented explore sample: one :func:`explore_sample` per segment."""
    parts = []
    for s, m in enumerate(ms):
        lo, hi = offsets[s], offsets[s + 1]
        ex = exclude[exclude_offsets[s]:exclude_offsets[s + 1]] - lo
        parts.append(explore_sample(hi - lo, ex, m, seed, rng_offsets[s]) + lo)
    if not parts:
        return exclude.new_empty(0)
    return torch.cat(parts)


def pack(src, indices):
    return src[indices]


def unpack(dst, indices, values, accumulate=False):
    if accumulate:
        dst[indices] = (dst[indices].float() + values.float()).to(dst.dtype)
    else:
        dst[indices] = values


def gather_slices(weight, rows: Optional[torch.Tensor], cols: Optional[torch.Tensor]):
    out = weight if rows is None else weight[rows]
    if cols is not None:
        out = out[:, cols]
    return out.contiguous().clone()


def scatter_slices(weight, rows, cols, block):
    r = torch.arange(weight.shape[0]) if rows is None else rows
    if weight.dim() == 1:
        weight[r] = block
        return
    c = torch.arange(weight.shape[1]) if cols is None else cols
    weight[r.unsqueeze(1), c.unsqueeze(0)] = block


def gather_slices_multi(weights: Sequence[torch.Tensor], rows, cols):
    return torch.cat([gather_slices(w, r, c).reshape(-1) for w, r, c in zip(weights, rows, cols)])


def scatter_slices_multi(weights, rows, cols, buffer):
    pos = 0
    for w, r, c in zip(weights, rows, cols):
        blk = gather_slices(w, r, c)
        n = blk.numel()
        scatter_slices(w, r, c, buffer[pos:pos + n].view(blk.shape))
        pos += n


# ---------------------------------------------------------------------------
# The fused Slim-DP step: the ATen sequence the compressor ran before the fusion
# ---------------------------------------------------------------------------

def _lengths(offsets):
    o = offsets.tolist() if torch.is_tensor(offsets) else list(offsets)
    return torch.tensor([b - a for a, b in zip(o[:-1], o[1:])], dtype=torch.int64)


def _seg_max_abs(x, offsets):
    lengths = _lengths(offsets).to(x.device)
    return torch.segment_reduce(x.abs(), "max", lengths=lengths, initial=0)


def _expand(per_segment, offsets, n):
    lengths = _lengths(offsets).to(per_segment.device)
    return torch.repeat_interleave(per_segment, lengths, output_size=n)


def _seg_of(indices, offsets):
    o = torch.as_tensor(offsets, dtype=torch.int64, device=indices.device)
    return torch.searchsorted(o, indices, right=True) - 1


def step_encode(buf, indices, offsets, world_size, wire_dtype, acc=None, residual=None,
                scale=None, error_decay=1.0, accumulate=True, clip=None):
    if acc is not None and accumulate:
        if scale is not None:
            torch.addcmul(buf, residual, scale, value=error_decay, out=acc)
        elif error_decay != 1.0:
            torch.add(buf, residual, alpha=error_decay, out=acc)
        else:
            torch.add(residual, buf, out=acc)
    src = acc if acc is not None else buf.float()
    m = _seg_max_abs(buf, offsets).float()
    flags = m.mul(0.0).add_(m != 0)
    vals = src[indices].div_(world_size)
    kept = None
    if clip is not None:
        sent = vals.clamp(-clip, clip)
        kept = vals.sub(sent).mul_(world_size)
        vals = sent
    wire = torch.cat([vals, flags]).to(wire_dtype)
    if acc is not None:
        acc[indices] = kept if kept is not None else torch.zeros_like(vals)
        if scale is not None:
            acc.div_(scale)
    return wire


def _decide(fl, fin, keep_all_zero):
    if keep_all_zero:
        keep = fl > 0
        good = keep.logical_and(fin)
        bad = torch.eq(good, fl == 0).sum()
    else:
        keep = fl == fl
        good = fin
        bad = fin.logical_not().sum()
    return keep, good, bad


def step_commit(buf, indices, offsets, avg, counter, G=None, acc=None, residual=None,
                scale=None, keep_all_zero=False, return_old_g=False, void_in=None, write_buf=True):
    if not write_buf:  # the same on a copy, thrown away
        return step_commit(buf.clone(), indices, offsets, avg, counter, G, acc, residual, scale,
                           keep_all_zero, return_old_g, void_in)
    k = indices.numel()
    n = buf.numel()
    vals, fl = avg[:k], avg[k:].float()
    buf.zero_()
    buf[indices] = vals.to(buf.dtype)
    fin = torch.isfinite(_seg_max_abs(buf, offsets).add(fl))
    keep, good, bad = _decide(fl, fin, keep_all_zero)
    fill = fl.mul(0.0).to(buf.dtype)
    torch.where(_expand(keep, offsets, n), buf, _expand(fill, offsets, n), out=buf)
    old_g = torch.empty(0, dtype=torch.float32, device=buf.device)
    if G is not None:
        g_vals = vals.float()
        if scale is not None:
            g_vals = g_vals / scale
        old = G[indices]
        G[indices] = torch.where(good[_seg_of(indices, offsets)], g_vals, old)
        if return_old_g:
            old_g = old
    if acc is not None:
        torch.where(_expand(good, offsets, n), acc, residual, out=acc)
    counter[:1].add_(bad)
    void = bad > 0
    if void_in is not None:
        void = void | void_in.reshape(())
    return old_g, void


def sgd_apply_indexed(params, indices, offsets, avg, lr, keep_all_zero=False):
    S = len(params)
    if S == 0:
        return
    k = indices.numel()
    dtype = params[0].dtype
    vals = avg[:k].to(dtype)
    fl = avg[k:].float()
    seg = _seg_of(indices, offsets)
    nonfinite = torch.zeros(S, dtype=torch.int64, device=indices.device)
    nonfinite.index_add_(0, seg, torch.isfinite(vals.float()).logical_not().long())
    _, good, _ = _decide(fl, nonfinite.eq(0).logical_and(torch.isfinite(fl)), keep_all_zero)
    o = [int(x) for x in offsets]
    neg_lr = torch.tensor(-lr, dtype=torch.float32).double()
    for s, p in enumerate(params):
        sel = seg.eq(s).logical_and(good[s])
        flat = p.permute(sorted(range(p.dim()), key=lambda d: (-p.stride(d), -p.size(d)))) \
            if p.dim() > 1 else p
        flat = flat.view(-1)  # memory order (a view: p is dense and non-overlapping)
        loc = indices[sel] - o[s]
        # fma(g, -lr, p) in fp32: the exact product and sum in fp64, rounded once to fp32
        new = flat[loc].double() + vals[sel].float().double() * neg_lr
        flat[loc] = new.float().to(dtype)


def step_commit_local(buf, all_indices, all_values, offsets, world_size, counter, acc=None,
                      residual=None, keep_all_zero=False, void_in=None):
    n = buf.numel()
    S = len(offsets) - 1
    k = all_indices.numel() // world_size
    vals = all_values.view(world_size, k + S)
    ids = all_indices.view(world_size, k)
    out = torch.zeros(n, dtype=torch.float32, device=buf.device)
    for r in range(world_size):
        out.index_put_((ids[r],), vals[r, :k].float(), accumulate=True)
    buf.copy_(out)
    fl = vals[:, k:].float().sum(0)
    fin = torch.isfinite(_seg_max_abs(buf, offsets).add(fl))
    keep, good, bad = _decide(fl, fin, keep_all_zero)
    fill = fl.mul(0.0).to(buf.dtype)
    torch.where(_expand(keep, offsets, n), buf, _expand(fill, offsets, n), out=buf)
    if acc is not None:
        torch.where(_expand(good, offsets, n), acc, residual, out=acc)
    counter[:1].add_(bad)
    void = bad > 0
    if void_in is not None:
        void = void | void_in.reshape(())
    return void


def step_undo(void_flag, residual=None, spare=None, G=None, indices=None, old_g=None,
              counter=None):
    v = void_flag.reshape(())
    if counter is not None:
        counter[1:2].add_(v)
    if residual is not None:
        torch.where(v, spare, residual, out=residual)
    if G is not None:
        G[indices] = torch.where(v, old_g, G[indices])


# ---------------------------------------------------------------------------
# The low-bit value codec: the ATen sequence of the compressor's codec before the
# fusion (slimcomm/codec.py up to 0.x), with the two orders it left open fixed:
# the bits-1 sums run in value order on the CPU (index_add_'s order there), and
# the rows of the mean are added one by one, in row order, from +0.
# ---------------------------------------------------------------------------

_TINY = 1e-30


def _chunk_of(seg_offsets, chunk, device):
    """(int64 [K] chunk index of every value, number of chunks) of a segment layout."""
    o = seg_offsets.tolist() if torch.is_tensor(seg_offsets) else list(seg_offsets)
    ids, base = [], 0
    for a, b in zip(o[:-1], o[1:]):
        if b > a:
            ids.append(torch.arange(b - a, device=device) // chunk + base)
            base += -(-(b - a) // chunk)
    chunk_of = torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64, device=device)
    return chunk_of, base


def _levels(codes, bits):
    c = codes.to(torch.float32)
    if bits == 1:
        return c.mul_(2.0).sub_(1.0)
    if bits == 2:
        return c.div_(1.5).sub_(1.0)
    L = 2 ** (bits - 1) - 1
    return c.sub_(L).div_(L)


def _pack_codes(codes, bits):
    per = 8 // bits
    pad = (-codes.numel()) % per
    c = torch.nn.functional.pad(codes, (0, pad)).view(-1, per).to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    return (c << shifts).sum(1).to(torch.uint8)


def _unpack_codes(packed, numel, bits):
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.flatten(-2)[..., :numel].to(torch.uint8)


def quantize_chunks(vals, seg_offsets, chunk, bits, nchunks):
    chunk_of, n = _chunk_of(seg_offsets, chunk, vals.device)
    if n != nchunks:
        raise ValueError(f"nchunks: the layout makes {n} chunks, got {nchunks}")
    a = vals.abs()
    if bits == 1:
        # fp32 sums in value order: index_add_ on the CPU adds sequentially
        sizes = torch.bincount(chunk_of, minlength=n).to(torch.float32)
        s = torch.zeros(n, dtype=torch.float32).index_add_(0, chunk_of.cpu(), a.cpu())
        s = s.to(vals.device).div_(sizes)
    else:
        s = torch.zeros(n, dtype=torch.float32, device=vals.device)
        s.scatter_reduce_(0, chunk_of, a, "amax", include_self=True)
    scales = s.to(torch.bfloat16)
    x = vals / scales.float().clamp_min(_TINY)[chunk_of]
    if bits == 1:
        codes = (x >= 0).to(torch.float32)
    else:
        if bits == 2:
            y, lo, hi, add = (x + 1.0) * 1.5, 0, 3, 0
        else:
            L = 2 ** (bits - 1) - 1
            y, lo, hi, add = x * L, -L, L, L
        y = torch.where(torch.isnan(y), torch.full_like(y, lo), y)  # NaN: the lowest code
        codes = torch.round(y).clamp_(lo, hi).add_(add)
    codes = codes.to(torch.uint8)
    own = _levels(codes, bits).mul_(scales.float()[chunk_of])
    return _pack_codes(codes, bits), scales, vals - own


def dequantize_chunks_mean(packed, scales, seg_offsets, chunk, bits, numel, divisor):
    chunk_of, n = _chunk_of(seg_offsets, chunk, packed.device)
    if n != scales.shape[1]:
        raise ValueError(f"scales: the layout makes {n} chunks, got {scales.shape[1]}")
    values = _levels(_unpack_codes(packed, numel, bits), bits).mul_(scales.float()[:, chunk_of])
    out = torch.zeros(numel, dtype=torch.float32, device=packed.device)
    for r in range(packed.shape[0]):
        out += values[r]
    return out.div_(divisor)


def local_adamw_step(param, grad, state, lr, betas, eps, weight_decay, world_size):
    """One :class:`slimcomm.optim.LocalAdamW` step of one tensor, in float64, written out
    formula by formula (the oracle of its ``_foreach`` implementation). ``state``: dict
    with ``step`` (int) and float64 ``m``, ``v``, ``u`` (updated in place); returns the new
    parameter (float64)."""
    b1, b2 = betas
    g = grad.double()
    state["step"] += 1
    t = state["step"]
    state["m"] = b1 * state["m"] + (1 - b1) * g
    state["v"] = b2 * state["v"] + (1 - b2) * g * g
    m_hat = state["m"] / (1 - b1 ** t)
    state["u"] = b2 * state["u"] + (1 - b2) * m_hat * m_hat
    v_hat = state["v"] / (1 - b2 ** t)
    u_hat = state["u"] / (1 - b2 ** t)
    if b1 > 0:
        c = (1 - b1) / (1 + b1)
        s2 = torch.clamp(v_hat - u_hat, min=0.0) / (1 - c)
        v_w = torch.maximum(v_hat - (1 - 1 / world_size) * s2, v_hat / world_size)
    else:  # no momentum: no estimate of the noise, AdamW's denominator
        v_w = v_hat
    p = param.double() * (1 - lr * weight_decay)
    return p - lr * m_hat / (torch.sqrt(v_w) + eps)
