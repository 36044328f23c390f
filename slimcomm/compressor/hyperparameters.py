"""The compressor's hyperparameters: fixed once constructed, validated at construction."""

from typing import Tuple

import torch
import torch.distributed as dist

from .. import ops
from ..codec import BITS

_VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOWBIT_COLLECTIVES = ("all_gather", "all_reduce")
ALLREDUCE_ALGORITHMS = ("backend", "two_shot")


class _Frozen:
    """A hyperparameter: readable, and fixed once the object is constructed.

    The ratios are baked into each group's cached layout (sizes on the wire),
    the seed and the refresh period into the index sets every rank derives,
    so a change on a live state could only be applied inconsistently;
    assigning raises ``AttributeError`` that says to build a new object.
    """

    __slots__ = ("name", "slot")

    def __set_name__(self, owner, name):
        self.name = name
        self.slot = "_hp_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return getattr(obj, self.slot)

    def __set__(self, obj, value):
        raise AttributeError(
            f"{type(obj).__name__}.{self.name} cannot be changed after construction (the "
            f"index sets of every rank depend on it); construct a new "
            f"{type(obj).__name__} with {self.name}={value!r} instead")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class _HyperparametersMixin:
    """The frozen hyperparameters of :class:`~slimcomm.compressor.SlimDPCompressor`
    (stored in its ``_hp_*`` slots), their checks and their fingerprint."""

    __slots__ = ()

    # Subclasses tighten these (the DDP hook needs a dense warm-up step for G).
    _MIN_WARMUP = 0
    _WARMUP_WHY = ""
    _HYPERPARAMETERS = ("core_ratio", "explore_ratio", "core_refresh", "warmup_steps", "score",
                        "index_mode", "error_feedback", "error_decay", "value_dtype", "seed",
                        "check_agreement_every", "value_bits", "quant_chunk",
                        "lowbit_collective", "delay_steps", "allreduce_algorithm",
                        "min_compress_numel")
    # Subclasses that can apply a step's average one step later (the DDP hook) set this.
    _DELAY_OK = False

    process_group = _Frozen()
    core_ratio = _Frozen()
    explore_ratio = _Frozen()
    core_refresh = _Frozen()
    warmup_steps = _Frozen()
    score = _Frozen()
    index_mode = _Frozen()
    error_feedback = _Frozen()
    error_decay = _Frozen()
    value_dtype = _Frozen()
    seed = _Frozen()
    check_agreement_every = _Frozen()
    value_bits = _Frozen()
    quant_chunk = _Frozen()
    lowbit_collective = _Frozen()
    delay_steps = _Frozen()
    allreduce_algorithm = _Frozen()
    min_compress_numel = _Frozen()

    def _check_hyperparameters(self, process_group, core_ratio, explore_ratio, core_refresh,
                               warmup_steps, score, index_mode, error_feedback, error_decay,
                               value_dtype, seed, check_agreement_every, value_bits,
                               quant_chunk, lowbit_collective="all_gather",
                               delay_steps=0, allreduce_algorithm="backend",
                               min_compress_numel=0) -> None:
        """Raise ``ValueError`` naming the first constructor argument out of range."""
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise ValueError(f"process_group must be a torch.distributed.ProcessGroup or None, "
                             f"got {type(process_group).__name__} {process_group!r}")
        if not _is_real(core_ratio) or not 0 < core_ratio <= 1:
            raise ValueError(f"core_ratio must be a number in (0, 1], got {core_ratio!r}")
        if not _is_real(explore_ratio) or not 0 <= explore_ratio <= 1:
            raise ValueError(f"explore_ratio must be a number in [0, 1], got {explore_ratio!r}")
        if not _is_int(core_refresh) or core_refresh < 1:
            raise ValueError(f"core_refresh must be an int >= 1, got {core_refresh!r}")
        if not _is_int(warmup_steps) or warmup_steps < self._MIN_WARMUP:
            raise ValueError(
                f"warmup_steps must be an int >= {self._MIN_WARMUP}{self._WARMUP_WHY}, "
                f"got {warmup_steps!r}"
            )
        if not _is_real(error_decay) or not 0 < error_decay <= 1:
            raise ValueError(f"error_decay must be a number in (0, 1], got {error_decay!r}")
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be a bool (True or False), got "
                             f"{error_feedback!r}")
        if value_bits is not None and (not _is_int(value_bits) or value_bits not in BITS):
            raise ValueError(f"value_bits must be None or one of {BITS}, got {value_bits!r}")
        if value_bits is not None and index_mode != "shared":
            raise ValueError("value_bits needs index_mode='shared' (codes are all-gathered "
                             "at the shared index set)")
        if lowbit_collective not in LOWBIT_COLLECTIVES:
            raise ValueError(f"lowbit_collective must be one of {LOWBIT_COLLECTIVES}, got "
                             f"{lowbit_collective!r}")
        if lowbit_collective == "all_reduce" and (self._KEEP_ALL_ZERO or
                                                  self._VOID_NONFINITE_STEP):
            raise ValueError(f"lowbit_collective='all_reduce' is not available in "
                             f"{type(self).__name__} (the DDP hook's per-parameter skip "
                             f"policies need the all-gathered codes); use 'all_gather'")
        if not _is_int(delay_steps) or delay_steps not in (0, 1):
            raise ValueError(f"delay_steps must be 0 or 1, got {delay_steps!r}")
        if delay_steps and not self._DELAY_OK:
            raise ValueError(f"delay_steps=1 is an option of the DDP comm hook "
                             f"(slimcomm.hooks.SlimDPState), not of {type(self).__name__}")
        if delay_steps and (index_mode != "shared" or value_bits is not None):
            raise ValueError("delay_steps=1 needs index_mode='shared' and float values "
                             "(value_bits=None)")
        if not isinstance(allreduce_algorithm, str) or \
                allreduce_algorithm not in ALLREDUCE_ALGORITHMS:
            raise ValueError(f"allreduce_algorithm must be one of {ALLREDUCE_ALGORITHMS}, got "
                             f"{allreduce_algorithm!r}")
        if allreduce_algorithm == "two_shot" and (delay_steps or index_mode != "shared" or
                                                  value_bits is not None):
            raise ValueError("allreduce_algorithm='two_shot' sums float values at a shared index "
                             "set: it needs delay_steps=0, index_mode='shared' and "
                             "value_bits=None")
        if not _is_int(min_compress_numel) or min_compress_numel < 0:
            raise ValueError(f"min_compress_numel must be an int >= 0, got "
                             f"{min_compress_numel!r}")
        if not _is_int(quant_chunk) or quant_chunk < 1:
            raise ValueError(f"quant_chunk must be an int >= 1, got {quant_chunk!r}")
        if not isinstance(score, str) or score not in ops.SCORES:
            raise ValueError(f"score must be one of {ops.SCORES}, got {score!r}")
        if not isinstance(index_mode, str) or index_mode not in ("shared", "local"):
            raise ValueError(f"index_mode must be 'shared' or 'local', got {index_mode!r}")
        if value_dtype is not None and (not isinstance(value_dtype, torch.dtype)
                                        or value_dtype not in _VALUE_DTYPES):
            raise ValueError(
                f"value_dtype must be None or one of {_VALUE_DTYPES}, got {value_dtype!r}"
            )
        if not _is_int(seed) or not -2**63 <= seed < 2**64:
            raise ValueError(f"seed must be an int in [-2**63, 2**64) (64 bits), got {seed!r}")
        if not _is_int(check_agreement_every) or check_agreement_every < 0:
            raise ValueError(
                f"check_agreement_every must be an int >= 0, got {check_agreement_every!r}"
            )

    def _hyperparameters(self) -> Tuple:
        return (self.core_ratio, self.explore_ratio, self.core_refresh, self.warmup_steps,
                self.score, self.index_mode, self.error_feedback, self.error_decay,
                str(self.value_dtype), self.seed, self.check_agreement_every, self.value_bits,
                self.quant_chunk, self.lowbit_collective, self.delay_steps,
                self.allreduce_algorithm, self.min_compress_numel)

    def _two_shot(self, world_size: int) -> bool:
        """Whether the shared index set's all-reduce is the two-shot one
        (:func:`slimcomm._comm.two_shot_all_reduce`; one rank: nothing to exchange)."""
        return self.allreduce_algorithm == "two_shot" and world_size > 1
