"""``ISTTrainer``: independent subnet training of an MLP on a process group;
construction, the local steps and the public API (see :mod:`slimcomm.ist` for the
algorithm, the supported models and the scaling rules)."""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .. import _comm, ops
from .checkpoint import _CheckpointMixin
from .extraction import _build_plan
from .grads import _GradsMixin, _SubnetGrads
from ..codec import BITS, ChunkPlan
from .partition import _check_int, partition, shared_counts
from .protocol import _FP_ERROR, _ProtocolMixin
from .rounds import _RoundsMixin
from .stats import ISTStats

__all__ = ["ISTTrainer"]


class ISTTrainer(_ProtocolMixin, _RoundsMixin, _GradsMixin, _CheckpointMixin):
    """Independent subnet training of an MLP on a process group.

    IST (Yuan et al., arXiv 1910.02120, Sec. 3, Algorithm 1). Each round ``t``:

    1. every rank computes the same partition ``partition(hidden_sizes,
       world_size, seed, t)`` and extracts its subnet (:func:`extract_subnet`);
    2. it trains the subnet for ``local_steps`` calls of :meth:`step` on its
       own data, with no communication, using a fresh optimizer from
       ``optimizer_factory(subnet.parameters())``;
    3. :meth:`synchronize` (called automatically after ``local_steps`` steps)
       sends the rank's round update in ONE ``all_gather``, padded to the
       largest rank's size (known to every rank from the shared partition, so
       no size exchange), and every rank writes every subnet's result into
       the full model with :func:`slimcomm.ops.scatter_slices_multi`; the
       blocks are disjoint, so nothing is averaged except the shared output
       bias (mean over ranks, fp32, rank order) and, when several ranks train
       one subnet (``subnets < world_size``), that subnet's ranks. By default
       the update travels as 4-bit codes (``exchange_bits``, below).
       Afterwards every rank holds the same full model.

    Subnets and ranks: the partition has ``subnets`` blocks (default
    ``min(world_size, 4)``); rank ``r`` trains subnet ``r % subnets`` on its
    own data, so with 8 ranks and 4 subnets each subnet is trained by 2 ranks
    and their results are averaged (local SGD inside a subnet, IST across
    them). A subnet then is ``1/subnets`` of every hidden layer wide, not
    ``1/world_size``: at 8 ranks a 1/8-wide subnet of the 2-hidden-layer MLP
    trains only 1/8 of each hidden-to-hidden matrix per round and plateaus
    below 0.85 on Fashion-MNIST, where 4 subnets of 2 ranks reach it
    (``bench/results/ist_scaling/subnets_sim.md``). ``subnets = 1`` is plain
    local SGD with model averaging; ``subnets = world_size`` the original IST.

    Exchange (``exchange_bits``): with ``None`` the trained values travel as
    they are (the model's dtype) and are written back exactly. With ``b`` in
    (1, 2, 4, 8) (default 4) each rank sends its round's update, the trained
    values minus the round's start (fp32), as per-chunk scaled ``b``-bit codes
    (:func:`slimcomm.ops.quantize_chunks`: chunks of 4096 values within one
    tensor, one bf16 scale each; the codec of the Slim-DP compressor), about
    ``b/32`` of the fp32 bytes; every rank decodes the same bytes
    (:func:`slimcomm.ops.dequantize_chunks_mean`, the mean over a subnet's
    ranks) and adds the update to the round's start in fp32, so replicas stay
    bit-identical. There is no error feedback: the rounding error of a round
    is dropped (measured: 4-bit codes train as exact values do, 2-bit ones do
    not; ``subnets_sim.md``), so checkpoints need no per-rank state. At world
    size 1 nothing travels and values are exact.

    Weights between neurons of different blocks are not trained in a round.

    Gradients: with ``scale_grads=True`` (default) each sliced tensor's
    gradient is multiplied by its share of the full tensor (``world_size **
    -k``, ``k`` sliced dimensions) after backward, so one SGD learning rate
    serves every world size (module docstring, "Gradient scaling"). The
    subnet's gradients are then views of one flat buffer, zeroed by
    :meth:`step` (do not set them to ``None`` in between; if that happens the
    trainer re-attaches them at the next step).

    Optimizer state: the optimizer is re-created at the start of every round,
    as in the paper's implementation. Its state (e.g. momentum) belongs to one
    subnet's neurons, and the next round slices different neurons, so carrying
    it over would apply momentum to the wrong weights; re-creating it is the
    only layout-safe choice without communicating optimizer state.

    Construction is a collective call on ``process_group``: every rank first
    validates its model locally, then the ranks exchange a 63-bit fingerprint
    of (architecture, dtype, world size, seed, local_steps, rescale,
    scale_grads, shared, subnets, exchange_bits) in one
    ``all_gather`` of ``world_size`` int64, so a rank with a bad or different
    model makes EVERY rank raise instead of hanging in a later collective.
    Then, with ``broadcast_model=True`` (default, as DDP does), the full model
    is broadcast from group rank 0 so all ranks start from the same weights.
    The first :meth:`step` re-reads the model (broadcasting it from rank 0
    again with ``broadcast_model=True``), so weights loaded into the model
    after construction, like after wrapping a model in DDP, are the starting
    point; after that the trainer owns the model until the next
    synchronisation (a load mid-round is overwritten by it).
    :meth:`step` and :meth:`synchronize` are collective too: all ranks must
    call them the same number of times.

    Args:
        model: ``nn.Sequential`` MLP (see the module docstring); the trainer
            updates it in place at every synchronisation. Between
            synchronisations it is stale (each rank trains only a subnet):
            call :meth:`synchronize` before evaluating or checkpointing it.
        optimizer_factory: ``callable(params) -> torch.optim.Optimizer``, e.g.
            ``lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)``.
        local_steps: steps per round, ``>= 1``.
        process_group: ``torch.distributed`` group; ``None`` = the default
            group if one is initialised, else a single rank with no
            communication.
        seed: shared partition seed (must be the same on every rank).
        rescale: scale hidden/output Linear inputs by ``world_size`` in the
            subnet (see "Pre-activation scaling" in the module docstring).
        scale_grads: with ``rescale``, multiply each sliced tensor's gradient
            by ``world_size ** -k`` (``k`` = its sliced dimensions) so that the
            stable SGD learning rate does not depend on the world size (see
            "Gradient scaling" in the module docstring; ``False`` = the
            original IST update, whose stable learning rate shrinks with the
            world size). No effect without ``rescale`` or at world size 1.
        shared: fraction of every hidden layer's neurons in every rank's
            subnet (:func:`partition`; 0 = disjoint subnets, the original
            IST); their weights are averaged over the ranks at every
            synchronisation (module docstring, "Shared neurons").
        subnets: distinct subnets per round, an int in ``[1, world_size]``
            (``None`` = ``min(world_size, 4)``); rank ``r`` trains subnet
            ``r % subnets`` (see "Subnets and ranks" above). The forward and
            gradient scales use ``subnets`` where the module docstring says
            ``world_size``.
        exchange_bits: ``None`` (exact values) or 1, 2, 4, 8: bits per value of
            the round's update in the exchange (default 4; see "Exchange").
        broadcast_model: broadcast rank 0's model at construction.
        timeout: seconds any one collective of the trainer may wait (default
            300; ``None`` = the process group's own timeout, 30 minutes on
            gloo). A rank that died is noticed within about a second (its
            connections close); one that hangs or stopped calling :meth:`step`
            makes the others raise after ``timeout`` seconds.

    A bad step: entries whose exchanged value (or decoded update) is
    non-finite, because a rank's subnet diverged, are not written; they keep
    the round's start on every rank, so the full model stays finite and the
    replicas identical (that rank's :meth:`step` returned the non-finite loss,
    and the next round gives it a fresh subnet from the model).

    Reliability: every :meth:`synchronize` starts with one agreement
    all-reduce of 5 int64 counters (80 bytes, one host read per round, in
    ``stats.check_bytes``): joined, round, local step, steps taken, mid-round. Ranks that
    reached it at different points (uneven inputs without :meth:`join`,
    :meth:`synchronize` called on some ranks only) raise
    :class:`~slimcomm.CollectiveError` on every rank before the exchange,
    instead of exchanging slices of different rounds. A collective that fails
    or times out raises the same error on every surviving rank, the model is
    not written, and the trainer refuses further use.

    Raises:
        TypeError / ValueError: bad arguments (``subnets`` not an int in
            ``[1, world_size]``, ``exchange_bits`` not None/1/2/4/8, ...) or an
            unsupported model (on the rank that has it, after the check
            exchange).
        RuntimeError: another rank failed validation, or the ranks disagree
            on the model or settings (raised on every rank).
    """

    #: subnets kept for reuse, keyed by their widths (see :meth:`_fill_subnet`)
    _CACHE = 2

    def __init__(
        self,
        model: nn.Sequential,
        optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        local_steps: int = 10,
        process_group: Optional[dist.ProcessGroup] = None,
        seed: int = 0,
        *,
        rescale: bool = True,
        scale_grads: bool = True,
        shared: float = 0.0,
        subnets: Optional[int] = None,
        exchange_bits: Optional[int] = 4,
        broadcast_model: bool = True,
        timeout: Optional[float] = 300.0,
    ):
        if not callable(optimizer_factory):
            raise TypeError(
                f"optimizer_factory must be callable, got {type(optimizer_factory).__name__}"
            )
        if process_group is not None and not (dist.is_available() and dist.is_initialized()):
            raise ValueError("process_group was given but torch.distributed is not initialised")
        self._distributed = dist.is_available() and dist.is_initialized()
        self._pg = process_group
        if self._distributed:
            self._world_size = dist.get_world_size(process_group)
            self._rank = dist.get_rank(process_group)
        else:
            self._world_size, self._rank = 1, 0

        error: Optional[Exception] = None
        fingerprint = _FP_ERROR
        try:
            _check_int(local_steps, "local_steps", 1)
            _check_int(seed, "seed")
            self._timeout = _comm.check_timeout(timeout, "ISTTrainer")
            if not isinstance(rescale, bool):
                raise TypeError(f"rescale must be a bool, got {type(rescale).__name__}")
            if not isinstance(scale_grads, bool):
                raise TypeError(f"scale_grads must be a bool, got {type(scale_grads).__name__}")
            if not isinstance(broadcast_model, bool):
                raise TypeError(
                    f"broadcast_model must be a bool, got {type(broadcast_model).__name__}"
                )
            plan = _build_plan(model)
            n_subnets = _check_subnets(subnets, self._world_size)
            _check_exchange_bits(exchange_bits)
            partition(plan.hidden_sizes, n_subnets, seed, 0, shared=shared)
            text = (f"{plan.descriptor}|world_size={self._world_size}|seed={seed}"
                    f"|local_steps={local_steps}|rescale={rescale}|broadcast={broadcast_model}"
                    f"|scale_grads={scale_grads}|shared={float(shared)!r}"
                    f"|subnets={n_subnets}|exchange_bits={exchange_bits}")
            digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
            fingerprint = int.from_bytes(digest, "little") >> 1   # 63 bits, >= 0
        except Exception as exc:  # noqa: BLE001 - must reach the exchange below, never hang
            error = exc
        if self._distributed:
            self._check_agreement(fingerprint, error)
        elif error is not None:
            raise error

        self.model = model
        self._plan = plan
        self._factory = optimizer_factory
        self.local_steps = local_steps
        self.seed = seed
        self.rescale = rescale
        self.scale_grads = scale_grads
        self.shared = float(shared)
        self.subnets = n_subnets
        self.exchange_bits = exchange_bits
        self._group = self._rank % n_subnets
        # ranks of each subnet, in rank order (rank r trains subnet r % subnets)
        self._members = [list(range(g, self._world_size, n_subnets)) for g in range(n_subnets)]
        self._counts = shared_counts(plan.hidden_sizes, n_subnets, self.shared)
        self._shared_slices = [
            t for t, sl in enumerate(plan.slices)
            if (sl.row_layer is None or self._counts[sl.row_layer])
            and (sl.col_layer is None or self._counts[sl.col_layer])
            and any(self._counts)]
        self._shared_local = self._local_shared_indices()
        self._shared_idx: List[Optional[torch.Tensor]] = [None] * len(plan.hidden_sizes)
        self._shared_numel_cache = self._shared_region_numel()
        self._itemsize = torch.empty((), dtype=plan.dtype).element_size()
        self._dense_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self._rounds = 0
        self._steps = 0
        self._payload_bytes = 0
        self._wire_bytes = 0
        self._round = 0
        self._local_step = 0
        self._subnet_cache: Dict[Tuple[int, ...], Any] = {}
        self._chunk_plans: Dict[Tuple[int, ...], ChunkPlan] = {}
        self._check_bytes = 0
        self._failed: Optional[str] = None
        self._joined = False
        self._grad_cache: Dict[int, Tuple[nn.Sequential, "_SubnetGrads", List[Any]]] = {}
        self._grads: Optional[_SubnetGrads] = None
        self._broadcast = self._distributed and broadcast_model and self._world_size > 1
        if self._broadcast:
            self._broadcast_model()
        self._begin_round()
        # Until the first step the model is re-read (and re-broadcast) there: weights loaded
        # into the model after construction are the starting point, as with DDP.
        self._reread = True

    # -- public API ----------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank in the process group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks (= subnets per round)."""
        return self._world_size

    @property
    def round(self) -> int:
        """Index of the current round (partition seed component)."""
        return self._round

    @property
    def blocks(self) -> List[List[torch.Tensor]]:
        """The current round's partition (see :func:`partition`)."""
        return self._blocks

    @property
    def subnet(self) -> nn.Sequential:
        """The subnet this rank trains in the current round."""
        return self._subnet

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The current round's optimizer (re-created every round)."""
        return self._optimizer

    def payload_numel(self, rank: int) -> int:
        """Values rank ``rank`` sends in the current round (slices + shared tensors; with
        ``exchange_bits`` each travels as a code of that many bits)."""
        return self._slice_numel[rank % self.subnets] + self._shared_numel

    @property
    def stats(self) -> ISTStats:
        """Communication counters so far (see :class:`ISTStats`)."""
        w = self._world_size
        dense = self._steps * 2 * (w - 1) * self._dense_numel * self._itemsize // w
        return ISTStats(
            rounds=self._rounds,
            steps=self._steps,
            payload_bytes=self._payload_bytes,
            check_bytes=self._check_bytes,
            bytes_sent=self._wire_bytes,
            bytes_received=self._wire_bytes,
            dense_bytes_sent=dense,
            dense_bytes_received=dense,
        )

    def step(
        self,
        inputs: torch.Tensor,
        targets: Any,
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
    ) -> float:
        """One local training step of this rank's subnet; synchronises every ``local_steps``.

        Computes ``loss = loss_fn(subnet(inputs), targets)``, back-propagates
        and steps the round's optimizer. The subnet runs in the full model's
        train/eval mode. After the ``local_steps``-th step of a round,
        :meth:`synchronize` runs (a collective).

        Args:
            inputs: ``[batch, in_features]`` on the model's device and dtype;
                each rank may feed its own data.
            targets: whatever ``loss_fn`` takes as its second argument.
            loss_fn: ``(outputs [batch, out_features], targets) -> scalar tensor``.

        Returns:
            the loss before the update, as a Python float.

        Raises:
            ValueError: ``inputs`` is not a tensor whose last dimension is the
                first Linear's ``in_features`` in the model's dtype and device
                (checked before anything runs); ``loss_fn`` did not return a
                scalar tensor.
        """
        self._check_usable()
        plan = self._plan
        in_features = self.model[plan.linears[0]].in_features
        if not isinstance(inputs, torch.Tensor):
            raise ValueError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}")
        if inputs.dim() < 1 or inputs.shape[-1] != in_features:
            raise ValueError(
                f"inputs has shape {list(inputs.shape)}; expected [batch, in_features = "
                f"{in_features}] (the model's first Linear)"
            )
        if inputs.dtype != plan.dtype or inputs.device != plan.device:
            raise ValueError(
                f"inputs is {str(inputs.dtype).replace('torch.', '')} on {inputs.device}; the "
                f"model is {str(plan.dtype).replace('torch.', '')} on {plan.device}"
            )
        if self._reread:
            self._reread_model()
        self._subnet.train(self.model.training)
        grads = self._grads
        if grads is None:
            self._optimizer.zero_grad(set_to_none=True)
        else:
            if grads.first is not None and grads.first.grad is not grads.first_grad:
                self._grads = grads = self._attach_grads(self._subnet)  # views were dropped
            grads.flat.zero_()
        loss = loss_fn(self._subnet(inputs), targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn must return a scalar tensor")
        loss.backward()
        if grads is not None:
            with torch.no_grad():
                grads.flat.mul_(grads.scale)   # one op: every gradient times its share
        self._optimizer.step()
        self._steps += 1
        self._local_step += 1
        value = float(loss.detach())
        if self._local_step >= self.local_steps:
            self.synchronize()
        return value

    def _reread_model(self) -> None:
        """First step after construction: the model as it is now (rank 0's, broadcast
        again when ``broadcast_model``) refills the round's subnet in place; the
        optimizer is kept (re-created only if the subnet had to be rebuilt)."""
        self._reread = False
        if self._broadcast:
            self._broadcast_model()
        before = self._subnet
        full = [getattr(self.model[s.module], s.name) for s in self._plan.slices]
        self._subnet = self._fill_subnet(full)
        if self._subnet is not before:
            self._optimizer = self._factory(self._subnet.parameters())

    def synchronize(self) -> None:
        """End the round now: exchange the trained slices, then repartition.

        After it returns every rank holds the same full model (ready for
        evaluation or checkpointing) and a new subnet and optimizer for the
        next round. A no-op when no step was taken since the last
        synchronisation. Collective: all ranks must call it together.

        Cost (issue 12; ``tests/test_hot_path_ist.py``): no host sync, and a
        number of dispatched ops that depends on the number of subnets but not
        on the number of layers or parameters: one ``all_gather``; with exact
        values a pad, one ``scatter_slices_multi`` per subnet (after the fp32
        mean of its ranks when it has several), the shared tensors' mean; with
        codes the round's start gathered, two ``quantize_chunks``, and per
        subnet one ``dequantize_chunks_mean``, one gather and one scatter; one
        ``_foreach_copy_`` each for the shared tensors and the BatchNorm
        counters; plus the repartition's (see :meth:`_begin_round`).
        """
        self._check_usable()
        if self._local_step == 0:
            return
        self._agree(joined=False)
        with ops.trusted_indices():  # the slices come from our own partition: no CUDA value-check syncs
            self._synchronize()


#: default upper bound on the number of distinct subnets per round (``subnets=None``)
MAX_DEFAULT_SUBNETS = 4


def _check_subnets(subnets: Any, world_size: int) -> int:
    """The number of distinct subnets per round: ``subnets``, or ``min(world_size,
    MAX_DEFAULT_SUBNETS)`` when ``None``; an int in ``[1, world_size]``."""
    if subnets is None:
        return min(world_size, MAX_DEFAULT_SUBNETS)
    _check_int(subnets, "subnets", 1)
    if subnets > world_size:
        raise ValueError(f"subnets must be <= world_size = {world_size} (every subnet needs a "
                         f"rank to train it), got {subnets}")
    return subnets


def _check_exchange_bits(bits: Any) -> None:
    if bits is not None and (isinstance(bits, bool) or bits not in BITS):
        raise ValueError(f"exchange_bits must be None (exact values) or one of {sorted(BITS)}, "
                         f"got {bits!r}")
