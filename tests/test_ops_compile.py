"""torch.library.opcheck on every slimcomm op (schema, fake kernel, autograd
registration, AOT dispatch) and a torch.compile(fullgraph=True) smoke test."""

from __future__ import annotations

import pytest
import torch

import slimcomm.ops  # noqa: F401  (registers the ops)
from slimcomm import ops, reference as ref

OPS = torch.ops.slimcomm


def _i(*v):
    return torch.tensor(v, dtype=torch.int64)


def _cases():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(100, generator=g)
    gr = torch.randn(100, generator=g)
    wh, grh = w.half(), gr.half()
    W = torch.randn(8, 6, generator=g)
    b = torch.randn(8, generator=g)
    ex = _i(2, 5, 50, 99)
    return [
        ("significance_topk", OPS.significance_topk, (w, gr, 7, "product")),
        ("significance_topk_half_grad", OPS.significance_topk, (wh, grh, 3, "grad")),
        ("significance_topk_k0", OPS.significance_topk, (w, gr, 0, "weight")),
        ("significance_topk_segmented", OPS.significance_topk_segmented, (w, gr, [0, 10, 10, 60, 97], [2, 0, 5, 37], "product")),
        ("explore_sample", OPS.explore_sample, (100, ex, 9, 123, 4)),
        ("explore_sample_segmented", OPS.explore_sample_segmented, ([0, 40, 100], ex, [0, 2, 4], [3, 7], 123, [0, 1])),
        ("pack", OPS.pack, (w, _i(99, 0, 17))),
        ("unpack", OPS.unpack, (w.clone(), _i(99, 0, 17), gr[:3].clone(), False)),
        ("unpack_accumulate", OPS.unpack, (wh.clone(), _i(4, 8), grh[:2].clone(), True)),
        ("gather_slices", OPS.gather_slices, (W, _i(7, 1), _i(0, 5, 2))),
        ("gather_slices_none", OPS.gather_slices, (W, None, _i(3))),
        ("gather_slices_1d", OPS.gather_slices, (b, _i(3, 4), None)),
        ("scatter_slices", OPS.scatter_slices, (W.clone(), _i(7, 1), _i(0, 5, 2), torch.randn(2, 3, generator=g))),
        ("gather_slices_multi", OPS.gather_slices_multi, ([W, b], [_i(1, 2), _i(1, 2)], [_i(0), None])),
        ("scatter_slices_multi", OPS.scatter_slices_multi, ([W.clone(), b.clone()], [_i(1, 2), _i(1, 2)], [_i(0), None], torch.randn(4, generator=g))),
    ]


@pytest.mark.parametrize("op,args", [pytest.param(op, args, id=name) for name, op, args in _cases()])
def test_opcheck(op, args):
    torch.library.opcheck(op, args)


def test_opcheck_requires_grad_inputs():
    # Selection and packing are not differentiable; with requires_grad inputs the
    # autograd registration check must still pass (no silently wrong gradients).
    w = torch.randn(50, requires_grad=True)
    g = torch.randn(50)
    torch.library.opcheck(OPS.significance_topk, (w, g, 5, "product"),
                          test_utils=("test_schema", "test_autograd_registration"))
    torch.library.opcheck(OPS.pack, (w, _i(1, 2)),
                          test_utils=("test_schema", "test_autograd_registration"))


def _select_and_pack(w, g, acc, k):
    idx, _ = ops.significance_topk(w, g, k)
    vals = ops.pack(acc, idx) * 0.5
    out = torch.zeros_like(acc)
    ops.unpack(out, idx, vals)
    return idx, out


def test_torch_compile_fullgraph_smoke():
    torch._dynamo.reset()
    compiled = torch.compile(_select_and_pack, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    for n, k in ((1000, 10), (3000, 300)):
        w, gr, acc = (torch.randn(n, generator=g) for _ in range(3))
        idx, out = compiled(w, gr, acc, k)
        ridx, _ = ref.significance_topk(w, gr, k)
        assert torch.equal(idx, ridx)
        expect = torch.zeros_like(acc)
        expect[ridx] = acc[ridx] * 0.5
        assert torch.equal(out, expect)
