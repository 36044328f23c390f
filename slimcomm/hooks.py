"""Slim-DP as a DistributedDataParallel communication hook (the SGD path).

A thin adapter: DDP's bucket is a group of :class:`slimcomm.compressor.SlimDPCompressor`,
which holds the whole algorithm; this module maps buckets to parameter
positions and hands DDP the future.

Slim-DP (Sun, Chen, Bian, Liu, Liu, "Slim-DP: A Light Communication Data
Parallelism for DNN", arXiv 1709.09393, AAMAS 2018) communicates, each step,
only the *core set* (the coordinates that are significant in the latest
snapshot, significance = ``|w| * |g|``, Sec. 3.1) plus a random *explore set*
of other coordinates (Sec. 3.2). The paper uses a parameter server; on DDP
there is none, so this hook makes the index set **shared**: every rank derives
the same index set from state that is identical on every rank (the weights and
the last *globally averaged* gradient), so only the packed values travel,
through one dense ``all_reduce`` of ``k + m`` elements per bucket. There is no
index traffic and the bytes per rank do not grow with the world size.

Usage::

    from slimcomm.hooks import SlimDPState, slim_dp_hook

    ddp = DistributedDataParallel(model)
    state = SlimDPState(core_ratio=0.01, explore_ratio=0.01, model=ddp)
    ddp.register_comm_hook(state, slim_dp_hook)
    ...
    torch.save({"model": ..., "opt": ..., "slim_dp": state.state_dict()},
               f"ckpt-rank{rank}.pt")          # every rank saves its own

Per parameter ``p`` (position ``pos`` in ``model.parameters()`` order, ``n``
elements) and per synchronised step ``t``:

1. ``acc = grad + residual`` (error feedback; fp32; local to the rank).
2. Core set, refreshed when ``(t - warmup_steps) % core_refresh == 0``: the
   ``k`` coordinates with the largest ``|w| * |G|`` (``score``), where ``w``
   is the parameter and ``G`` the last globally averaged gradient per
   coordinate (``slimcomm.ops.significance_topk_segmented``).
3. Explore set: ``m`` coordinates outside the core set from
   ``slimcomm.ops.explore_sample_segmented`` with ``seed`` and RNG offset
   :func:`explore_rng_offset` ``(t, pos)`` -- never torch's global RNG, never
   the bucket index.
4. ``values = pack(acc, core ∪ explore) / world_size`` (cast to
   ``value_dtype``), one ``all_reduce`` per bucket.
5. The bucket becomes zeros with the averaged values at the index set;
   ``G[index set] = values``; ``residual = acc`` with the sent coordinates
   zeroed.

``k, m = selection_sizes(n, core_ratio, explore_ratio, min_compress_numel)``; a
parameter with ``k + m >= n`` or fewer than ``min_compress_numel`` elements is sent
densely inside the same packed buffer, and a bucket of
only such parameters is a plain all-reduce (bit-identical to DDP's default
hook; in ``index_mode="local"``, the local mode's all-gather and fp32
scatter-add without the indices, as beside sparse parameters). Everything is per parameter, so the result does not depend on how DDP
groups parameters into buckets (``bucket_cap_mb``, the bucket rebuild after
the first iteration, or a new DDP instance after a checkpoint).
"""

import logging
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .compressor import SlimDPCompressor, explore_rng_offset, selection_sizes

logger = logging.getLogger(__name__)

__all__ = [
    "SlimDPState",
    "slim_dp_hook",
    "selection_sizes",
    "explore_rng_offset",
    "MIN_COMPRESS_NUMEL",
]

#: ``SlimDPState``'s default ``min_compress_numel``: parameters with fewer elements are sent
#: whole (see the class docstring; the training command and the benchmarks read it here)
MIN_COMPRESS_NUMEL = 2048


