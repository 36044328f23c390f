"""CUDA kernels of the fused step ops against slimcomm.reference run on the GPU
(skipped without a GPU).

The reference is the ATen sequence the compressor ran before the fusion, so on
CUDA it uses ATen's CUDA rounding (a division by the world size is a
multiplication by its fp32 reciprocal there): the fused CUDA kernels must
match it bit for bit (NaN payloads aside), i.e. the fused GPU path gives the
same results as the unfused one. With a power-of-two world size the CPU and
CUDA kernels agree too.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from slimcomm import ops, reference as ref

from _ops_cases import DTYPES, assert_equal_nan

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)


def _same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape)
    a, b = a.cpu(), b.cpu()
    if a.is_floating_point():
        assert_equal_nan(a, b, what)
    else:
        assert torch.equal(a, b), (what, a, b)


def _case(numels, bdt, rng, pattern):
    offsets = np.concatenate([[0], np.cumsum(numels)]).astype(np.int64)
    idx = np.concatenate([offsets[s] + rng.choice(n, size=max(1, n // 7), replace=False)
                          for s, n in enumerate(numels) if n] or [np.zeros(0, np.int64)])
    rng.shuffle(idx)
    n = int(offsets[-1])
    x = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 3)
    if pattern == "nonfinite" and n:
        x[rng.integers(0, n)] = float("nan")
    if pattern == "zeros_seg":
        x[offsets[1]:offsets[2]] = 0
    return (torch.from_numpy(offsets).cuda(), torch.from_numpy(idx.astype(np.int64)).cuda(),
            x.to(bdt).cuda())


NUMELS = [0, 5, 1, 40, 17, 0, 3000, 2**20 + 3]


@pytest.mark.parametrize("bdt,wdt", list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("pattern", ["random", "nonfinite", "zeros_seg"])
@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("scale,decay,clip", [(None, 1.0, None), (None, 0.9, 4096.0),
                                              (2.0, 1.0, None)])
@pytest.mark.parametrize("keep_all_zero", [False, True])
def test_encode_commit_cuda_matches_reference(bdt, wdt, pattern, ws, scale, decay, clip,
                                              keep_all_zero):
    rng = np.random.default_rng(7)
    offsets, idx, buf = _case(NUMELS, bdt, rng, pattern)
    n = buf.numel()
    res = torch.randn(n, device="cuda")
    G0 = torch.randn(n, device="cuda")
    sc = None if scale is None else torch.tensor([scale], device="cuda")
    outs = []
    for enc, com in ((ops.step_encode, ops.step_commit), (ref.step_encode, ref.step_commit)):
        acc, b, G = torch.empty(n, device="cuda"), buf.clone(), G0.clone()
        cnt = torch.zeros(2, dtype=torch.int64, device="cuda")
        wire = enc(b, idx, offsets, ws, wdt, acc=acc, residual=res, scale=sc, error_decay=decay,
                   clip=clip)
        old, void = com(b, idx, offsets, wire, cnt, G=G, acc=acc, residual=res, scale=sc,
                        keep_all_zero=keep_all_zero, return_old_g=True)
        outs.append((wire, acc, b, G, cnt, old, void))
    for name, x, y in zip(("wire", "acc", "buf", "G", "counter", "old_g", "void"), *outs):
        _same(x, y, name)


@pytest.mark.parametrize("bdt,wdt", list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("keep_all_zero", [False, True])
def test_commit_local_and_undo_cuda_match_cpu(bdt, wdt, keep_all_zero):
    rng = np.random.default_rng(3)
    offsets, idx, _ = _case(NUMELS, bdt, rng, "random")
    n, k, S = int(offsets[-1]), idx.numel(), len(NUMELS)
    ws = 3
    all_idx = torch.cat([idx[torch.randperm(k, device="cuda")] for _ in range(ws)])
    all_val = torch.randn(ws * (k + S), device="cuda")
    all_val.view(ws, k + S)[:, k:] = torch.randint(0, 2, (ws, S), device="cuda").float()
    all_val.view(ws, k + S)[1, k + 3] = float("nan")
    all_val = all_val.to(wdt)
    acc0, res = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    outs = []
    for dev in ("cuda", "cpu"):
        b = torch.zeros(n, dtype=bdt, device=dev)
        acc = acc0.to(dev).clone()
        cnt = torch.zeros(2, dtype=torch.int64, device=dev)
        void = ops.step_commit_local(b, all_idx.to(dev), all_val.to(dev), offsets.to(dev), ws,
                                     cnt, acc=acc, residual=res.to(dev),
                                     keep_all_zero=keep_all_zero)
        r, G = res.to(dev).clone(), acc0.to(dev).clone()
        ops.step_undo(void, residual=r, spare=acc, G=G, indices=idx.to(dev),
                      old_g=torch.zeros(k, device=dev), counter=cnt)
        outs.append((b, acc, cnt, void, r, G))
    for name, x, y in zip(("buf", "acc", "counter", "void", "residual", "G"), *outs):
        _same(x, y, name)


@pytest.mark.parametrize("bdt", DTYPES)
@pytest.mark.parametrize("pattern", ["random", "nonfinite", "zeros_seg"])
def test_commit_state_half_cuda(bdt, pattern):
    """write_buf=False (the delayed hook's state half) leaves buf and commits G, acc and the
    counter exactly as the full op; the bucket half without state then writes buf as it."""
    rng = np.random.default_rng(3)
    offsets, idx, buf = _case(NUMELS, bdt, rng, pattern)
    n = buf.numel()
    res, G0 = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    wire = ops.step_encode(buf, idx, offsets, 2, torch.float32, acc=torch.empty(n, device="cuda"),
                           residual=res)
    acc0 = torch.randn(n, device="cuda")
    full = [buf.clone(), G0.clone(), acc0.clone(), torch.zeros(2, dtype=torch.int64, device="cuda")]
    ops.step_commit(full[0], idx, offsets, wire, full[3], G=full[1], acc=full[2], residual=res,
                    keep_all_zero=True)
    b, G, acc = buf.clone(), G0.clone(), acc0.clone()
    cnt = torch.zeros(2, dtype=torch.int64, device="cuda")
    ops.step_commit(b, idx, offsets, wire, cnt, G=G, acc=acc, residual=res, keep_all_zero=True,
                    write_buf=False)
    _same(b, buf, "buf untouched")
    for name, x, y in (("G", G, full[1]), ("acc", acc, full[2]), ("counter", cnt, full[3])):
        _same(x, y, name)
    ops.step_commit(b, idx, offsets, wire, torch.zeros(2, dtype=torch.int64, device="cuda"),
                    keep_all_zero=True)
    _same(b, full[0], "buf")
