"""Independent subnet training (IST) for fully connected networks.

IST (Yuan, Wolfe, Dun, Tang, Kyrillidis, Jermaine, "Distributed Learning of
Fully Connected Neural Networks using Independent Subnet Training",
arXiv 1910.02120, PVLDB 15(8) 2022) decomposes an MLP into ``world_size``
narrow subnets of the same depth by partitioning the neurons of every hidden
layer. Each rank trains its subnet for ``local_steps`` steps on its own data
with no communication, then the trained slices are written back into the full
model and a new random partition is drawn (Sec. 3 of the paper).

This module provides the three pieces:

* :func:`partition` draws the per-round partition of the hidden neurons, a
  pure function of ``(hidden_sizes, world_size, seed, round)`` so that every
  rank computes the same blocks without communicating.
* :func:`extract_subnet` / :func:`write_back` cut rank ``r``'s subnet out of
  the full model and put it back, with the slicing kernels
  :func:`slimcomm.ops.gather_slices` / :func:`slimcomm.ops.scatter_slices`.
* :class:`ISTTrainer` runs the local steps and the synchronisation round, in
  which every rank's trained slices travel in ONE ``all_gather`` of packed
  buffers (:func:`slimcomm.ops.gather_slices_multi` /
  :func:`slimcomm.ops.scatter_slices_multi`), by default as 4-bit codes of
  the round's update (``exchange_bits``); with more ranks than subnets
  (``subnets``, default ``min(world_size, 4)``) several ranks train each
  subnet and are averaged.

Below, ``world_size`` is the number of blocks of the partition: the
:class:`ISTTrainer`'s ``subnets`` (equal to the world size when every rank
trains its own subnet, the original IST).

Supported models
----------------
An ``nn.Sequential`` of ``nn.Linear`` (at least two), the activations
``nn.ReLU``, ``nn.GELU``, ``nn.Tanh``, ``nn.SiLU``, ``nn.LeakyReLU``,
``nn.Dropout``, and ``nn.BatchNorm1d`` / ``nn.LayerNorm`` acting on a hidden
layer (between two Linear layers). Inputs are ``[batch, features]``. All
floating parameters and buffers share one dtype (fp32, fp16 or bf16) and one
device. Module types are matched exactly (a subclass of ``nn.Linear`` may
change the computation, so it is rejected); anything else raises a
``TypeError`` naming the module.

Slicing rules (hidden layer ``l`` = output of the ``l``-th Linear, ``b_l`` =
rank ``r``'s block of it, ``L`` = number of hidden layers):

* first Linear: ``W[b_0, :]``, ``bias[b_0]`` (all inputs);
* hidden Linear ``l`` (``0 < l < L``): ``W[b_l, b_{l-1}]``, ``bias[b_l]``;
* last Linear: ``W[:, b_{L-1}]`` (all outputs); its bias is *shared* by all
  subnets and averaged over the ranks at synchronisation;
* ``BatchNorm1d`` (weight, bias, running_mean, running_var) and ``LayerNorm``
  (weight, bias) on hidden layer ``l``: ``[b_l]``. ``num_batches_tracked`` is
  a per-layer counter, copied whole.

Pre-activation scaling
----------------------
In the subnet, a neuron of hidden layer ``l > 0`` (or of the output) sums over
only the ``|b_{l-1}| ~ n_{l-1} / world_size`` neurons of the previous layer
that are in the rank's block, so its pre-activation is on average
``1/world_size`` of the full model's. With ``rescale=True`` (the default) the
subnet multiplies the input of every hidden and output Linear by
``world_size`` (an :class:`InputScale` module in front of it), the
inverted-dropout convention (Srivastava et al., JMLR 2014) with keep
probability ``1/world_size``: since every neuron lands in the block with
probability ``1/world_size``, the subnet's pre-activations are unbiased
estimates of the full model's, and the full model is evaluated as is, with no
rescaling. With ``rescale=False`` the subnet computes the plain partial sum;
the full model then sums ``world_size`` such partial sums and its hidden and
output pre-activations are about ``world_size`` times those seen in training.
For a bias-light ReLU network this barely changes the arg-max (ReLU is
positively homogeneous), so accuracy alone hides it, but the logits, and hence
the loss and any Tanh/GELU/norm layer downstream, are off by up to
``world_size ** depth``.
``LayerNorm`` in a subnet normalises over the neurons of the block (the subnet
is a narrower network of its own).

Gradient scaling (one learning rate for every world size)
---------------------------------------------------------
The input scaling makes the subnet's forward pass an unbiased estimate of the
full model's, but not its gradients: a neuron of a hidden layer feeds the next
layer with ``world_size`` times the full model's weight, so the loss's
derivative with respect to it (and to every weight or bias that feeds it) is
``world_size`` times the full model's, and a weight between two hidden layers
also sees a ``world_size``-times larger input. Per tensor, the subnet's
gradient is about ``world_size ** k`` times the full model's, where ``k`` is
the number of the tensor's dimensions that are sliced (1 for the first and
last Linear's weights, hidden biases and norm parameters, 2 for a weight
between two hidden layers, 0 for the shared output bias). Summed over the
subnet's ``1/world_size ** k`` share of each tensor, the tangent kernel of
the subnet (the change of its outputs per unit of SGD learning rate) is then
``world_size`` (first/last layer) to ``world_size ** 2`` (hidden-to-hidden)
times the full model's, so plain SGD on the subnet is stable only at a
learning rate that shrinks with the world size (measured on the
Fashion-MNIST MLP: lr 0.05, stable at 1 and 2 ranks, gives NaN at 4 and 8).
With ``scale_grads=True`` (the :class:`ISTTrainer` default) every sliced
tensor's gradient is multiplied by ``world_size ** -k``, i.e. by the share of
the tensor the subnet holds, before the optimizer sees it. Then one SGD step
of the subnet changes its outputs as much as one SGD step of the full model
would (per layer, to first order), and after the write-back the full model
follows data-parallel SGD at the same learning rate in expectation, except
that the hidden-to-hidden weights between different ranks' blocks are not
trained in the round. This is the IST theory paper's view of IST as gradient
steps taken at a sketched point (Shulgin and Richtarik, arXiv 2306.16484:
permutation sketches ``C = world_size * P`` applied to the model): keeping
the sketch's scale in the forward pass and dropping it from the update is
what makes the admissible step size independent of ``world_size``. Adam-type
optimizers normalise the gradient, so for them the scaling changes nothing
but the role of ``eps`` (their function step is already independent of the
world size); it is there for SGD. Without ``rescale`` there is no input
scale, the subnet's gradients are not inflated, and nothing is scaled.
With shared neurons (``partition(..., shared=f)``) the scale is per neuron,
``c = 1`` for a shared neuron and ``world_size`` for a rank's own, and the
gradient of a weight ``(i, j)`` is multiplied by ``1 / (c_i * c_j)`` (an
unsliced dimension counts as ``c = 1``): the same rule, entry by entry.

Shared neurons (overlapping subnets)
------------------------------------
At 8 ranks a 1/8-wide subnet is the full model under a dropout with keep
probability 1/8; the Fashion-MNIST MLP then plateaus near 0.80-0.82 test
accuracy (``bench/results/ist_scaling/``). With ``ISTTrainer(shared=f)``
a fraction ``f`` of every hidden layer's neurons (re-drawn every round) is in
every subnet and the rest is partitioned. The weights among shared neurons
(and their biases and norm parameters) are trained by every rank; at the
synchronisation they are averaged over the ranks (one extra ``all_reduce``
of that region, in fp32), the rest is written back as before. A subnet is
``f + (1 - f) / world_size`` of each hidden layer wide, which costs compute
and bytes (the all-reduce of the shared region) in exchange for accuracy.

The package, one job a module:

* :mod:`~slimcomm.ist.partition` -- :func:`partition`, :func:`shared_counts`: the
  per-round blocks of the hidden neurons, the same on every rank;
* :mod:`~slimcomm.ist.extraction` -- the model analysis (which tensors are sliced,
  :class:`InputScale`), the checks of a partition, :func:`extract_subnet`,
  :func:`write_back`;
* :mod:`~slimcomm.ist.trainer` -- :class:`ISTTrainer`: construction, the local steps,
  the public API;
* :mod:`~slimcomm.ist.rounds` -- a round: the partition's indices on the device, the
  cached subnet (views of the payload buffer), the synchronisation (one
  ``all_gather``, the write-back, the shared tensors' mean);
* :mod:`~slimcomm.ist.grads` -- gradient scaling: the subnet's gradients as views of
  one flat buffer, scaled in one op;
* :mod:`~slimcomm.ist.protocol` -- the fingerprint agreement, the broadcast of rank 0's
  model, the per-round agreement of the counters, the failed state, ``join()``;
* :mod:`~slimcomm.ist.checkpoint` -- ``state_dict`` / ``load_state_dict``;
* :mod:`~slimcomm.ist.stats` -- :class:`ISTStats`;
* :mod:`~slimcomm.ist.transformer` -- IST for a GPT's transformer blocks: which
  tensors a partition of the attention heads and FFN neurons slices,
  :class:`GPTSubnet`, :func:`extract_gpt_subnet`, :func:`write_back_gpt`;
* :mod:`~slimcomm.ist.transformer_trainer` -- :class:`GPTISTTrainer` (the same
  protocol and checkpoints as :class:`ISTTrainer`).
"""

from .._comm import CollectiveError
from .extraction import (
    SUPPORTED_MODULES,
    InputScale,
    _build_plan,
    _grad_exponents,
    extract_subnet,
    write_back,
)
from .partition import partition, shared_counts
from .stats import ISTStats
from .trainer import ISTTrainer
from .transformer import GPTSubnet, extract_gpt_subnet, write_back_gpt
from .transformer_trainer import GPTISTTrainer

__all__ = [
    "SUPPORTED_MODULES",
    "partition",
    "shared_counts",
    "extract_subnet",
    "write_back",
    "InputScale",
    "ISTStats",
    "ISTTrainer",
    "GPTISTTrainer",
    "GPTSubnet",
    "extract_gpt_subnet",
    "write_back_gpt",
    "CollectiveError",
]
