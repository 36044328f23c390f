"""Error feedback: the residual added to each step's values and the result committed to
the residual and ``G`` (fused ops, no host sync), under a loss scale, undone for a void step."""

import math
from typing import Optional

import torch

from .. import ops
from .layout import _Layout

_FP16_MAX = 65504.0


class _FeedbackMixin:
    """Loss scale and void steps of :class:`~slimcomm.compressor.SlimDPCompressor`."""

    __slots__ = ()

    # ------------------------------------------------------------ loss scale, void steps
    def attach_grad_scaler(self, scaler) -> "SlimDPCompressor":
        """Keep error feedback in *unscaled* units under a dynamic loss scale.

        With a ``torch.amp.GradScaler`` the values reaching the compressor are the
        gradients times the current scale ``S``, which halves on overflow and grows
        every ``growth_interval`` steps. Without this call the residual and ``G`` hold
        values of whatever scale they were made at, so after a scale change the residual
        is applied ``S_old / S_new`` times too strongly or weakly. After it, each step
        uses ``acc = grad + S * residual`` and stores ``residual = unsent / S`` and
        ``G = averaged / S`` (a few elementwise ops with the scale tensor, no host sync).

        Args:
            scaler: the ``torch.amp.GradScaler`` (or ``torch.cuda.amp.GradScaler``) whose
                ``scale(loss)`` produced the gradients; ``None`` detaches it.

        Returns:
            ``self``.

        Raises:
            ValueError: ``scaler`` is not a GradScaler, ``delay_steps=1``, or the
                hook fuses the SGD step (``SlimDPState.fuse_sgd``).
        """
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise ValueError(f"scaler must be a torch.amp.GradScaler or None, got "
                             f"{type(scaler).__name__}")
        if scaler is not None and getattr(self, "_fused", None) is not None:
            raise ValueError("scaler: a GradScaler cannot be attached to a state whose hook "
                             "applies the SGD step itself (fuse_sgd): the scaler's skip of an "
                             "overflowing step would come after the update")
        if scaler is not None and self.delay_steps:
            raise ValueError("scaler: a GradScaler cannot be attached with delay_steps=1 (its "
                             "skip decision would concern the step whose values are still "
                             "in flight); use delay_steps=0")
        self._scaler = scaler
        return self

    def _fused_sgd(self, layout: _Layout):
        """``(parameters, lr)`` of a group whose SGD step the transport applies itself
        (:meth:`slimcomm.hooks.SlimDPState.fuse_sgd`), else None (the optimizer-side sync
        never fuses)."""
        return None

    def _loss_scale(self, layout: _Layout) -> Optional[torch.Tensor]:
        sc = self._scaler
        if sc is None or not sc.is_enabled() or getattr(sc, "_scale", None) is None:
            return None
        scale = sc._scale
        if scale.device != layout.device or scale.dtype != torch.float32:
            scale = scale.to(device=layout.device, dtype=torch.float32)
        return scale

    def _settle(self) -> None:
        """Undo, for every parameter, the commits of a finished step in which any parameter
        was non-finite (policy ``_VOID_NONFINITE_STEP``: a GradScaler skips the whole
        step, so values sent then were never applied and must stay in the residual).
        Runs at the start of the next step and before :meth:`state_dict`.

        Branchless (no host sync): whether the step is void is a device flag, and every
        recorded group selects, with ``torch.where``, its old residual and old ``G`` at
        the sent coordinates where the flag is set and the new ones elsewhere."""
        if not self._undo:
            return
        with self._lock:
            done = [u for u in self._undo if u[1] < self.step]
            if not done:
                return
            self._undo = [u for u in self._undo if u[1] >= self.step]
            flags = self._void_flags
            self._void_flags = {t: v for t, v in flags.items() if t >= self.step}
        counted = set()
        for layout, step, idx, undo_g in done:
            void = flags.get(step)
            if void is None:
                continue
            counter = None
            if step not in counted:  # the voided-steps counter, once per step
                counted.add(step)
                counter = self._dev_count(void.device)
            if self._layouts.get(layout.key) is not layout:
                if counter is not None:
                    ops.step_undo(void, counter=counter)
                continue
            has_res = layout.residual is not None
            has_g = undo_g is not None
            # one fused op: residual <- old residual and G[idx] <- old G where void
            ops.step_undo(void, residual=layout.residual if has_res else None,
                          spare=layout.spare if has_res else None,
                          G=layout.G if has_g else None, indices=idx if has_g else None,
                          old_g=undo_g, counter=counter)


def _accumulate(state, layout: _Layout, buf: torch.Tensor, scale) -> torch.Tensor:
    """``acc = buf + error_decay * scale * residual`` in fp32, into the spare buffer (the
    residual is kept). ``scale``: the loss scale of ``buf`` (0-d tensor) or None."""
    if layout.residual is None:
        return buf if buf.dtype == torch.float32 else buf.float()
    spare = layout.spare_buf()
    if scale is not None:
        return torch.addcmul(buf, layout.residual, scale, value=state.error_decay, out=spare)
    if state.error_decay != 1.0:
        return torch.add(buf, layout.residual, alpha=state.error_decay, out=spare)
    return torch.add(layout.residual, buf, out=spare)


