"""Fake (meta) kernels of the ``torch.ops.slimcomm`` ops: output shapes from the arguments alone.

Registered when :mod:`slimcomm.ops` is imported, so that ``torch.compile`` (and
``FakeTensor`` tracing) can run every op without data; nothing here is called
directly.
"""

import torch

from . import _C  # noqa: F401  (defines the ops these kernels register for)


@torch.library.register_fake("slimcomm::significance_topk")
def _(weight, grad, k, score="product"):
    return weight.new_empty((k,), dtype=torch.int64), grad.new_empty((k,))


@torch.library.register_fake("slimcomm::significance_topk_segmented")
def _(weight, grad, offsets, ks, score="product"):
    total = sum(ks)
    return weight.new_empty((total,), dtype=torch.int64), grad.new_empty((total,))


@torch.library.register_fake("slimcomm::explore_sample")
def _(n, exclude, m, seed, offset):
    return exclude.new_empty((m,), dtype=torch.int64)


@torch.library.register_fake("slimcomm::explore_sample_segmented")
def _(offsets, exclude, exclude_offsets, ms, seed, rng_offsets):
    return exclude.new_empty((sum(ms),), dtype=torch.int64)


@torch.library.register_fake("slimcomm::pack")
def _(src, indices):
    return src.new_empty((indices.shape[0],))


@torch.library.register_fake("slimcomm::unpack")
def _(dst, indices, values, accumulate=False):
    return None


def _block_shape(w, r, c):
    nr = w.shape[0] if r is None else r.shape[0]
    if w.dim() == 1:
        return (nr,)
    return (nr, w.shape[1] if c is None else c.shape[0])


@torch.library.register_fake("slimcomm::gather_slices")
def _(weight, rows, cols):
    return weight.new_empty(_block_shape(weight, rows, cols))


@torch.library.register_fake("slimcomm::scatter_slices")
def _(weight, rows, cols, block):
    return None


@torch.library.register_fake("slimcomm::gather_slices_multi")
def _(weights, rows, cols):
    total = 0
    for w, r, c in zip(weights, rows, cols):
        n = 1
        for d in _block_shape(w, r, c):
            n = n * d
        total = total + n
    return weights[0].new_empty((total,))


@torch.library.register_fake("slimcomm::scatter_slices_multi")
def _(weights, rows, cols, buffer):
    return None


@torch.library.register_fake("slimcomm::step_encode")
def _(buf, indices, offsets, world_size, wire_dtype, acc=None, residual=None, scale=None,
      error_decay=1.0, accumulate=True, clip=None):
    return buf.new_empty((indices.shape[0] + offsets.shape[0] - 1,), dtype=wire_dtype)


@torch.library.register_fake("slimcomm::step_commit")
def _(buf, indices, offsets, avg, counter, G=None, acc=None, residual=None, scale=None,
      keep_all_zero=False, return_old_g=False, void_in=None, write_buf=True):
    k = indices.shape[0] if return_old_g else 0
    return buf.new_empty((k,), dtype=torch.float32), buf.new_empty((), dtype=torch.bool)


@torch.library.register_fake("slimcomm::sgd_apply_indexed")
def _(params, indices, offsets, avg, lr, keep_all_zero=False):
    return None


@torch.library.register_fake("slimcomm::step_commit_local")
def _(buf, all_indices, all_values, offsets, world_size, counter, acc=None, residual=None,
      keep_all_zero=False, void_in=None):
    return buf.new_empty((), dtype=torch.bool)


@torch.library.register_fake("slimcomm::step_undo")
def _(void_flag, residual=None, spare=None, G=None, indices=None, old_g=None, counter=None):
    return None


@torch.library.register_fake("slimcomm::quantize_chunks")
def _(vals, seg_offsets, chunk, bits, nchunks):
    K = vals.shape[0]
    return (vals.new_empty(((K * bits + 7) // 8,), dtype=torch.uint8),
            vals.new_empty((nchunks,), dtype=torch.bfloat16),
            vals.new_empty((K,), dtype=torch.float32))


@torch.library.register_fake("slimcomm::dequantize_chunks_mean")
def _(packed, scales, seg_offsets, chunk, bits, numel, divisor):
    return packed.new_empty((numel,), dtype=torch.float32)
