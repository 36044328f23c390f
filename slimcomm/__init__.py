"""slimcomm: communication-efficient data-parallel and subnet-parallel training.

Two published methods on top of ``torch.distributed``:

* Slim-DP (Sun et al., arXiv 1709.09393) as a DDP communication hook,
  :mod:`slimcomm.hooks`.
* Independent subnet training, IST (Yuan et al., arXiv 1910.02120),
  :mod:`slimcomm.ist`.

The kernels behind both live in the compiled extension ``slimcomm._C`` and are
exposed as ``torch.ops.slimcomm.*`` with typed wrappers in :mod:`slimcomm.ops`.
"""

__version__ = "0.1.0"
