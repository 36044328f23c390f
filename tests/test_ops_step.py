"""The fused Slim-DP step ops (step_encode, step_commit, step_commit_local, step_undo)
against slimcomm.reference (the ATen sequence the compressor ran before the fusion):
every buffer / wire dtype, empty and dense segments, NaN/inf segments, both commit
policies, loss scale, error decay, fp16 saturation; argument errors; opcheck;
hypothesis property tests."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from slimcomm import ops, reference as ref

from _ops_cases import DTYPES, assert_equal_nan

OPS = torch.ops.slimcomm


def _same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    if a.is_floating_point():
        assert_equal_nan(a, b, what)
    else:
        assert torch.equal(a, b), (what, a, b)
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _layout(numels, rng, frac=0.3):
    offsets = np.concatenate([[0], np.cumsum(numels)]).astype(np.int64)
    idx = []
    for s, n in enumerate(numels):
        k = min(n, int(np.ceil(frac * n))) if n else 0
        if k:
            idx.append(offsets[s] + rng.choice(n, size=k, replace=False))
    idx = np.concatenate(idx).astype(np.int64) if idx else np.zeros(0, np.int64)
    rng.shuffle(idx)
    return torch.from_numpy(offsets.copy()), torch.from_numpy(idx)


def _values(n, dtype, rng, pattern="random", offsets=None):
    x = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 3)
    if pattern == "zeros_seg" and offsets is not None and len(offsets) > 2:
        x[offsets[1]:offsets[2]] = 0
    if pattern == "nonfinite" and n:
        x[rng.integers(0, n)] = float("nan")
        x[rng.integers(0, n)] = float("inf")
    if pattern == "big":
        x = x * 3e4
    return x.to(dtype)


def _encode_both(buf, idx, offsets, ws, wire, with_acc, scale, decay, accumulate, clip, rng):
    n = buf.numel()
    res = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    args = {}
    out = []
    for impl in (ops.step_encode, ref.step_encode):
        acc = None
        residual = None
        if with_acc:
            acc = torch.full((n,), 7.0) if accumulate else res.clone() * 0.5
            residual = res.clone() if accumulate else None
        w = impl(buf.clone(), idx, offsets, ws, wire, acc=acc, residual=residual, scale=scale,
                 error_decay=decay, accumulate=accumulate, clip=clip)
        out.append((w, acc))
    return out


CASES = list(itertools.product(DTYPES, DTYPES, [True, False], [None, 0.5], [1.0, 0.9],
                               [True, False], [None, 4096.0]))


@pytest.mark.parametrize("bdt,wdt,with_acc,scale,decay,accumulate,clip", CASES)
@pytest.mark.parametrize("pattern", ["random", "zeros_seg", "nonfinite", "big"])
def test_step_encode_matches_reference(bdt, wdt, with_acc, scale, decay, accumulate, clip,
                                       pattern):
    rng = np.random.default_rng(abs(hash((str(bdt), str(wdt), pattern))) % 2**32)
    numels = [0, 5, 1, 40, 17, 0, 300]
    offsets, idx = _layout(numels, rng)
    buf = _values(int(offsets[-1]), bdt, rng, pattern, offsets)
    sc = None if scale is None else torch.tensor([scale])
    (w1, a1), (w2, a2) = _encode_both(buf, idx, offsets, 3, wdt, with_acc, sc, decay,
                                      accumulate, clip, rng)
    _same(w1, w2, "wire")
    if with_acc:
        _same(a1, a2, "acc")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bdt", DTYPES)
@pytest.mark.parametrize("pattern", ["random", "zeros_seg", "nonfinite_late", "inf_only"])
@pytest.mark.parametrize("numels", [
    [70_000, 3, 150_000, 0, 40_000],      # several 32K-element chunks per segment
    [700_001, 3, 450_002, 0, 40_000],     # >= 2**20 elements: the accumulator is streamed
], ids=["chunks", "streamed"])
def test_step_encode_flags_across_chunks(bdt, pattern, threads, numels):
    """The fused accumulate + flags pass splits the buffer into parallel chunks at
    segment boundaries; a segment spanning several chunks must combine their flags
    (NaN from any chunk, nonzero from any chunk) exactly like the reference. Large
    buffers write the accumulator with streaming stores, from unaligned segment starts."""
    rng = np.random.default_rng(5)
    offsets, idx = _layout(numels, rng, frac=0.02)
    n = int(offsets[-1])
    buf = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    o = offsets.tolist()
    if pattern == "zeros_seg":
        buf[o[2]:o[3]] = 0
    elif pattern == "nonfinite_late":  # only in the last chunk of the long segment
        buf[o[3] - 5] = float("nan")
        buf[o[1] - 1] = float("-inf")
    elif pattern == "inf_only":
        buf[o[2]:o[3]] = 0
        buf[o[2] + 100_000] = float("inf")
    assert (n >= 2**20) == (numels[0] > 100_000)
    buf = buf.to(bdt)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        (w1, a1), (w2, a2) = _encode_both(buf, idx, offsets, 4, torch.float32, True, None, 1.0,
                                          True, None, rng)
    finally:
        torch.set_num_threads(before)
    _same(w1, w2, "wire")
    _same(a1, a2, "acc")
    flags = w1[-len(numels):]
    if pattern == "zeros_seg":
        assert flags[2] == 0 and flags[0] == 1
    if pattern in ("nonfinite_late", "inf_only"):
        assert torch.isnan(flags[2]) and (pattern == "inf_only" or torch.isnan(flags[0]))


def _runs_layout(numels, rng, runs):
    """Index sets as the compressor builds them: a core set ascending over the buffer, then
    an explore set ascending (``runs=2``); ``runs=1``: the core set alone; ``runs=3``: the
    explore set split in two, so not two ascending runs (the general path)."""
    offsets = np.concatenate([[0], np.cumsum(numels)]).astype(np.int64)
    core, explore = [], []
    for s, n in enumerate(numels):
        if not n:
            continue
        pick = offsets[s] + rng.choice(n, size=max(1, n // 30), replace=False)
        core.append(np.sort(pick[: len(pick) // 2]))
        explore.append(np.sort(pick[len(pick) // 2:]))
    core, explore = np.concatenate(core), np.concatenate(explore)
    parts = {1: [core], 2: [core, explore],
             3: [core, explore[len(explore) // 2:], explore[: len(explore) // 2]]}[runs]
    return torch.from_numpy(offsets), torch.from_numpy(np.concatenate(parts).astype(np.int64))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bdt,wdt", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
                                     (torch.float16, torch.float32)])
@pytest.mark.parametrize("clip", [None, 2.0])
@pytest.mark.parametrize("runs", [1, 2, 3])
def test_step_encode_streamed_index_runs(threads, bdt, wdt, clip, runs):
    """Streamed buffers whose index set is one or two ascending runs (core set, then explore
    set) pack the payload block by block inside the accumulate pass; any other order takes
    the gather after it. Both equal the reference bit for bit, the fp16 saturation included
    (clip 2.0 clips a good part of the values)."""
    rng = np.random.default_rng(11 + runs)
    offsets, idx = _runs_layout([700_001, 3, 450_002, 0, 40_000], rng, runs)
    n = int(offsets[-1])
    buf = _values(n, bdt, rng)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        (w1, a1), (w2, a2) = _encode_both(buf, idx, offsets, 4, wdt, True, None, 1.0, True,
                                          clip, rng)
    finally:
        torch.set_num_threads(before)
    _same(w1, w2, "wire")
    _same(a1, a2, "acc")
    assert bool((a1[idx] != 0).any()) == (clip is not None)  # clipped parts stay in the residual


def _commit_case(bdt, wdt, pattern, rng, numels=(0, 5, 1, 40, 17, 0, 300)):
    offsets, idx = _layout(list(numels), rng)
    n, k, S = int(offsets[-1]), idx.numel(), len(numels)
    vals = torch.from_numpy(rng.standard_normal(k).astype(np.float32))
    flags = torch.from_numpy(rng.integers(0, 3, S).astype(np.float32))
    if pattern == "nonfinite":
        flags[1] = float("nan")
        if k:
            vals[rng.integers(0, k)] = float("inf")
    if pattern == "overflow":  # finite on the wire, inf in a fp16 buffer
        vals = vals * 1e5
    avg = torch.cat([vals, flags]).to(wdt)
    return offsets, idx, avg, n


@pytest.mark.parametrize("bdt,wdt", list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("pattern", ["random", "nonfinite", "overflow"])
@pytest.mark.parametrize("keep_all_zero", [False, True])
@pytest.mark.parametrize("full", [True, False])
def test_step_commit_matches_reference(bdt, wdt, pattern, keep_all_zero, full):
    rng = np.random.default_rng(abs(hash((str(bdt), str(wdt), pattern))) % 2**32)
    offsets, idx, avg, n = _commit_case(bdt, wdt, pattern, rng)
    buf0 = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(bdt)
    G0 = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    acc0 = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    res0 = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    void_in = torch.tensor(False) if full else None
    outs = []
    for impl in (ops.step_commit, ref.step_commit):
        buf, G, acc, cnt = buf0.clone(), G0.clone(), acc0.clone(), torch.zeros(2, dtype=torch.int64)
        kw = dict(G=G, acc=acc, residual=res0, scale=torch.tensor([2.0]), return_old_g=True) \
            if full else {}
        old, void = impl(buf, idx, offsets, avg, cnt, keep_all_zero=keep_all_zero,
                         void_in=void_in, **kw)
        outs.append((buf, G, acc, cnt, old, void))
    for name, a, b in zip(("buf", "G", "acc", "counter", "old_g", "void"), *outs):
        _same(a, b, name)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bdt,wdt", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                     (torch.float16, torch.float16)])
@pytest.mark.parametrize("keep_all_zero", [False, True])
@pytest.mark.parametrize("runs", [1, 2, 3])
def test_step_commit_streamed_index_runs(threads, bdt, wdt, keep_all_zero, runs):
    """Streamed buffers whose index set is one or two ascending runs build each block of a
    kept segment (zeros, then its values) in L1; any other order scatters into a zero fill.
    Both equal the reference bit for bit, with segments that are kept, flagged NaN (filled)
    and exactly zero (kept or filled under keep_all_zero), and a non-finite value."""
    rng = np.random.default_rng(23 + runs)
    numels = [700_001, 3, 450_002, 0, 40_000]
    offsets, idx = _runs_layout(numels, rng, runs)
    n, k, S = int(offsets[-1]), idx.numel(), len(numels)
    vals = torch.from_numpy(rng.standard_normal(k).astype(np.float32))
    flags = torch.tensor([2.0, float("nan"), 1.0, 0.0, 0.0])
    seg = torch.searchsorted(offsets, idx, right=True) - 1
    vals[(seg == 4).nonzero()[0, 0]] = float("inf")  # segment 4 not good
    avg = torch.cat([vals, flags]).to(wdt)
    buf0 = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(bdt)
    G0, acc0, res0 = (torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for _ in range(3))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    outs = []
    try:
        for impl in (ops.step_commit, ref.step_commit):
            buf, G, acc, cnt = buf0.clone(), G0.clone(), acc0.clone(), torch.zeros(2, dtype=torch.int64)
            old, void = impl(buf, idx, offsets, avg, cnt, G=G, acc=acc, residual=res0,
                             keep_all_zero=keep_all_zero, return_old_g=True)
            outs.append((buf, G, acc, cnt, old, void))
    finally:
        torch.set_num_threads(before)
    for name, a, b in zip(("buf", "G", "acc", "counter", "old_g", "void"), *outs):
        _same(a, b, name)
    assert outs[0][0][idx[seg == 0]].ne(0).any() and outs[0][0][offsets[2]:offsets[3]].eq(0).any()


@pytest.mark.parametrize("bdt,wdt", list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("pattern", ["random", "nonfinite", "overflow"])
@pytest.mark.parametrize("keep_all_zero", [False, True])
@pytest.mark.parametrize("ws", [1, 3])
def test_step_commit_local_matches_reference(bdt, wdt, pattern, keep_all_zero, ws):
    rng = np.random.default_rng(abs(hash((str(bdt), str(wdt), pattern, ws))) % 2**32)
    numels = [0, 5, 1, 40, 17, 0, 300]
    ids, vals = [], []
    for r in range(ws):
        offsets, idx, avg, n = _commit_case(bdt, wdt, pattern, rng, numels)
        ids.append(idx)
        vals.append(avg)
    all_idx, all_val = torch.cat(ids), torch.cat(vals)
    acc0 = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    res0 = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    outs = []
    for impl in (ops.step_commit_local, ref.step_commit_local):
        buf, acc, cnt = torch.full((n,), 5.0).to(bdt), acc0.clone(), torch.zeros(2, dtype=torch.int64)
        void = impl(buf, all_idx, all_val, offsets, ws, cnt, acc=acc, residual=res0,
                    keep_all_zero=keep_all_zero, void_in=torch.tensor(True) if ws == 3 else None)
        outs.append((buf, acc, cnt, void))
    for name, a, b in zip(("buf", "acc", "counter", "void"), *outs):
        _same(a, b, name)


@pytest.mark.parametrize("void", [False, True])
@pytest.mark.parametrize("with_counter", [False, True])
def test_step_undo_matches_reference(void, with_counter):
    rng = np.random.default_rng(1)
    n = 50
    idx = torch.from_numpy(rng.choice(n, 9, replace=False).astype(np.int64))
    r0, s0, g0 = (torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for _ in range(3))
    old = torch.from_numpy(rng.standard_normal(9).astype(np.float32))
    outs = []
    for impl in (ops.step_undo, ref.step_undo):
        r, g = r0.clone(), g0.clone()
        c = torch.zeros(2, dtype=torch.int64) if with_counter else None
        impl(torch.tensor(void), residual=r, spare=s0, G=g, indices=idx, old_g=old, counter=c)
        outs.append((r, g, c))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    if with_counter:
        assert torch.equal(outs[0][2], outs[1][2])
    ops.step_undo(torch.tensor(True), counter=torch.zeros(2, dtype=torch.int64))  # count only


def test_step_ops_empty_group():
    off = torch.zeros(1, dtype=torch.int64)
    e = torch.empty(0)
    i = torch.empty(0, dtype=torch.int64)
    w = ops.step_encode(e, i, off, 2, torch.float16, acc=torch.empty(0), residual=torch.empty(0))
    assert w.shape == (0,) and w.dtype == torch.float16
    old, void = ops.step_commit(e, i, off, torch.empty(0), torch.zeros(2, dtype=torch.int64))
    assert old.shape == (0,) and not bool(void)


def _enc_args():
    buf = torch.randn(10)
    return dict(buf=buf, indices=torch.tensor([1, 7]), offsets=torch.tensor([0, 4, 10]),
                world_size=2, wire_dtype=torch.float32)


@pytest.mark.parametrize("change,arg", [
    (dict(world_size=0), "world_size"),
    (dict(wire_dtype=torch.float64), "wire_dtype"),
    (dict(indices=torch.tensor([1, 10])), "indices"),
    (dict(indices=torch.tensor([1.0])), "indices"),
    (dict(offsets=torch.tensor([0, 4, 9])), "offsets"),
    (dict(offsets=torch.tensor([0, 5, 4, 10])), "offsets"),
    (dict(acc=torch.zeros(10)), "residual"),
    (dict(acc=torch.zeros(9), residual=torch.zeros(10)), "acc"),
    (dict(acc=torch.zeros(10, dtype=torch.float16), residual=torch.zeros(10)), "acc"),
    (dict(residual=torch.zeros(10)), "residual"),
    (dict(clip=0.0), "clip"),
    (dict(scale=torch.tensor([1.0, 2.0])), "scale"),
    (dict(buf=torch.randn(10, dtype=torch.float64)), "buf"),
])
def test_step_encode_errors_name_the_argument(change, arg):
    kw = {**_enc_args(), **change}
    with pytest.raises(RuntimeError, match=f"argument '{arg}'"):
        ops.step_encode(**kw)


@pytest.mark.parametrize("change,arg", [
    (dict(avg=torch.zeros(3)), "avg"),
    (dict(counter=torch.zeros(1, dtype=torch.int64)), "counter"),
    (dict(counter=torch.zeros(2)), "counter"),
    (dict(acc=torch.zeros(10)), "residual"),
    (dict(return_old_g=True), "G"),
    (dict(G=torch.zeros(4)), "G"),
    (dict(void_in=torch.tensor(1.0)), "void_in"),
    (dict(indices=torch.tensor([1, 11])), "indices"),
])
def test_step_commit_errors_name_the_argument(change, arg):
    kw = dict(buf=torch.randn(10), indices=torch.tensor([1, 7]), offsets=torch.tensor([0, 4, 10]),
              avg=torch.zeros(4), counter=torch.zeros(2, dtype=torch.int64))
    kw.update(change)
    with pytest.raises(RuntimeError, match=f"argument '{arg}'"):
        ops.step_commit(**kw)


def test_step_commit_local_and_undo_errors_name_the_argument():
    base = dict(buf=torch.randn(10), all_indices=torch.tensor([1, 7, 2]),
                all_values=torch.zeros(6), offsets=torch.tensor([0, 4, 10]), world_size=2,
                counter=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="argument 'all_indices'"):
        ops.step_commit_local(**base)
    with pytest.raises(RuntimeError, match="argument 'all_values'"):
        ops.step_commit_local(**{**base, "all_indices": torch.tensor([1, 7]), "all_values": torch.zeros(5)})
    with pytest.raises(RuntimeError, match="argument 'spare'"):
        ops.step_undo(torch.tensor(True), residual=torch.zeros(3))
    with pytest.raises(RuntimeError, match="argument 'void'"):
        ops.step_undo(torch.tensor(1.0))


def test_step_ops_opcheck():
    buf = torch.randn(20)
    off = torch.tensor([0, 5, 5, 20])
    idx = torch.tensor([3, 0, 12, 19])
    torch.library.opcheck(OPS.step_encode, (buf, idx, off, 2, torch.bfloat16, torch.zeros(20),
                                            torch.randn(20), None, 1.0, True, None))
    avg = torch.randn(7)
    torch.library.opcheck(OPS.step_commit, (buf.clone(), idx, off, avg,
                                            torch.zeros(2, dtype=torch.int64), torch.zeros(20),
                                            torch.zeros(20), torch.randn(20), None, True, True,
                                            None))
    torch.library.opcheck(OPS.step_commit_local, (buf.clone(), torch.cat([idx, idx]),
                                                  torch.cat([avg, avg]), off, 2,
                                                  torch.zeros(2, dtype=torch.int64), None, None,
                                                  False, None))
    torch.library.opcheck(OPS.step_undo, (torch.tensor(True), torch.zeros(20), torch.randn(20),
                                          torch.zeros(20), idx, torch.randn(4),
                                          torch.zeros(2, dtype=torch.int64)))


@st.composite
def groups(draw):
    S = draw(st.integers(1, 6))
    numels = [draw(st.integers(0, 60)) for _ in range(S)]
    seed = draw(st.integers(0, 2**31))
    return numels, seed


@SETTINGS
@given(groups(), st.sampled_from(DTYPES), st.sampled_from(DTYPES), st.booleans(),
       st.booleans(), st.sampled_from(["random", "zeros_seg", "nonfinite", "big"]))
def test_step_encode_commit_round_trip_property(case, bdt, wdt, keep_all_zero, clip, pattern):
    """encode, sum of one rank (world size 1 with clip: the saturated values), commit:
    the kernels equal the reference in every output, whatever the group."""
    numels, seed = case
    rng = np.random.default_rng(seed)
    offsets, idx = _layout(numels, rng, frac=rng.uniform(0, 1))
    n = int(offsets[-1])
    buf = _values(n, bdt, rng, pattern, offsets)
    res = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    G0 = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    outs = []
    for impl_e, impl_c in ((ops.step_encode, ops.step_commit),
                           (ref.step_encode, ref.step_commit)):
        acc, b, G = torch.empty(n), buf.clone(), G0.clone()
        cnt = torch.zeros(2, dtype=torch.int64)
        wire = impl_e(b, idx, offsets, 2, wdt, acc=acc, residual=res,
                      clip=256.0 if clip else None)
        old, void = impl_c(b, idx, offsets, wire, cnt, G=G, acc=acc, residual=res,
                           keep_all_zero=keep_all_zero, return_old_g=True)
        outs.append((wire, acc, b, G, cnt, old, void))
    for name, x, y in zip(("wire", "acc", "buf", "G", "counter", "old_g", "void"), *outs):
        _same(x, y, name)


@pytest.mark.parametrize("bdt,wdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("pattern", ["random", "nonfinite"])
def test_step_commit_state_half_leaves_buf_and_bucket_half_completes_it(bdt, wdt, pattern):
    """write_buf=False commits G, acc and the counter exactly as the full op and leaves buf;
    a second call without state then writes buf exactly as the full op (delay_steps=1)."""
    rng = np.random.default_rng(11)
    offsets, idx, avg, n = _commit_case(bdt, wdt, pattern, rng)
    buf0 = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(bdt)
    G0 = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    acc0 = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    res0 = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    full = [buf0.clone(), G0.clone(), acc0.clone(), torch.zeros(2, dtype=torch.int64)]
    ops.step_commit(full[0], idx, offsets, avg, full[3], G=full[1], acc=full[2], residual=res0,
                    keep_all_zero=True)
    for impl in (ops.step_commit, ref.step_commit):
        buf, G, acc, cnt = buf0.clone(), G0.clone(), acc0.clone(), torch.zeros(2, dtype=torch.int64)
        impl(buf, idx, offsets, avg, cnt, G=G, acc=acc, residual=res0, keep_all_zero=True,
             write_buf=False)
        _same(buf, buf0, "buf untouched")
        for name, a, b in (("G", G, full[1]), ("acc", acc, full[2]), ("counter", cnt, full[3])):
            _same(a, b, name)
        impl(buf, idx, offsets, avg, torch.zeros(2, dtype=torch.int64), keep_all_zero=True)
        _same(buf, full[0], "buf")