def _fp16_limit(world_size: int) -> float:
    """Largest power of two ``L`` with ``world_size * L <= 65504``: every partial sum of
    ``world_size`` fp16 values in ``[-L, L]`` is finite, whatever the summation order."""
    return 2.0 ** math.floor(math.log2(_FP16_MAX / world_size))


def _encode(state, layout, buf, idx, world_size, wire_dtype, scale, accumulated=False):
    """``(wire, acc)``: one fused op (``slimcomm.ops.step_encode``) for steps 1 and 4-5
    of the module docstring on this rank's side: ``acc = buf + error_decay * scale *
    residual`` (fp32, into the spare buffer; already there when ``accumulated``), the
    payload ``[acc[idx] / world_size | flags]`` in ``wire_dtype`` (per parameter of this
    rank's new values ``buf``: NaN if they hold NaN/inf, else 1 if any is nonzero, else 0;
    summed over the ranks: NaN if non-finite on some rank, 0 if exactly zero on every
    rank, e.g. a parameter no rank used, whose result DDP discards), and in ``acc`` the
    next residual (sent coordinates zeroed, or set to what the fp16 saturation clipped
    off, divided by the loss ``scale``).

    On an fp16 wire without a loss scale the values are saturated at
    :func:`_fp16_limit` so the sum cannot overflow (a residual piled up over many steps
    would otherwise turn into inf on every send, and never drain); ``world_size`` times
    what was clipped off stays in the residual. With a GradScaler attached an overflow
    is left to become inf: the scaler skips the step (undone for every parameter) and
    lowers the scale, and the residual, kept unscaled, then fits. ``acc`` is None
    without error feedback."""
    clip = _fp16_limit(world_size) if wire_dtype == torch.float16 and scale is None else None
    acc = layout.spare_buf() if layout.residual is not None else None
    wire = ops.step_encode(buf, idx, layout.offsets_tensor(), world_size, wire_dtype, acc=acc,
                           residual=None if accumulated else layout.residual, scale=scale,
                           error_decay=state.error_decay, accumulate=not accumulated,
                           clip=clip)
    return wire, acc


def _commit(state, layout, buf, acc, idx, avg, step, scale, local=None, write_buf=True):
    """After the collective: ``buf``, ``G`` and the residual updated, NaN where flagged.

    One fused op: ``slimcomm.ops.step_commit`` (``avg``: the summed payload ``[values |
    flags]`` of :func:`_encode`, values at ``idx``) or, with ``local = (all_idx,
    all_val, world_size)``, ``slimcomm.ops.step_commit_local`` (every rank's pairs).
    Per parameter ``good`` = flags finite (and nonzero under ``_KEEP_ALL_ZERO``) and the
    averaged values finite: the residual becomes ``acc`` where good and stays the old
    one elsewhere; ``G[idx]`` (shared mode) takes the averaged values (divided by the
    loss ``scale``) where good. A parameter flagged NaN on some rank comes back NaN;
    under ``_KEEP_ALL_ZERO`` one that was exactly zero on every rank comes back zero and
    keeps its residual and ``G``. The non-finite count stays on the device.

    With ``_VOID_NONFINITE_STEP`` the old ``G`` values at ``idx`` are returned by the op
    (the old residual stays in ``layout.spare``) so that
    :meth:`SlimDPCompressor._settle` can undo the whole step if any parameter of it was
    non-finite; the op ORs its own "some parameter was non-finite" into the step's flag.
    ``write_buf=False`` (the fused SGD step, :meth:`SlimDPState.fuse_sgd`) leaves ``buf``
    as it is. No host sync, a fixed number of ops whatever the number of parameters."""
    counter = state._dev_count(buf.device)
    residual = layout.residual
    if residual is None:
        acc = None  # no error feedback: nothing to keep
    void_policy = state._VOID_NONFINITE_STEP

    def run(prev):
        if local is not None:
            all_idx, all_val, world_size = local
            void = ops.step_commit_local(buf, all_idx, all_val, layout.offsets_tensor(),
                                         world_size, counter, acc=acc, residual=residual,
                                         keep_all_zero=state._KEEP_ALL_ZERO, void_in=prev)
            return None, void
        return ops.step_commit(buf, idx, layout.offsets_tensor(), avg, counter, G=layout.G,
                               acc=acc, residual=residual, scale=scale,
                               keep_all_zero=state._KEEP_ALL_ZERO,
                               return_old_g=void_policy and layout.G is not None, void_in=prev,
                               write_buf=write_buf)

    with state._lock:  # the counter (and the step's flag) updated atomically
        if void_policy:
            old_g, void = run(state._void_flags.get(step))
            state._undo.append((layout, step, idx, old_g if layout.G is not None else None))
            state._void_flags[step] = void
        else:
            run(None)
    if residual is not None:
        layout.residual, layout.spare = acc, residual