class SlimDPState(SlimDPCompressor):
    r"""Hyperparameters and per-parameter state of :func:`slim_dp_hook`.

    Slim-DP (arXiv 1709.09393) on top of all-reduce, see the module docstring
    for the algorithm. One state serves one DDP model; register it with
    ``ddp.register_comm_hook(state, slim_dp_hook)`` after :meth:`attach`.

    Hyperparameters (all keyword arguments):

    * ``process_group`` (default ``None`` = the default group): the group the
      bucket is reduced over.
    * ``core_ratio`` (default 0.01): fraction of each parameter in the core set
      (Slim-DP's "significant" set, Sec. 3.1), ``0 < core_ratio <= 1``;
      ``k = max(1, ceil(core_ratio * numel))``. The main knob for the
      compression ratio; 0.01-0.05 keeps accuracy close to dense on MLPs.
      Raise it if the loss lags dense training.
    * ``explore_ratio`` (default 0.01): fraction sampled uniformly at random
      outside the core set each step (Sec. 3.2), ``0 <= explore_ratio <= 1``.
      Lets coordinates that are insignificant now become significant; with
      error feedback it also bounds how stale a residual can get. About the
      core ratio is a good start.
    * ``core_refresh`` (default 10): the core set is recomputed from the
      weights and the global gradient estimate ``G`` every ``core_refresh``
      synchronised steps (the paper's snapshot period). Smaller follows the
      gradient better at the cost of one top-k per bucket per refresh.
    * ``warmup_steps`` (default 1, at least 1): the first steps are dense
      all-reduce (in bf16 when ``value_dtype`` is bf16, like DDP's
      ``bf16_compress_hook``; otherwise in the gradient's dtype); ``G`` starts from the dense average. At least 1
      so that ``G`` is known before the first core set is chosen; the state is
      kept per parameter, so DDP's rebuild of its buckets after the first
      iteration carries ``G`` over to the new buckets and 1 suffices. Each
      dense step costs a full DDP step of bytes (at 8 ranks on 100 Mbit/s
      links, 3.7 s in fp32 for a 5.8M-parameter MLP, as long as 20 compressed
      steps): the default was 2 until issue 31. Raise it (e.g. to the
      learning-rate warm-up length) when early training is unstable.
    * ``score`` (default ``"product"``): significance for the core set,
      ``"product"`` = ``|w| * |G|`` (the paper), ``"grad"`` = ``|G|``,
      ``"weight"`` = ``|w|``.
    * ``index_mode`` (default ``"shared"``): ``"shared"`` is Slim-DP on
      all-reduce as above. ``"local"`` is the classic top-k / deep gradient
      compression baseline: each rank picks its own top-k of ``|w| * |acc|``
      (by ``score``) plus explore, all-gathers fixed-size (index, value)
      pairs and scatter-adds them; ``G``, ``core_refresh`` and
      ``check_agreement_every`` are not used, the bytes received grow with the
      world size.
    * ``error_feedback`` (default True): keep what was not sent in a per-rank
      fp32 residual and add it to the next gradient. Strongly recommended.
    * ``value_dtype`` (default ``None`` = the gradient's dtype): dtype of the
      values on the wire, one of fp32/fp16/bf16 (bf16 halves the bytes).
      Values are divided by the world size before the cast.
    * ``error_decay`` (default 1.0): the residual is multiplied by it before
      the next gradient is added; 1 is classic error feedback.
    * ``seed`` (default 0): seed of the explore sampler, any 64-bit int
      (``[-2**63, 2**64)``); must be equal on all ranks. The sampler never touches torch's global RNG, so ranks that
      consumed it differently (dropout) still agree.
    * ``check_agreement_every`` (default 100; 0 = never): every n-th
      compressed step each bucket's index set and ``G`` are checked across
      ranks with one small checksum all-reduce (MAX/MIN of 6 int64 sums: 96
      bytes per bucket, plus a host sync, counted in ``stats["last"/"total"]
      ["checks", "check_bytes"]``); a mismatch raises ``RuntimeError``
      naming the bucket's parameters on every rank. At each core refresh
      (``score`` other than ``"grad"``) the same 64-byte all-reduce, without
      a host sync, keeps the new core set identical on every rank: where the
      ranks' weights differ (DDP ``join()`` with uneven inputs: a joined rank
      stops stepping its optimizer), every rank keeps its previous core set.
    * ``delay_steps`` (default 0): 1 applies each step's averaged values one
      step later. The hook then starts the all-reduce of step ``t`` and hands
      DDP, at once, the average of step ``t - 1`` (zeros at the first
      compressed step), so the collective runs during the optimizer step and
      the next forward and backward instead of blocking backward: on a slow
      or high-latency link the step no longer waits for the network. The
      gradient the optimizer applies is one step stale (error feedback is
      unchanged). A non-finite step is then not undone for every parameter
      (the bad parameters keep their residual and ``G`` and come back NaN one
      step later), a GradScaler cannot be attached, and DDP must not use
      ``find_unused_parameters=True`` (DDP discards the value of a parameter
      no rank used, which would be the previous step's average; refused by
      :meth:`attach` when it is given the DDP instance). See
      :mod:`slimcomm.compressor.transports.delayed`.
    * ``allreduce_algorithm`` (default ``"backend"``): how each compressed bucket's values
      are summed (``delay_steps=0``, ``index_mode="shared"``; warm-up steps and buckets of
      dense parameters always use the process group's ``all_reduce``). ``"backend"``: the
      process group's ``all_reduce`` (gloo: a ring, ``2 (W-1)`` sequential hops of latency;
      NCCL: its own ring/tree). ``"two_shot"``: two all-to-all exchanges
      (:func:`slimcomm._comm.two_shot_all_reduce`): the same bytes per rank as a ring but
      2 hops of latency, and a sum in fp32 in rank order rounded once to the wire dtype
      (a ring rounds at every hop), identical on every rank whatever the bucketing. Meant
      for links with a large one-way delay (10-100 ms between sites), where a ring's
      ``2 (W-1)`` delays per step dominate. The first exchange is waited for inside the
      hook (with gloo the backward pass blocks on it, so earlier buckets no longer overlap
      with the rest of backward: with many buckets on a fast link ``"backend"`` may be
      faster). Measured (issue 31, ``bench/results/scale/mlp_8ranks_issue31e.md``, 8 ranks
      on emulated links without added delay, MLP, one bucket, same run): 218-225 ms a step
      against the ring's 221-238 at 1 Gbit/s, 232-251 against 243-265 at 100 Mbit/s; in the
      latency projection 3.6 hops a step against 15.6. The convnet
      (``cnn_8ranks_issue31g.md``, one bucket, medians of 3 seeds): 0.85 test accuracy in
      16.5 / 16.8 s against the ring's 17.8 / 19.2 s at 1 Gbit/s / 100 Mbit/s. Not the
      default: the per-step gain is within this machine's noise (the MLP's hook floor run,
      ``bench/results/hook_floor_8ranks.md``, had it 1.07x slower at 1 Gbit/s), models with
      several buckets are unmeasured, and NCCL's own all-reduce is not a ring of host hops.
    * ``min_compress_numel`` (default 2048): a parameter with fewer elements is sent
      whole (dense, inside the same packed buffer), as PowerSGD sends vectors
      uncompressed (Vogels et al., NeurIPS 2019, Sec. 4). At 1% + 1% a tensor of 2,000
      elements would get 40 coordinates a step: biases, normalisation gains, a first
      convolution or a classifier head of few classes are updated a few coordinates at a
      time, although together they are a small share of the bytes. Measured (issue 31,
      the convnet at 8 ranks, seeds 0-2, loopback): 0.85 test accuracy after 100 / 120 /
      120 steps against 140 / 200 / 180 with 0 (the earlier behaviour; 1-D parameters
      alone, 140 / 160 / never), for 19% more bytes per step. ``0`` compresses every parameter.
    * ``model`` (default ``None``): shortcut for :meth:`attach`.

    State (per parameter, keyed by its position in ``model.parameters()``):
    fp32 ``residual`` (error feedback), fp32 ``G`` (last globally averaged
    gradient per coordinate), the core set (int64 parameter-local indices),
    plus the synchronised-step counter ``step``. The explore set is a pure
    function of ``(seed, step, position)``, so ``step`` is the RNG position.

    Non-finite gradients: one flag element per parameter travels with the
    values (NaN when that parameter's gradient holds NaN/inf on this rank,
    else 1 if it has a nonzero element, else 0; computed exactly with
    min/max). If any rank flags a parameter, every rank's averaged gradient
    for that whole parameter is NaN (so a ``GradScaler`` sees the overflow and
    skips the step), and the whole step is undone for **every** parameter at
    the start of the next step (the skipped step applied nothing, so what was
    sent goes back into the residuals and ``G``; ``stats["voided_steps"]``).
    No second collective is needed, and the decision is the same on every
    rank because it is read from reduced data.

    A parameter whose gradient is exactly zero on every rank (with
    ``find_unused_parameters=True``: a parameter no rank used, whose bucket
    result DDP discards) sends nothing that step: it comes back zero and
    keeps its residual and ``G``.

    Loss scaling and fp16 wires: with a ``GradScaler``, call
    ``state.attach_grad_scaler(scaler)`` so residuals and ``G`` are kept in
    unscaled units (otherwise a scale change mis-weights the residual by the
    ratio of the scales). On an fp16 wire (``value_dtype=torch.float16``, or
    fp16 gradients) each rank's values are saturated at the largest power of
    two ``L`` with ``world_size * L <= 65504`` so the sum never overflows;
    what is clipped off stays in the residual and is sent on later steps.

    ``state_dict()`` / ``load_state_dict()`` hold this rank's residuals, so
    **every rank saves and loads its own**; the state records its rank and
    world size, and a state saved by another rank (for instance rank 0's file
    loaded everywhere, as in PowerSGD's example) is refused on every rank at
    the first synchronised step after the load. The process group and the model
    are not part of the state (nor of a pickle); re-:meth:`attach` after
    unpickling.

    Raises:
        ValueError: a hyperparameter out of range (the message names it).
    """

    __slots__ = ("_fused",)  # _FusedSGD of fuse_sgd, or None
    _KEEP_ALL_ZERO = True          # DDP discards the result of a parameter no rank used
    _VOID_NONFINITE_STEP = True    # a GradScaler skips the whole step
    _DELAY_OK = True               # delay_steps=1: the average handed to DDP one step later
    _MIN_WARMUP = 1
    # The hook sends float values (value_dtype); low-bit codes are SlimDPOptimizer's.
    _HYPERPARAMETERS = tuple(h for h in SlimDPCompressor._HYPERPARAMETERS
                             if h not in ("value_bits", "quant_chunk"))
    _WARMUP_WHY = " (G starts from a dense average)"

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        core_ratio: float = 0.01,
        explore_ratio: float = 0.01,
        core_refresh: int = 10,
        warmup_steps: int = 1,
        score: str = "product",
        index_mode: str = "shared",
        error_feedback: bool = True,
        value_dtype: Optional[torch.dtype] = None,
        seed: int = 0,
        check_agreement_every: int = 100,
        model: Optional[nn.Module] = None,
        error_decay: float = 1.0,
        delay_steps: int = 0,
        allreduce_algorithm: str = "backend",
        min_compress_numel: int = MIN_COMPRESS_NUMEL,
    ):
        super().__init__(
            process_group=process_group, core_ratio=core_ratio, explore_ratio=explore_ratio,
            core_refresh=core_refresh, warmup_steps=warmup_steps, score=score,
            index_mode=index_mode, error_feedback=error_feedback, error_decay=error_decay,
            value_dtype=value_dtype, seed=seed, check_agreement_every=check_agreement_every,
            delay_steps=delay_steps, allreduce_algorithm=allreduce_algorithm,
            min_compress_numel=min_compress_numel)
        self._fused = None
        if model is not None:
            self.attach(model)

    def attach(self, model: nn.Module) -> "SlimDPState":
        """Map the model's parameters to stable positions; call before training.

        Args:
            model: the DDP-wrapped model or the module it wraps. Position ``i``
                is the ``i``-th tensor of ``module.parameters()`` (names from
                ``named_parameters()``), which does not depend on DDP's
                bucketing, so state saved from one DDP instance is applied to
                the same parameters of another.

        Returns:
            ``self``.

        Raises:
            ValueError: ``model`` is not an ``nn.Module``; ``delay_steps=1`` and
                ``model`` is a DDP with ``find_unused_parameters=True`` (DDP
                discards the value of a parameter no rank used in a step: with
                the delay, the previous step's average); already-held state
                (from :meth:`load_state_dict` or training) names a parameter
                that has a different name or size in ``model``.
        """
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
        if self.delay_steps and isinstance(model, nn.parallel.DistributedDataParallel) and \
                getattr(model, "find_unused_parameters", False):
            # DDP drops the bucket value of a parameter no rank used at step t; delayed,
            # that value is step t - 1's average, so it would be lost for good (a parameter
            # used every other step would never be updated)
            raise ValueError(
                "delay_steps=1 cannot be used with DDP(find_unused_parameters=True): DDP "
                "discards the bucket value of a parameter no rank used in a step, which with "
                "delay_steps=1 is the previous step's average (lost, not applied); use "
                "delay_steps=0")
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        if getattr(self, "_fused", None) is not None:  # fused to the previous parameters
            logger.warning("SlimDPState.attach: dropping fuse_sgd (it was set up for the "
                           "previously attached parameters); call fuse_sgd again")
            self.fuse_sgd(None)
        return self.attach_parameters(list(module.named_parameters()))

    def fuse_sgd(self, optimizer: Optional[torch.optim.Optimizer]) -> "SlimDPState":
        """Apply plain SGD inside the hook, at the index set only (a fused optimizer step).

        With ``torch.optim.SGD`` without momentum or weight decay (the setting Slim-DP's
        error feedback is run with here: momentum on top of error feedback over-shoots,
        ``../shared/FINDINGS.md``), a compressed step changes only the ``k + m`` sent
        coordinates of each parameter, yet the unfused step writes the whole bucket
        (zeros plus the averaged values) and ``optimizer.step()`` then reads it and
        rewrites every parameter: two dense passes over a gradient that is ~98% zeros.
        Fused, each compressed bucket's completion applies ``param[i] = fma(avg_i, -lr,
        param[i])`` at the index set (:func:`slimcomm.ops.sgd_apply_indexed`, the
        rounding of ``param.add_(grad, alpha=-lr)`` on fp32) and leaves the bucket as it
        was; ``optimizer.step()`` then skips those parameters and steps the others as
        usual: the dense warm-up steps, buckets of dense parameters only, parameters the
        hook never synchronised. A parameter that is non-finite on some rank is left
        unchanged (unfused it would become NaN) and counted in :attr:`stats`.

        Buckets of non-fp32 parameters, and buckets whose optimizer groups are not plain
        SGD or do not share one lr at that step (e.g. momentum switched on later), are
        synchronised unfused for that step (the bucket written, the optimizer steps
        them; one logged warning per reason): the update is always torch's.

        The loop stays ``zero_grad(); loss.backward(); optimizer.step()``. What changes:

        * the update of a fused parameter happens **during** ``backward()``, with the lr
          in effect then: set this step's lr before ``backward()`` (an lr scheduler
          stepped after ``optimizer.step()``, the usual order, does); gradient clipping
          or any edit of ``.grad`` before ``step()`` no longer affects it, and its
          ``.grad`` holds this rank's own gradient, not the average;
        * one ``backward()`` per ``step()``: accumulate micro-batches inside
          ``ddp.no_sync()`` (each synchronised backward applies an update, whether
          ``step()`` is called or not); ``step(closure)`` is refused;
        * under ``ddp.join()`` a rank that ran out of data still applies the average
          (unfused it would not step);
        * not part of :meth:`state_dict`, and :meth:`attach` drops it: call
          ``fuse_sgd`` again after a resume or a re-attach.

        Args:
            optimizer: a ``torch.optim.SGD`` (not a subclass) over the attached model's
                trainable parameters, every group with ``momentum=0, weight_decay=0,
                nesterov=False, maximize=False`` and a float lr at this call; ``None``
                undoes a previous call. The optimizer's ``step`` is wrapped on the
                instance (``fuse_sgd(None)`` unwraps it).

        Returns:
            ``self``.

        Raises:
            RuntimeError: the state is not attached.
            TypeError: ``optimizer`` is not a ``torch.optim.SGD``.
            ValueError: a group's setting is not plain SGD or its lr is a tensor, the
                optimizer does not hold every trainable attached parameter (the message
                names them), ``index_mode`` is not ``"shared"``, ``delay_steps=1``, or a
                GradScaler is attached. A refused call leaves an earlier fusion in place.
        """
        from ._fused_sgd import _FusedSGD

        new = None
        if optimizer is not None:
            if not self._params:
                raise RuntimeError("SlimDPState.fuse_sgd: attach(model) first")
            if self.index_mode != "shared":
                raise ValueError(f"SlimDPState.fuse_sgd: index_mode={self.index_mode!r}; the "
                                 f"fused step needs the shared index set (index_mode='shared')")
            if self.delay_steps:
                raise ValueError("SlimDPState.fuse_sgd: delay_steps=1 hands DDP the previous "
                                 "step's average; the fused step needs delay_steps=0")
            if self._scaler is not None:
                raise ValueError("SlimDPState.fuse_sgd: a GradScaler is attached; its skip of an "
                                 "overflowing step would come after the fused update")
            new = _FusedSGD(optimizer, dict(enumerate(self._params)), self._names)
        if self._fused is not None:
            self._fused.remove()
        self._fused = new
        if new is not None:
            new.install()
        return self

    def _fused_sgd(self, layout):
        if self._fused is None:
            return None
        return self._fused.for_layout(layout.key, layout.dtype)

    def end_step(self) -> None:
        if self._fused is not None:
            self._fused.end_step()
        super().end_step()

    def _bucket_key(self, bucket: dist.GradBucket) -> Tuple[int, ...]:
        """Positions of the bucket's parameters; RuntimeError if foreign."""
        params = bucket.parameters()
        try:
            return tuple(self._positions[id(p)] for p in params)
        except KeyError:
            bad = [tuple(p.shape) for p in params if id(p) not in self._positions]
            raise RuntimeError(
                f"bucket {bucket.index()} holds parameters of shapes {bad} that are not "
                f"parameters of the model given to SlimDPState.attach (attach the model "
                f"wrapped by this DDP instance)"
            ) from None

    def _check_bucket(self, bucket: dist.GradBucket, key: Tuple[int, ...]):
        """``(device, dtype)`` of a new bucket; RuntimeError if it is not a flat
        concatenation of its parameters' gradients."""
        params = bucket.parameters()
        buf = bucket.buffer()
        grads = bucket.gradients()
        esz = buf.element_size()
        base = buf.data_ptr()
        off = 0
        for p, g in zip(params, grads):
            n = p.numel()
            if g.numel() != n or (n > 0 and g.data_ptr() != base + off * esz):
                raise RuntimeError(
                    f"bucket {bucket.index()}: gradients are not a contiguous concatenation "
                    f"of the parameters (expected {self._names[self._positions[id(p)]]} at "
                    f"offset {off}); this DDP bucket layout is not supported"
                )
            off += n
        if off != buf.numel():
            raise RuntimeError(
                f"bucket {bucket.index()}: buffer has {buf.numel()} elements but its "
                f"parameters have {off}"
            )
        return buf.device, buf.dtype


