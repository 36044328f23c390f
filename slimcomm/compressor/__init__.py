"""The Slim-DP compressor core: shared index sets, error feedback, per-parameter state.

Slim-DP (Sun, Chen, Bian, Liu, Liu, "Slim-DP: A Light Communication Data
Parallelism for DNN", arXiv 1709.09393, AAMAS 2018) communicates, each step,
only the *core set* (the coordinates that are significant in the latest
snapshot, significance = ``|w| * |g|``, Sec. 3.1) plus a random *explore set*
of other coordinates (Sec. 3.2). The paper uses a parameter server; on
all-reduce there is none, so the index set is **shared**: every rank derives
the same index set from state that is identical on every rank (the weights
and the last *globally averaged* value of each coordinate), so only the packed
values travel, through one dense ``all_reduce`` of ``k + m`` elements per
group. There is no index traffic and the bytes per rank do not grow with the
world size.

:class:`SlimDPCompressor` is that logic once, independent of what carries the
values. It synchronises a *group*: a flat buffer holding several tensors
(positions), each with its own state. Its adapters:

* :mod:`slimcomm.hooks` -- the DDP communication hook: a group is a DDP
  bucket of gradients (the SGD path).
* :mod:`slimcomm.optim` -- the optimizer-side sync: a group is a run of
  pseudo-gradients (outer parameters minus local parameters after local
  steps), for AdamW and other adaptive optimizers.

Per tensor ``p`` (position ``pos``, ``n`` elements) and per synchronised step
``t``:

1. ``acc = buf + error_decay * residual`` (error feedback; fp32; local to
   the rank).
2. Core set, refreshed when ``(t - warmup_steps) % core_refresh == 0``: the
   ``k`` coordinates with the largest ``|w| * |G|`` (``score``), where ``w``
   is the tensor's value (identical on all ranks) and ``G`` the last
   globally averaged value per coordinate
   (``slimcomm.ops.significance_topk_segmented``).
3. Explore set: ``m`` coordinates outside the core set from
   ``slimcomm.ops.explore_sample_segmented`` with ``seed`` and RNG offset
   :func:`explore_rng_offset` ``(t, pos)`` -- never torch's global RNG,
   never the group index.
4. ``values = pack(acc, core ∪ explore) / world_size`` (cast to
   ``value_dtype``), one ``all_reduce`` per group.
5. The buffer becomes zeros with the averaged values at the index set;
   ``G[index set] = values``; ``residual = acc`` with the sent coordinates
   zeroed.

``k, m = selection_sizes(n, core_ratio, explore_ratio, min_compress_numel)``; a
tensor with ``k + m >= n`` or fewer than ``min_compress_numel`` elements is sent
densely inside the same packed buffer, and a group of
only such tensors is a plain all-reduce (in ``index_mode="local"``: the same
all-gather and fp32 scatter-add as beside sparse tensors, only no indices
travel). Everything is per position, so the
result does not depend on how tensors are grouped (DDP's ``bucket_cap_mb``,
its bucket rebuild after the first iteration, a new DDP instance after a
checkpoint).

``index_mode="local"`` is the classic per-rank top-k / deep gradient
compression baseline (each rank its own top-k of ``|w| * |acc|`` plus
explore, all-gathered (index, value) pairs); with ``error_decay < 1`` on
pseudo-gradients it is SparseLoCo's compressor (arXiv 2508.15706, Sec. 3).

The package, one job a module:

* :mod:`~slimcomm.compressor.core` -- :class:`SlimDPCompressor`: construction,
  attached parameters, and the dispatch of each group to its transport;
* :mod:`~slimcomm.compressor.hyperparameters` -- the frozen hyperparameters
  and their validation;
* :mod:`~slimcomm.compressor.layout` -- per-group flat state (``_Layout``),
  ``selection_sizes``, ``explore_rng_offset``, new layouts checked across ranks;
* :mod:`~slimcomm.compressor.selection` -- the index sets: core set, explore
  set, cross-rank checksums;
* :mod:`~slimcomm.compressor.feedback` -- error feedback: accumulate, encode,
  commit, loss scale, undoing void steps;
* :mod:`~slimcomm.compressor.transports` -- how one group's values travel, one
  module each: ``dense``, ``shared`` (all-reduce), ``local`` (all-gather of
  pairs), ``lowbit`` (all-gather of low-bit codes), ``reduce_scatter`` (the
  two-stage low-bit all-reduce of a dense group: codes to shard owners with
  one all-to-all, owner-side residual, all-gather; bytes per rank bounded in
  the world size);
* :mod:`~slimcomm.compressor.checkpoint` -- ``state_dict`` / ``load_state_dict``,
  the ownership check, pickling;
* :mod:`~slimcomm.compressor.stats` -- the communication statistics.
"""

from .core import SlimDPCompressor
from .layout import explore_rng_offset, selection_sizes

__all__ = ["SlimDPCompressor", "selection_sizes", "explore_rng_offset"]
