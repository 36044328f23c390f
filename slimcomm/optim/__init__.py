"""Optimizer-side Slim-DP: local steps, then a compressed outer synchronisation.

The DDP hook (:mod:`slimcomm.hooks`) compresses gradients, which is right for
SGD but wrong for Adam-type optimizers: Adam normalises every coordinate every
step, so a coordinate whose sparse gradient waits ~50 steps in the error
feedback residual moves about one learning-rate step instead of ~50. This
module compresses the *optimizer's update* instead, in the local-steps form
of DiLoCo (Douillard et al., arXiv 2311.08105, Alg. 1):

1. every rank steps its own inner optimizer (e.g. AdamW) on its local
   gradients for ``sync_every`` steps (no communication);
2. pseudo-gradient ``delta = outer - local`` (the outer parameters are
   identical on every rank);
3. ``delta`` goes through the one Slim-DP compressor core
   (:class:`slimcomm.compressor.SlimDPCompressor`): error feedback keeps
   the unsent part of each update with its full magnitude, and the index set
   is *shared* (core set scored by ``|outer| * |G|``, plus a Philox explore
   set), so one all-reduce of ``k + m`` values per group and no indices
   travel;
4. outer step on the averaged sparse ``delta`` (SGD with optional
   (Nesterov) momentum, as in DiLoCo), then every rank's parameters are set
   to the new outer parameters, so replicas are identical after every sync.

``compression="dense"`` with ``value_bits`` (the recommended AdamW setting:
every coordinate as a 2-bit code every 3 steps) keeps error feedback on every
rank and averages the codes with a two-stage all-reduce
(``lowbit_collective="all_reduce"``, the compressed all-reduce of 1-bit Adam,
Tang et al., arXiv 2102.02888, Sec. 4): codes to the shard owners with one
all-to-all, each owner decodes and averages its shard, adds its own residual
and re-quantises, and the owners' codes are all-gathered, so each rank sends
``~2 (W-1)/W`` x one rank's code size at any world size ``W``.

The inner optimizer for AdamW users is :class:`LocalAdamW` (``world_size`` = the ranks
averaged): each rank's AdamW would otherwise normalise by the second moment of its own
small batch, and its steps would be up to ``sqrt(W)`` times smaller than DDP's where the
gradient noise dominates (measured on a GPT at 8 ranks: 1.093x DDP's loss with AdamW, 1.018x
with ``LocalAdamW`` and ``outer_lr=1.0``; ``bench/results/scale/gpt_8ranks_localadamw.md``).

The same class gives the baselines: ``compression="dense"`` is DiLoCo (dense
averaged pseudo-gradient, outer Nesterov SGD), ``compression="local"`` with
``error_decay < 1`` and plain outer SGD is SparseLoCo (Sarfi et al., arXiv
2508.15706, Alg. 1: per-rank top-k of an error-feedback accumulator decayed by
``beta``, all-gathered).

Usage (no DDP wrapper needed; every rank runs the same code)::

    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    opt = SlimDPOptimizer(model, inner, sync_every=8, core_ratio=0.05, explore_ratio=0.05)
    model.load_state_dict(pretrained)  # optional; before the first step (any rank(s))
    for step, (x, y) in enumerate(loader, 1):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # local gradient
        opt.step()                   # inner step; every 8th call also synchronises
        if step % 1000 == 0:         # evaluate / checkpoint the global model: on any ranks
            with torch.no_grad(), opt.outer_weights() as m:
                evaluate(m)
                torch.save(m.state_dict(), "global.pt")   # inside the block (or clone)
            torch.save(opt.state_dict(), f"opt-rank{rank}.pt")  # each rank its own, to resume
    opt.synchronize()                # end of training, every rank: replicas identical

``outer_weights()`` is the one way to look at the global model during
training: it needs no communication (rank 0 alone may evaluate), and it
refuses to nest or to run ``synchronize()``/``step()`` inside. Calling
``synchronize()`` yourself mid-training is a collective (on one rank it
hangs) and an extra outer step, so it is only for the end of training.

With a ``GradScaler``: ``scaler.step(opt); scaler.update()`` (a step the scaler
skips on one rank is still counted; the same as ``scaler.step(opt.inner);
opt.advance()``). Without one, a non-finite step on some rank (an inf loss)
costs that rank's contribution to one synchronisation and resets its inner
optimizer state (see :meth:`SlimDPOptimizer.synchronize`); float16 parameters
with Adam's default ``eps`` are refused. Uneven inputs (ranks with different
numbers of batches): run the loop inside ``with opt.join():``. A rank that dies
or hangs makes every other rank raise :class:`CollectiveError` within
``timeout`` seconds.

The package, one job a module:

* :mod:`~slimcomm.optim.optimizer` -- :class:`SlimDPOptimizer`: construction,
  stepping, the synchronisation (outer step);
* :mod:`~slimcomm.optim.groups` -- the constructor's checks, the flat parameter
  groups (outer copy, scratch, momentum), the starting point every rank shares;
* :mod:`~slimcomm.optim.protocol` -- the per-sync agreement of the ranks'
  counters, the failed state, ``join()`` for uneven inputs;
* :mod:`~slimcomm.optim.nonfinite` -- non-finite pseudo-gradients: the flags read
  on the host without a sync, the inner state reset, ``stats``;
* :mod:`~slimcomm.optim.checkpoint` -- ``outer_weights()``, ``state_dict`` /
  ``load_state_dict``;
* :mod:`~slimcomm.optim.local_adamw` -- :class:`LocalAdamW`: the inner AdamW that
  normalises every rank's step by the second moment of the W-rank average gradient;
* :mod:`~slimcomm.optim.sharded` -- FSDP2 / HSDP: ``DTensor`` parameters (the
  checks of the mesh and ``process_group``, the local shards, the
  ``torch.distributed.checkpoint`` form of ``state_dict``).
"""

from .._comm import CollectiveError
from .groups import COMPRESSIONS
from .local_adamw import LocalAdamW
from .optimizer import SlimDPOptimizer

__all__ = ["SlimDPOptimizer", "LocalAdamW", "COMPRESSIONS", "CollectiveError"]
