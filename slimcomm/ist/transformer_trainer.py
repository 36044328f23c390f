"""``GPTISTTrainer``: independent subnet training of a GPT's transformer blocks on a process
group (the partition, the subnet and its scaling are in :mod:`slimcomm.ist.transformer`;
the cross-rank protocol and the checkpoints are :class:`~slimcomm.ist.ISTTrainer`'s,
shared through :mod:`slimcomm.ist.protocol` and :mod:`slimcomm.ist.checkpoint`)."""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .. import _comm, ops
from .._comm import CollectiveError
from .checkpoint import _CheckpointMixin
from .partition import _check_int, partition
from .protocol import _FP_ERROR, _ProtocolMixin
from .stats import ISTStats
from .transformer import (GPTSubnet, _build_gpt_plan, _check_world, _full_tensors, _make_subnet,
                          _index_sets, _slice_indices)

__all__ = ["GPTISTTrainer"]


class GPTISTTrainer(_ProtocolMixin, _CheckpointMixin):
    """Independent subnet training of a GPT: attention heads and FFN neurons split over ranks.

    IST (Yuan et al., arXiv 1910.02120, Sec. 3, Algorithm 1) applied to the width
    of transformer blocks (TwIST, arXiv 2511.03983; SDP, arXiv 2507.09029). Each
    round ``t``:

    1. every rank computes ``partition([n_head] * L + [f] * L, world_size, seed,
       t)`` and cuts its :class:`~slimcomm.ist.GPTSubnet` out of the full model
       with ONE :func:`slimcomm.ops.gather_slices_multi` (its heads' q/k/v rows
       and out-projection columns, its FFN neurons' ``mlp[0]`` rows and ``mlp[2]``
       columns, plus whole copies of the shared tensors: embeddings, LayerNorms,
       the two residual projections' biases, the LM head);
    2. it trains the subnet for ``local_steps`` calls of :meth:`step` on its own
       data with no communication, using a fresh optimizer from
       ``optimizer_factory(subnet.parameters())``;
    3. :meth:`synchronize` (automatic after ``local_steps`` steps) runs ONE
       ``all_gather`` of every rank's flat subnet buffer (the subnet's parameters
       are views of it: nothing is packed), checks that every value received is
       finite, writes each rank's slices into the full model with
       :func:`slimcomm.ops.scatter_slices_multi` (disjoint: no averaging), and sets
       every shared tensor to the mean of the ranks' trained copies (summed in fp64
       in rank order, so every rank computes the same bits). Every rank then holds the
       same full model, and a new partition is drawn.

    Scaling and learning rate: with ``rescale`` the subnet multiplies its head
    outputs by ``n_head / |heads|`` and its GELU outputs by ``f / |neurons|``
    (:mod:`slimcomm.ist.transformer`), so the forward pass estimates the full
    model's without bias; each sliced tensor's gradient is then that factor ``c``
    times the full model's, and with ``scale_grads`` (default) it is multiplied by
    ``1 / c`` after backward, exactly the rule of :class:`~slimcomm.ist.ISTTrainer`
    (:mod:`slimcomm.ist`, "Gradient scaling"; every sliced tensor of a block has
    one sliced dimension): one SGD learning rate serves every world size. AdamW,
    what GPT training uses, normalises the gradient, so its function step is
    already independent of the world size; the scaling then only changes the
    role of ``eps`` and of the clipping threshold.

    Optimizer state: re-created every round (as IST and :class:`ISTTrainer` do).
    The next round slices different heads and neurons, so carrying per-slice
    Adam moments over would apply them to the wrong weights, and the shared
    tensors' moments differ per rank (they would need an extra collective).
    The cost: each round restarts Adam's bias correction, so the first local
    step of a round is a sign-like step of size ``lr``; prefer ``local_steps``
    of 10 or more with AdamW.

    Non-finite steps: every :meth:`step` reads the loss and the subnet's gradient
    norm in one host read; when either is not finite the optimizer step is
    skipped (counted in :attr:`skipped_steps`), so the subnet's weights never
    take a NaN/inf update. As a second guard the synchronisation checks the
    gathered buffer (identical on every rank) and, if anything in it is not
    finite, raises :class:`~slimcomm.CollectiveError` on every rank without
    writing the model.

    Construction, :meth:`step`, :meth:`synchronize`, :meth:`join`,
    :meth:`state_dict` / :meth:`load_state_dict` and the failure behaviour are
    those of :class:`~slimcomm.ist.ISTTrainer` (fingerprint agreement of the
    architecture and settings on every rank, broadcast of rank 0's model, an
    80-byte agreement of the round counters before every exchange, every
    collective bounded by ``timeout`` and a dead rank raising
    :class:`~slimcomm.CollectiveError` on the survivors, the model not written
    by a failed synchronisation, refusal of further use after one).

    Args:
        model: the GPT (:class:`slimcomm.train.workloads.models.GPT` or the same
            structure, see :mod:`slimcomm.ist.transformer`); updated in place at
            every synchronisation, stale in between.
        optimizer_factory: ``callable(params) -> torch.optim.Optimizer``, e.g.
            ``lambda p: torch.optim.AdamW(p, lr=1e-3)``.
        local_steps: steps per round, ``>= 1``.
        process_group: ``torch.distributed`` group; ``None`` = the default group
            if initialised, else a single rank.
        seed: partition seed (the same on every rank).
        rescale: the branch-output scaling above (default True).
        scale_grads: with ``rescale``, multiply each sliced tensor's gradient by
            ``1 / c`` (default True).
        max_grad_norm: clip the subnet's (scaled) gradient to this 2-norm before
            the optimizer step, on the device with no host sync; ``None`` = no
            clipping.
        broadcast_model: broadcast rank 0's model at construction (and at the
            first step).
        timeout: seconds any one collective may wait (default 300; ``None`` =
            the process group's).

    Raises:
        TypeError / ValueError: a bad argument (named) or an unsupported model
            (naming the attribute), ``model.n_head`` or the FFN width smaller
            than the world size; raised on the rank that has it, the others
            raise RuntimeError (after the check exchange, never a hang).
        RuntimeError: the ranks disagree on the model or settings.
    """

    #: subnets kept for reuse, keyed by their widths (with widths not divisible by the world
    #: size a rank alternates between two)
    _CACHE = 2

    def __init__(
        self,
        model: nn.Module,
        optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        local_steps: int = 10,
        process_group: Optional[dist.ProcessGroup] = None,
        seed: int = 0,
        *,
        rescale: bool = True,
        scale_grads: bool = True,
        max_grad_norm: Optional[float] = None,
        broadcast_model: bool = True,
        timeout: Optional[float] = 300.0,
    ):
        if not callable(optimizer_factory):
            raise TypeError(f"optimizer_factory must be callable, got {type(optimizer_factory).__name__}")
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
        plan = None
        try:
            _check_int(local_steps, "local_steps", 1)
            _check_int(seed, "seed")
            self._timeout = _comm.check_timeout(timeout, "GPTISTTrainer")
            for name, v in (("rescale", rescale), ("scale_grads", scale_grads),
                            ("broadcast_model", broadcast_model)):
                if not isinstance(v, bool):
                    raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
            if max_grad_norm is not None and (isinstance(max_grad_norm, bool)
                                              or not isinstance(max_grad_norm, (int, float))
                                              or not 0 < max_grad_norm < float("inf")):
                raise ValueError(f"max_grad_norm must be a finite number > 0 or None, got {max_grad_norm!r}")
            plan = _build_gpt_plan(model)
            _check_world(plan, self._world_size)
            text = (f"{plan.descriptor}|world_size={self._world_size}|seed={seed}|local_steps={local_steps}"
                    f"|rescale={rescale}|scale_grads={scale_grads}|clip={max_grad_norm!r}"
                    f"|broadcast={broadcast_model}")
            fingerprint = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(),
                                         "little") >> 1
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
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.shared = 0.0   # checkpoint format of ISTTrainer: no shared neurons here
        self._itemsize = torch.empty((), dtype=plan.dtype).element_size()
        self._dense_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self._rounds = self._steps = self._payload_bytes = self._wire_bytes = 0
        self._round = self._local_step = self._check_bytes = self._skipped = 0
        self._failed: Optional[str] = None
        self._joined = False
        self._cache: Dict[Tuple[int, ...], Any] = {}
        self._broadcast = self._distributed and broadcast_model and self._world_size > 1
        if self._broadcast:
            self._broadcast_model()
        self._begin_round()
        self._reread = True   # the first step re-reads the model (weights loaded after construction)

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
    def subnets(self) -> int:
        """Subnets per round: one per rank (``ISTTrainer(subnets=)`` has no GPT form)."""
        return self._world_size

    #: the exchange sends exact values (``ISTTrainer(exchange_bits=)`` has no GPT form)
    exchange_bits = None

    @property
    def round(self) -> int:
        """Index of the current round."""
        return self._round

    @property
    def blocks(self) -> List[List[torch.Tensor]]:
        """The current partition: ``2 L`` lists (heads per block, then FFN neurons per block)."""
        return self._blocks

    @property
    def subnet(self) -> GPTSubnet:
        """The subnet this rank trains in the current round."""
        return self._subnet

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The current round's optimizer (re-created every round)."""
        return self._optimizer

    @property
    def skipped_steps(self) -> int:
        """Steps whose optimizer update was skipped because the loss or gradient was not finite."""
        return self._skipped

    def payload_numel(self, rank: int) -> int:
        """Elements rank ``rank`` hands to the current round's ``all_gather`` (unpadded)."""
        return self._slice_numel[rank] + self._shared_numel

    @property
    def stats(self) -> ISTStats:
        """Communication counters so far (:class:`~slimcomm.ist.ISTStats`; ``payload_bytes``
        is this rank's slices plus the shared tensors, per round)."""
        w = self._world_size
        dense = self._steps * 2 * (w - 1) * self._dense_numel * self._itemsize // w
        return ISTStats(rounds=self._rounds, steps=self._steps, payload_bytes=self._payload_bytes,
                        check_bytes=self._check_bytes, bytes_sent=self._wire_bytes,
                        bytes_received=self._wire_bytes, dense_bytes_sent=dense,
                        dense_bytes_received=dense)

    def step(self, inputs: torch.Tensor, targets: Any,
             loss_fn: Callable[[torch.Tensor, Any], torch.Tensor]) -> float:
        """One local step of this rank's subnet; synchronises every ``local_steps``.

        ``loss = loss_fn(subnet(inputs), targets)``, backward, gradient scaling
        (one op), optional clipping (device-side), one host read of the loss and
        the gradient norm, then the optimizer step unless either is not finite.

        Args:
            inputs: int64/int32 ``[B, T]`` token ids on the model's device.
            targets: ``loss_fn``'s second argument (e.g. int64 ``[B, T]``).
            loss_fn: ``(logits [B, T, V], targets) -> scalar tensor``.

        Returns:
            the loss before the update, as a Python float (may be nan/inf: the
            update was then skipped).

        Raises:
            ValueError: ``inputs`` is not an int ``[B, T]`` tensor on the model's
                device; ``loss_fn`` did not return a scalar tensor.
            CollectiveError: from the synchronisation.
        """
        self._check_usable()
        if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2 \
                or inputs.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"inputs must be an int64/int32 [B, T] tensor of token ids, got "
                             f"{getattr(inputs, 'dtype', type(inputs).__name__)} "
                             f"{list(getattr(inputs, 'shape', []))}")
        if inputs.device != self._plan.device:
            raise ValueError(f"inputs is on {inputs.device}; the model is on {self._plan.device}")
        if self._reread:
            self._reread_model()
        sub = self._subnet
        sub.train(self.model.training)
        first = self._grad_views[0] if self._grad_views else None
        if first is not None and first[0].grad is not first[1]:
            self._attach_grads()   # someone dropped the views (e.g. zero_grad(set_to_none=True))
        self._gflat.zero_()
        loss = loss_fn(sub(inputs), targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn must return a scalar tensor")
        loss.backward()
        with torch.no_grad():
            g = self._gflat
            if self._gscale is not None:
                g.mul_(self._gscale)
            norm = torch.linalg.vector_norm(g.float())
            if self.max_grad_norm is not None:
                g.mul_(torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0).to(g.dtype))
            value, gnorm = torch.stack([loss.detach().float().reshape(()), norm]).tolist()
        finite = abs(value) != float("inf") and value == value and abs(gnorm) != float("inf") \
            and gnorm == gnorm
        if finite:
            self._optimizer.step()
        else:
            self._skipped += 1
        self._steps += 1
        self._local_step += 1
        if self._local_step >= self.local_steps:
            self.synchronize()
        return value

    def synchronize(self) -> None:
        """End the round now: exchange the trained subnets, then repartition.

        Afterwards every rank holds the same full model and a new subnet and
        optimizer. A no-op when no step was taken since the last one.
        Collective: all ranks call it together.

        Cost: one 80-byte agreement all-reduce (one host read), one pad, ONE
        ``all_gather``, one host read of the finiteness check, one
        ``scatter_slices_multi`` per rank, the shared tensors' mean (a sum over
        ranks, one more ``scatter_slices_multi``), then the next round's partition:
        :func:`~slimcomm.ist.partition` on the host (a ``randperm`` per block and
        width), the index sets of every rank in a constant number of ops on small
        CPU tensors, ONE host-to-device copy of every rank's
        indices and one ``gather_slices_multi`` into a cached subnet of the same
        widths (one ``copy_``; a subnet and its parameter views are built only when
        none is cached). Apart from :func:`~slimcomm.ist.partition`'s host ops the
        number of dispatched ops does not grow with the depth
        (``tests/test_ist_gpt.py``).

        Raises:
            CollectiveError: a collective failed or timed out, the ranks reached it
                at different points, or a received value is not finite (on every
                rank; the model is not written, the trainer refuses further use).
        """
        self._check_usable()
        if self._local_step == 0:
            return
        self._agree(joined=False)
        with ops.trusted_indices():
            self._synchronize()

    # -- internals -------------------------------------------------------------

    def _what(self) -> str:
        return (f"GPTISTTrainer.synchronize (round {self._round}, local step {self._local_step}, "
                f"step {self._steps})")

    def _begin_round(self) -> None:
        """Draw the partition, build every rank's index tensors (:func:`_index_sets`: a
        constant number of ops, one host-to-device copy), cut this rank's subnet (one
        ``gather_slices_multi``; a cached subnet of the same widths is refilled with one
        ``copy_`` and keeps its parameter and gradient views), and a fresh optimizer."""
        plan, w = self._plan, self._world_size
        self._blocks = partition(plan.widths, w, self.seed, self._round)
        self._rows, self._cols = [], []
        for sets in _index_sets(plan, self._blocks, range(w), plan.device):
            rows, cols = _slice_indices(plan, sets)
            self._rows.append(rows)
            self._cols.append(cols)
        sliced_full, shared_full = _full_tensors(plan, self.model)
        self._slice_numel = [ops.slices_numel(sliced_full, self._rows[r], self._cols[r]) for r in range(w)]
        self._shared_numel = sum(t.numel() for t in shared_full)
        nones = [None] * len(shared_full)
        with torch.no_grad():
            flat = ops.gather_slices_multi(sliced_full + shared_full, self._rows[self._rank] + nones,
                                           self._cols[self._rank] + nones)
        L = plan.n_layer
        key = tuple(int(self._blocks[j][self._rank].numel()) for j in range(2 * L))
        entry = self._cache.pop(key, None)
        if entry is not None and [p.data_ptr() for p in entry[0].parameters()] != entry[1]:
            entry = None   # someone re-pointed a parameter of the cached subnet: rebuild it
        if entry is not None:
            # A subnet of these widths is cached: refill its flat buffer (one copy_) and
            # re-attach its gradient views (attribute sets, no dispatched op).
            sub = entry[0]
            with torch.no_grad():
                sub.flat.copy_(flat)
            self._subnet, self._gflat, self._gscale = sub, entry[2], entry[3]
            self._gflat.zero_()
            for p, v in entry[4]:
                p.grad = v
            self._grad_views = entry[4]
            sub.train(self.model.training)
        else:
            self._subnet = _make_subnet(plan, self.model, self._blocks, self._rank, self.rescale, flat,
                                        self._rows[self._rank], self._cols[self._rank])
            self._gflat = torch.zeros_like(flat)
            self._attach_grads()
            self._gscale = None
            if self.rescale and self.scale_grads and w > 1:
                # 1 / c per entry of the sliced tensors (attention: n_head / |heads|; FFN:
                # f / |neurons|), 1 for the shared ones: one repeat_interleave.
                sub = self._subnet
                factors, counts = [], []
                for s, name in zip(plan.sliced, sub._names):
                    c = sub.attn_scale[s.block] if "attn" in name else sub.ffn_scale[s.block]
                    factors.append(1.0 / c)
                    counts.append(sub.tensor(name).numel())
                factors.append(1.0)
                counts.append(self._shared_numel)
                self._gscale = torch.repeat_interleave(
                    torch.tensor(factors, dtype=plan.dtype), torch.tensor(counts)).to(plan.device)
            entry = (self._subnet, [p.data_ptr() for p in self._subnet.parameters()], self._gflat,
                     self._gscale, self._grad_views)
        self._cache[key] = entry
        while len(self._cache) > self._CACHE:
            self._cache.pop(next(iter(self._cache)))
        optimizer = self._factory(self._subnet.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer_factory must return a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        self._optimizer = optimizer

    def _attach_grads(self) -> None:
        pairs, pos = [], 0
        for p in self._subnet.parameters():
            n = p.numel()
            if p.requires_grad:
                v = self._gflat[pos:pos + n].view(p.shape)
                p.grad = v
                pairs.append((p, v))
            pos += n
        self._grad_views = pairs

    def _reread_model(self) -> None:
        """First step after construction: refill the subnet from the model as it is now
        (rank 0's, broadcast again with ``broadcast_model``), in place; the optimizer,
        which has taken no step, is kept."""
        self._reread = False
        if self._broadcast:
            self._broadcast_model()
        sliced_full, shared_full = _full_tensors(self._plan, self.model)
        nones = [None] * len(shared_full)
        with torch.no_grad():
            self._subnet.flat.copy_(ops.gather_slices_multi(
                sliced_full + shared_full, self._rows[self._rank] + nones, self._cols[self._rank] + nones))

    def _synchronize(self) -> None:
        plan, w = self._plan, self._world_size
        sliced_full, shared_full = _full_tensors(plan, self.model)
        width = max(self.payload_numel(r) for r in range(w))
        mine = self.payload_numel(self._rank)
        with torch.no_grad():
            packed = self._subnet.flat   # the subnet's parameters ARE the payload
            gathered = self._all_gather(packed, width)   # counts the wire bytes
            if not bool(torch.isfinite(gathered).all()):   # the same bytes on every rank
                bad = [r for r in range(w) if not bool(torch.isfinite(gathered[r]).all())]
                self._failed = (f"{self._what()}: the subnets of ranks {bad} hold non-finite values "
                                f"(nan/inf); nothing was written into the model. Restart every rank "
                                f"from the last checkpoint, e.g. with a lower learning rate")
                raise CollectiveError(self._failed)
            for r in range(w):
                ops.scatter_slices_multi(sliced_full, self._rows[r], self._cols[r],
                                         gathered[r, :self._slice_numel[r]])
            # fp64 sum in rank order: the same bits on every rank, and W equal values
            # (an untrained tensor) average back to exactly that value.
            acc = gathered[0, self._slice_numel[0]:self.payload_numel(0)]
            if w > 1:
                acc = acc.double()
                for r in range(1, w):
                    acc = acc + gathered[r, self._slice_numel[r]:self.payload_numel(r)].double()
                acc = (acc / w).to(plan.dtype)
            nones = [None] * len(shared_full)   # whole tensors: one op, whatever the depth
            ops.scatter_slices_multi(shared_full, nones, nones, acc)
        self._rounds += 1
        self._payload_bytes += mine * self._itemsize
        self._local_step = 0
        self._round += 1
        self._begin_round()