# ---------------------------------------------------------------------------
# The hook
# ---------------------------------------------------------------------------


def slim_dp_hook(state: SlimDPState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: Slim-DP (arXiv 1709.09393) over all-reduce.

    Register with ``ddp.register_comm_hook(state, slim_dp_hook)``. DDP calls
    it once per bucket per synchronised step (not inside ``no_sync()``: DDP
    accumulates micro-step gradients locally, so error feedback is applied
    once per synchronised step, to the accumulated gradient).

    Args:
        state: a :class:`SlimDPState` attached to the model.
        bucket: DDP's ``GradBucket``; ``bucket.buffer()`` is the flat gradient
            ``[N]`` (fp32/fp16/bf16) of ``bucket.parameters()``.

    Returns:
        a future of the averaged bucket ``[N]`` (the bucket buffer, written in
        place; with ``delay_steps=1`` already completed and holding the previous
        step's average): the dense average during warm-up and for buckets whose
        parameters are all dense (bit-identical to DDP's default hook; in
        ``index_mode="local"`` summed in fp32 in rank order like a dense
        parameter in a mixed bucket); otherwise zeros except the averaged values at the bucket's index set.
        A parameter whose gradient held NaN/inf on any rank comes back filled
        with NaN on every rank, and its residual and ``G`` are not updated.
        Sparse-gradient buckets (``nn.Embedding(sparse=True)``) are averaged
        with a plain all-reduce and keep no state.

    Raises:
        RuntimeError: the state is not attached; the bucket holds parameters
            of another model (raised on that rank; every other rank raises
            "another rank could not map bucket ..." at the same step instead
            of waiting in a collective); the ranks' states differ; the
            index-set agreement check failed (raised on every rank, naming
            the bucket's parameters).
        TypeError: ``state`` is not a :class:`SlimDPState` (e.g. a plain
            ``SlimDPCompressor``, which has no bucket bookkeeping).
    """
    if not isinstance(state, SlimDPState):
        raise TypeError(f"slim_dp_hook: state must be a SlimDPState (register_comm_hook(state, "
                        f"slim_dp_hook)), got {type(state).__name__}")
    buf = bucket.buffer()
    try:
        if buf.layout != torch.strided:
            fut = _sparse_bucket(state, buf)
        else:
            layout = state.layout_for(lambda: state._bucket_key(bucket),
                                      lambda key: state._check_bucket(bucket, key),
                                      f"bucket {bucket.index()}", buf.device)
            fut = state.synchronize(layout, buf)
    finally:
        if bucket.is_last():
            state.end_step()
    return fut


def _sparse_bucket(state, buf):
    """Sparse gradient (no top-k on a sparse tensor): plain averaged all-reduce."""
    nbytes = buf._values().numel() * buf.element_size() + buf._indices().numel() * 8
    state._count(nbytes, nbytes, 0, 0, 0, 0)
    buf.div_(dist.get_world_size(state.group))
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


