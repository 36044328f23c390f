"""The training command: ``python -m slimcomm.train`` (console script ``slimcomm-train``).

Trains one of three workloads (:mod:`slimcomm.workloads`) with ``world_size``
ranks and one of the communication methods below, writes a results JSON per
run, and can compare methods in one table and plot the metric against wall
time and bytes (the tables, plots and ``--plot-from`` live in
:mod:`slimcomm.report`; this module trains):

========== ===================================================================
``--model``   workload
``mlp``       (default) MLP on Fashion-MNIST, or scikit-learn's digits set when
              Fashion-MNIST is not installed; metric: test accuracy.
``cnn``       :class:`~slimcomm.workloads.models.ConvNet` on the same images
              (``1 x 28 x 28``; digits: ``1 x 8 x 8``); metric: test accuracy.
``gpt``       :class:`~slimcomm.workloads.models.GPT`, a decoder-only
              transformer trained on a text corpus (Debian's ``fortunes`` or
              ``--text-file``, :mod:`slimcomm.workloads.text`) for ``--steps``
              steps; metric: validation loss in nats/token on a fixed set of
              validation batches (``--val-batches``), identical on every rank.
========== ===================================================================

Methods (``--method``; ``--compare`` takes a comma-separated list):

========== ===================================================================
``ddp``       DistributedDataParallel's default all-reduce of every gradient.
``fp16``      PyTorch's ``fp16_compress_hook`` (gradients cast to fp16 on the wire).
``powersgd``  PyTorch's ``PowerSGDState`` + ``powerSGD_hook`` (Vogels et al.,
              arXiv 1905.13727): rank-``r`` low-rank factors, error feedback.
``topk``      :func:`slimcomm.hooks.slim_dp_hook` with ``index_mode="local"``:
              the classic top-k / deep-gradient-compression baseline (each rank
              picks its own coordinates; (index, value) pairs are all-gathered).
``slimdp``    :func:`slimcomm.hooks.slim_dp_hook` with ``index_mode="shared"``:
              Slim-DP (Sun et al., arXiv 1709.09393) core + explore set that is
              identical on every rank, values in one dense all-reduce.
``ist``       :class:`slimcomm.ist.ISTTrainer`: independent subnet training
              (Yuan et al., arXiv 1910.02120): each rank trains its own subnet
              for ``--local-steps`` steps, then one collective re-assembles the model.
========== ===================================================================

Bytes sent per rank
-------------------
One definition is applied to every method: **the payload bytes a rank hands to
collectives** (the size of the tensor it passes to ``all_reduce``, or its own
contribution to ``all_gather``), summed over training steps and the
synchronisations the method needs before evaluation. It does not depend on the
collective's algorithm; a ring all-reduce puts ``2 (W - 1) / W`` times this
payload on each rank's link, an all-gather ``(W - 1)`` times. The cheap scalar
all-reduces used for evaluation and for the setup agreement check are not
counted. Per method:

* ``ddp``: ``4 * P`` bytes per step (``P`` = number of parameters, fp32).
* ``fp16``: ``2 * P`` bytes per step.
* ``powersgd``: ``4 * P`` per step for the first ``--powersgd-start-iter``
  steps (dense warm-up), then ``4 * sum((n + m) * r)`` over compressed
  ``n x m`` gradients plus ``4 * numel`` for tensors left uncompressed
  (PowerSGD's own ``total_numel_after_compression`` counter).
* ``topk`` / ``slimdp``: the hook's ``state.stats`` byte counter.
* ``topk``'s all-gather counts this rank's own (index, value) pairs.
* ``ist``: per synchronisation round, the padded buffer of this rank's
  trained slices handed to the one ``all_gather`` (``ISTStats.bytes_sent``
  divided by ``W - 1``, its ring traffic factor).

Launching
---------
* ``--world-size N`` (default 2): the command spawns ``N`` ranks with
  ``torch.multiprocessing`` on this host (a ``FileStore`` rendezvous, no port).
* Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set) or with an
  explicit ``--rank`` plus ``--master-addr``/``--master-port`` (or the
  ``MASTER_ADDR``/``MASTER_PORT`` environment variables), this process is one
  rank of a job launched externally, e.g. one per network namespace
  (``bench/netbench.py``).
* Backend: gloo for ``--device cpu``, NCCL for ``--device cuda``.

Before the first gradient collective every rank loads its data and model and
the ranks exchange a status flag and a fingerprint of the configuration in one
small all-reduce: a rank that failed, or was started with a different
configuration, makes every rank stop with an error instead of hanging.

Optimisation
------------
``--optimizer sgd`` (default for mlp/cnn; L2 weight decay on every parameter)
or ``adamw`` (default for gpt; decoupled weight decay on matrices and
embeddings only, not on biases and LayerNorm gains, as in GPT-2 practice).
``--lr-schedule cosine`` warms up linearly over ``--warmup-lr-steps`` steps
and then follows a half cosine down to ``--min-lr`` at the last step
(``constant``: warm-up, then constant). ``--grad-clip C`` clips the global
gradient norm to ``C`` after ``backward()`` and before the optimizer step
(with a DDP comm hook this is the synchronised gradient). Options that do not
apply to the chosen model, optimizer or method are refused, not ignored.

Methods whose optimizer owns the synchronisation (see
``SYNC_OPTIMIZER_BUILDERS``) train the bare model without DDP: each rank runs
``loss.backward()`` on its own data, ``--grad-clip`` clips the local
gradient, and ``opt.step()`` decides what is communicated and when.

Timing: ``train_time_s`` is the wall time spent in training steps (forward,
backward, communication, optimizer), excluding evaluation; for IST it includes
the ``synchronize()`` that precedes each evaluation. Time-to-target is the
``train_time_s`` of the first evaluation whose metric reaches the target:
test accuracy >= ``--target-acc`` (mlp, cnn) or validation loss <=
``--target-loss`` (gpt).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .workloads import data as data_mod
from .workloads import models as models_mod
from .workloads import text as text_mod
from .agreement import agree_across_ranks
from .report import RESULT_FORMAT, compare_table, compute_config_key, plot_results, setting_summary
from .wire import WireCounter

log = logging.getLogger("slimcomm.train" if __name__ == "__main__" else __name__)

__all__ = ["METHODS", "MODELS", "build_parser", "build_model", "apply_method_defaults", "run", "compare_table",
           "plot_results", "main"]

METHODS = ("ddp", "fp16", "powersgd", "topk", "slimdp", "ist", "diloco", "sparseloco", "slimdp-local")
MODELS = ("mlp", "cnn", "gpt")

GPT_DEFAULTS = {"n_layer": 2, "n_embd": 192, "n_head": 3, "block_size": 64, "batch_size": 4, "steps": 1000,
                "warmup_lr_steps": 30, "eval_every": 50, "val_batches": 16}
"""Defaults of ``--model gpt`` (see the README for why this size: DDP is network-bound at 100 Mbit/s)."""
BYTES_DEFINITION = (
    "payload bytes each rank hands to collectives (all_reduce input size or own all_gather contribution), "
    "summed over training steps; a ring all-reduce puts 2(W-1)/W times this on each rank's link"
)


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------

def _int_in(name, lo, hi=None):
    """argparse type: an integer in [lo, hi] (hi None = unbounded), errors naming the flag."""
    def conv(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {s!r}")
        if v < lo or (hi is not None and v > hi):
            bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {v}")
        return v
    return conv


def _positive_int(name):
    return _int_in(name, 1)


def _nonneg_int(name):
    return _int_in(name, 0)


def _ratio(name):
    def conv(s):
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {s!r}")
        if not 0.0 < v <= 1.0:
            raise argparse.ArgumentTypeError(f"must be in (0, 1], got {v}")
        return v
    return conv


def _positive_float(name):
    def conv(s):
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {s!r}")
        if not v > 0 or not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a positive finite number, got {s!r}")
        return v
    return conv


def _float_range(name, lo, hi=None, *, lo_open=False, hi_open=True):
    """argparse type: a finite float in the interval from lo to hi (hi None = unbounded), errors naming the flag."""
    def conv(s):
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {s!r}")
        ok = math.isfinite(v) and (v > lo if lo_open else v >= lo)
        if hi is not None:
            ok = ok and (v < hi if hi_open else v <= hi)
        if not ok:
            left = "(" if lo_open else "["
            right = ")" if hi is None or hi_open else "]"
            bound = f"in {left}{lo:g}, {'inf' if hi is None else f'{hi:g}'}{right}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {s!r}")
        return v
    return conv


def _nonneg_float(name):
    return _float_range(name, 0.0)


def _hidden(s: str):
    try:
        sizes = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {s!r}")
    if not sizes or any(h < 1 for h in sizes):
        raise argparse.ArgumentTypeError(f"needs at least one positive width, got {s!r}")
    return sizes


def _methods(s: str):
    ms = [m.strip() for m in s.split(",") if m.strip()]
    bad = [m for m in ms if m not in METHODS]
    if not ms or bad:
        raise argparse.ArgumentTypeError(f"unknown method(s) {bad or s!r}; choose from {', '.join(METHODS)}")
    if len(set(ms)) != len(ms):
        raise argparse.ArgumentTypeError(f"lists a method twice: {s!r}")
    return ms


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: ...)`` unless the help text already states it, the default is unset, or the
    option is a switch (``store_true``: off unless given)."""

    def _get_help_string(self, action):
        if (action.default is None or action.default is argparse.SUPPRESS or action.nargs == 0
                or "default" in (action.help or "")):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The command's argument parser. Options left at ``None`` are filled by :func:`apply_method_defaults`."""
    p = argparse.ArgumentParser(
        prog="slimcomm-train",
        description="Data-parallel / subnet-parallel training of an MLP, a convnet or a GPT with slimcomm's "
                    "communication methods.",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("what to run")
    g.add_argument("--method", choices=METHODS, default="slimdp", help="communication method")
    g.add_argument("--compare", type=_methods, default=None, metavar="M1,M2,...",
                   help="run these methods one after another (same seed) and print one table")
    g.add_argument("--model", choices=MODELS, default="mlp",
                   help="workload: MLP or convnet on Fashion-MNIST/digits, or a GPT on a text corpus")
    g.add_argument("--plot", nargs="?", const="auto", default=None, metavar="PNG",
                   help="write a PNG of the metric (test accuracy or validation loss) vs train time and vs MB "
                        "sent per rank, one median line per configuration; without PNG: plot.png in the "
                        "run directory")
    g.add_argument("--plot-band", choices=("minmax", "iqr"), default="minmax",
                   help="band drawn around each configuration's median over seeds: min-max or interquartile range")
    g.add_argument("--plot-from", nargs="+", default=None, metavar="JSON",
                   help="with --plot PNG: table and plot of these result files instead of training; runs "
                        "are grouped by configuration (same settings, any seed: one median line with a "
                        "min-max band)")

    g = p.add_argument_group("launch")
    g.add_argument("--world-size", type=_positive_int("--world-size"), default=None,
                   help="number of ranks (default: $WORLD_SIZE under torchrun, else 2)")
    g.add_argument("--rank", type=_nonneg_int("--rank"), default=None,
                   help="run as this one rank of an externally launched job (needs --master-addr/--master-port or env)")
    g.add_argument("--master-addr", default=None, help="rendezvous address for externally launched ranks (default $MASTER_ADDR)")
    g.add_argument("--master-port", type=_positive_int("--master-port"), default=None,
                   help="rendezvous port (default $MASTER_PORT)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu uses gloo, cuda uses NCCL")
    g.add_argument("--threads", type=_positive_int("--threads"), default=None,
                   help="torch intra-op threads per rank (default: CPU cores / local ranks)")
    g.add_argument("--timeout", type=_positive_float("--timeout"), default=600.0,
                   help="seconds a collective may wait before the job fails")
    g.add_argument("--wire-iface", default=None, metavar="IFACE",
                   help="also report the bytes this network interface sent and received (kernel counters) during "
                        "training steps, per rank and per step (bench/netbench.py sets it)")

    g = p.add_argument_group("images (--model mlp / cnn)")
    g.add_argument("--dataset", choices=("auto", "fashion-mnist", "digits"), default=None,
                   help="auto: Fashion-MNIST if installed, else scikit-learn digits (default: auto)")
    g.add_argument("--data-dir", default=None, help=f"directory with the Fashion-MNIST IDX files (default {data_mod.FASHION_MNIST_DIR})")
    g.add_argument("--train-subset", type=_positive_int("--train-subset"), default=None,
                   help="use only this many training samples (all ranks together)")
    g.add_argument("--test-subset", type=_positive_int("--test-subset"), default=None,
                   help="evaluate on only the first this-many test samples")
    g.add_argument("--hidden", type=_hidden, default=None,
                   help="MLP hidden layer widths, comma-separated (default: 2048,2048)")

    g = p.add_argument_group("text (--model gpt)")
    g.add_argument("--text-file", default=None, metavar="PATH",
                   help=f"plain-text corpus (default: Debian's fortunes in {text_mod.FORTUNES_DIR}, "
                        f"`{text_mod.FORTUNES_INSTALL}`)")
    g.add_argument("--tokens", choices=text_mod.TOKENIZERS, default=None,
                   help="char: vocabulary = the corpus's characters; byte: 256 byte values (default: char)")
    g.add_argument("--n-layer", type=_positive_int("--n-layer"), default=None,
                   help=f"transformer blocks (default: {GPT_DEFAULTS['n_layer']})")
    g.add_argument("--n-embd", type=_positive_int("--n-embd"), default=None,
                   help=f"model width, a multiple of --n-head (default: {GPT_DEFAULTS['n_embd']})")
    g.add_argument("--n-head", type=_positive_int("--n-head"), default=None,
                   help=f"attention heads (default: {GPT_DEFAULTS['n_head']})")
    g.add_argument("--block-size", type=_positive_int("--block-size"), default=None,
                   help=f"context length in tokens (default: {GPT_DEFAULTS['block_size']})")
    g.add_argument("--dropout", type=_float_range("--dropout", 0.0, 1.0), default=None,
                   help="dropout probability (default: 0)")
    g.add_argument("--val-batches", type=_positive_int("--val-batches"), default=None,
                   help=f"validation batches of --batch-size x --block-size tokens, split over the ranks "
                        f"(default: {GPT_DEFAULTS['val_batches']})")

    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=_positive_int("--epochs"), default=None,
                   help="passes over each rank's shard (mlp/cnn; default: 2)")
    g.add_argument("--steps", type=_positive_int("--steps"), default=None,
                   help=f"total training steps, instead of --epochs (default: {GPT_DEFAULTS['steps']} for gpt)")
    g.add_argument("--batch-size", type=_positive_int("--batch-size"), default=None,
                   help=f"per-rank mini-batch (default: 128 images for mlp/cnn, "
                        f"{GPT_DEFAULTS['batch_size']} sequences for gpt)")
    g.add_argument("--optimizer", choices=("sgd", "adamw"), default=None,
                   help="default: sgd for mlp/cnn, adamw for gpt")
    g.add_argument("--lr", type=_positive_float("--lr"), default=None,
                   help="peak learning rate (default: AdamW 1e-3; SGD 0.05 for ddp/fp16/powersgd/ist, "
                        "0.4 for topk and 0.6 for slimdp on the MLP, 0.2 for both on the convnet)")
    g.add_argument("--momentum", type=_float_range("--momentum", 0.0, 1.0), default=None,
                   help="SGD momentum (default: 0.9 for ddp/fp16/powersgd/ist, 0 for topk/slimdp)")
    g.add_argument("--beta1", type=_float_range("--beta1", 0.0, 1.0), default=None,
                   help="AdamW beta1 (default: 0.9)")
    g.add_argument("--beta2", type=_float_range("--beta2", 0.0, 1.0), default=None,
                   help="AdamW beta2 (default: 0.99)")
    g.add_argument("--weight-decay", type=_nonneg_float("--weight-decay"), default=None,
                   help="SGD: L2 on every parameter (default 0); AdamW: decoupled, matrices and embeddings "
                        "only (default 0.1)")
    g.add_argument("--lr-schedule", choices=("constant", "cosine"), default=None,
                   help="after the warm-up: constant, or a half cosine to --min-lr at the last step "
                        "(default: constant for mlp/cnn, cosine for gpt)")
    g.add_argument("--warmup-lr-steps", type=_nonneg_int("--warmup-lr-steps"), default=None,
                   help=f"linear learning-rate warm-up steps (default: 0 for mlp/cnn, "
                        f"{GPT_DEFAULTS['warmup_lr_steps']} for gpt)")
    g.add_argument("--min-lr", type=_nonneg_float("--min-lr"), default=None,
                   help="with --lr-schedule cosine: learning rate at the last step (default: --lr / 10)")
    g.add_argument("--grad-clip", type=_nonneg_float("--grad-clip"), default=None,
                   help="clip the global gradient norm to this after backward, before the step; 0 = off "
                        "(default: 0 for mlp/cnn, 1.0 for gpt)")
    g.add_argument("--seed", type=_int_in("--seed", 0, 2**63 - 1), default=0,
                   help="seed of the model initialisation, data order and Slim-DP/PowerSGD/IST sampling")
    g.add_argument("--bucket-cap-mb", type=_positive_float("--bucket-cap-mb"), default=25.0, help="DDP bucket size")
    g.add_argument("--eval-every", type=_nonneg_int("--eval-every"), default=None,
                   help=f"also evaluate every this many steps (0: only at the end of each epoch / of training; "
                        f"default: 0 for mlp/cnn, {GPT_DEFAULTS['eval_every']} for gpt)")
    g.add_argument("--target-acc", type=_ratio("--target-acc"), default=None,
                   help="test accuracy for time-to-target (mlp/cnn; default: 0.85)")
    g.add_argument("--target-loss", type=_positive_float("--target-loss"), default=None,
                   help="validation loss (nats/token) for time-to-target (gpt; default: none)")
    g.add_argument("--stop-at-target", action="store_true",
                   help="stop training at the first evaluation that reaches --target-acc / --target-loss")

    g = p.add_argument_group("powersgd")
    g.add_argument("--powersgd-rank", type=_positive_int("--powersgd-rank"), default=4,
                   help="matrix_approximation_rank")
    g.add_argument("--powersgd-start-iter", type=_int_in("--powersgd-start-iter", 2), default=2,
                   help="dense all-reduce steps before compression starts (>= 2: PowerSGD's error "
                        "feedback needs a dense warm-up)")

    g = p.add_argument_group("topk / slimdp (slimcomm.hooks.SlimDPState)")
    g.add_argument("--core-ratio", type=_ratio("--core-ratio"), default=None,
                   help="core set size / parameter numel (default: 0.01; sparseloco: 64/4096, its per-chunk k)")
    g.add_argument("--explore-ratio", type=_ratio("--explore-ratio"), default=None,
                   help="explore set size / parameter numel (default: 0.01; sparseloco: 0)")
    g.add_argument("--core-refresh", type=_positive_int("--core-refresh"), default=10,
                   help="steps between core set refreshes (slimdp)")
    g.add_argument("--warmup-steps", type=_int_in("--warmup-steps", 2), default=2,
                   help="dense all-reduce steps first (>= 2)")
    g.add_argument("--value-dtype", choices=("fp32", "bf16", "fp16"), default="bf16", help="dtype of values on the wire")

    g = p.add_argument_group("diloco / sparseloco / slimdp-local (slimcomm.optim.SlimDPOptimizer)")
    g.add_argument("--sync-every", type=_positive_int("--sync-every"), default=None,
                   help="local steps H between synchronisations (default: diloco 24, sparseloco 15, "
                        "slimdp-local 3)")
    g.add_argument("--outer-lr", type=_positive_float("--outer-lr"), default=None,
                   help="outer learning rate (default: diloco 0.7, sparseloco 1.0, slimdp-local 1.4)")
    g.add_argument("--outer-momentum", type=_nonneg_float("--outer-momentum"), default=None,
                   help="outer Nesterov momentum (default: diloco 0.9, others 0)")
    g.add_argument("--value-bits", type=int, choices=(1, 2, 4, 8), default=None,
                   help="low-bit values instead of --value-dtype (default: slimdp-local 2)")
    g.add_argument("--error-decay", type=_ratio("--error-decay"), default=None,
                   help="error-feedback decay beta (default: sparseloco 0.95, others 1)")

    g = p.add_argument_group("ist (slimcomm.ist.ISTTrainer)")
    g.add_argument("--local-steps", type=_positive_int("--local-steps"), default=10,
                   help="local steps per synchronisation round")

    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="results JSON path (single method; default OUT_DIR/METHOD.json)")
    g.add_argument("--out-dir", default=None,
                   help="directory for results JSONs (default: a new runs/YYYYmmdd-HHMMSS-PID/ per "
                        "invocation, so no earlier result is replaced)")
    g.add_argument("--no-progress", action="store_true",
                   help="no tqdm progress bars (they are shown only when stderr is a terminal anyway)")
    g.add_argument("--quiet", action="store_true",
                   help="no progress bars, and log only warnings and errors (as --log-level WARNING)")
    g.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=None,
                   help="level of the log messages on stderr (data set, corpus, run directory, "
                        "library diagnostics); results tables always go to stdout (default: INFO, "
                        "WARNING with --quiet)")
    g.add_argument("--version", action="version", version=f"slimcomm {_slimcomm_version()}")
    return p


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def log_level(args: argparse.Namespace) -> str:
    """The effective ``--log-level``: as given, else WARNING with ``--quiet``, else INFO."""
    if getattr(args, "log_level", None):
        return args.log_level
    return "WARNING" if getattr(args, "quiet", False) else "INFO"


def setup_logging(level: str, rank: Optional[int] = None) -> None:
    """Configure the root logger for the command: ``level`` on stderr; ranks other than 0 log warnings only.

    Called by :func:`main` and in every spawned rank (a spawned process starts without the parent's
    logging configuration). ``force=True`` replaces an earlier configuration of this process.
    """
    if rank is not None and rank > 0 and logging.getLevelName(level) < logging.WARNING:
        level = "WARNING"
    fmt = LOG_FORMAT if rank is None else f"[rank {rank}] {LOG_FORMAT}"
    logging.basicConfig(level=level, format=fmt, stream=sys.stderr, force=True)


def _slimcomm_version() -> str:
    from ._version import __version__

    return __version__


def _resolve_launch(args: argparse.Namespace) -> None:
    """Fill world_size / external-rank settings from flags and environment; validate."""
    env = os.environ
    external = args.rank is not None or ("RANK" in env and "WORLD_SIZE" in env)
    if external:
        if args.rank is None:
            args.rank = int(env["RANK"])
        if args.world_size is None:
            if "WORLD_SIZE" not in env:
                raise SystemExit("error: --rank given without --world-size (or $WORLD_SIZE)")
            args.world_size = int(env["WORLD_SIZE"])
        if args.rank >= args.world_size:
            raise SystemExit(f"error: --rank {args.rank} must be < --world-size {args.world_size}")
        args.master_addr = args.master_addr or env.get("MASTER_ADDR")
        if args.master_port is None and env.get("MASTER_PORT"):
            args.master_port = int(env["MASTER_PORT"])
        if not args.master_addr or args.master_port is None:
            raise SystemExit("error: an externally launched rank needs --master-addr and --master-port "
                             "(or $MASTER_ADDR and $MASTER_PORT)")
        args.local_rank = int(env.get("LOCAL_RANK", 0))
        args.local_world_size = int(env.get("LOCAL_WORLD_SIZE", 1))
    else:
        if args.world_size is None:
            args.world_size = 2
        args.local_rank = None
        args.local_world_size = args.world_size
    args.external = external
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda but torch.cuda.is_available() is False")
        if not external and args.world_size > torch.cuda.device_count():
            raise SystemExit(f"error: --world-size {args.world_size} exceeds the {torch.cuda.device_count()} visible GPUs")
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // max(1, args.local_world_size))
    if (args.core_ratio or 0.0) + (args.explore_ratio or 0.0) > 1.0:
        raise SystemExit("error: --core-ratio + --explore-ratio must be <= 1")
    if args.out is not None and os.path.isdir(args.out):
        raise SystemExit(f"error: --out {args.out} is a directory; --out names the results JSON file "
                         "(use --out-dir for a directory)")
    for m in (args.compare or [args.method]):  # every method's combination of options, before anything runs
        apply_method_defaults(argparse.Namespace(**dict(vars(args), method=m)))


# ---------------------------------------------------------------------------
# Model and methods
# ---------------------------------------------------------------------------

build_model = models_mod.build_mlp  # the MLP builder, kept under its old name


_VALUE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

METHOD_DEFAULTS = {
    # Sparsified methods with error feedback (topk, slimdp) default to plain SGD: heavy-ball
    # momentum applied to the sparse, residual-delayed updates over-shoots (Lin et al., Deep
    # Gradient Compression, arXiv 1712.01887, Sec. 3.2 "momentum correction"); measured here on
    # Fashion-MNIST, MLP 784-2048-2048-10, 2 ranks, batch 128: slimdp with momentum 0.9 / lr 0.05
    # missed 0.85 test accuracy in 2 epochs (2 seeds); plain SGD at lr 0.6 (slimdp, core refresh
    # 10) or 0.4 (topk) reached it in 170-190 steps, as fast as ddp at lr 0.05 / momentum 0.9
    # (bench/results/netbench_sweeps/steps_to_target.md). SGD only; AdamW uses ADAMW_DEFAULTS.
    "topk": {"lr": 0.4, "momentum": 0.0},
    "slimdp": {"lr": 0.6, "momentum": 0.0},
}
CNN_METHOD_DEFAULTS = {
    # The MLP's topk/slimdp learning rates diverge on the convnet (digits, 1 epoch, 2 ranks, batch 16:
    # test accuracy 0.09 / 0.29 at lr 0.4 / 0.6); lr 0.2 without momentum gave 0.97 / 0.75 there
    # (slimdp: 0.69 at 0.1, 0.68 at 0.3, 0.45 at 0.4, 0.39 at 0.05 with momentum 0.9). One seed on
    # the small digits set: a working default, not a tuned one.
    "topk": {"lr": 0.2, "momentum": 0.0},
    "slimdp": {"lr": 0.2, "momentum": 0.0},
}
_COMMON_DEFAULTS = {"lr": 0.05, "momentum": 0.9}
ADAMW_DEFAULTS = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1}

_IMAGE_ONLY = ("dataset", "data_dir", "train_subset", "test_subset", "hidden", "epochs", "target_acc")
_TEXT_ONLY = ("text_file", "tokens", "n_layer", "n_embd", "n_head", "block_size", "dropout", "val_batches",
              "target_loss")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def apply_method_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every option left unset (``None``) from ``--model``, ``--optimizer`` and ``--method``, in place.

    Idempotent. Options that do not apply stay ``None`` (e.g. ``--momentum``
    under AdamW, ``--hidden`` for the GPT) and are refused when given.

    Raises:
        SystemExit: ``"error: ..."`` naming the flag, when an option does not
            apply to the chosen model, optimizer or method, or options
            contradict each other (``--method ist`` without ``--model mlp``,
            ``--grad-clip`` with ist, ``--steps`` with ``--epochs``,
            ``--min-lr`` above ``--lr`` or without a cosine schedule,
            ``--n-embd`` not a multiple of ``--n-head``, ``--warmup-lr-steps``
            beyond ``--steps``).
    """
    def bad(msg):
        raise SystemExit(f"error: {msg}")

    def given(name):
        return getattr(args, name, None) is not None

    model = getattr(args, "model", None) or "mlp"
    args.model = model
    lm = model == "gpt"
    if args.method == "ist" and model != "mlp":
        bad(f"--method ist needs --model mlp (IST partitions the hidden neurons of an nn.Sequential MLP); "
            f"got --model {model}")
    if lm:
        for name in _IMAGE_ONLY:
            if given(name):
                bad(f"{_flag(name)} applies to --model mlp/cnn, not --model gpt")
        for name in ("n_layer", "n_embd", "n_head", "block_size", "val_batches", "steps", "batch_size",
                     "eval_every"):
            if not given(name):
                setattr(args, name, GPT_DEFAULTS[name])
        if not given("warmup_lr_steps"):
            args.warmup_lr_steps = min(GPT_DEFAULTS["warmup_lr_steps"], args.steps)
        if not given("tokens"):
            args.tokens = "char"
        if not given("dropout"):
            args.dropout = 0.0
        if args.n_embd % args.n_head:
            bad(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
        if args.warmup_lr_steps > args.steps:
            bad(f"--warmup-lr-steps {args.warmup_lr_steps} exceeds --steps {args.steps}")
    else:
        for name in _TEXT_ONLY:
            if given(name):
                bad(f"{_flag(name)} applies to --model gpt, not --model {model}")
        if model == "cnn" and given("hidden"):
            bad("--hidden sets the MLP's widths; it does not apply to --model cnn")
        if given("steps") and given("epochs"):
            bad("give --steps (total training steps) or --epochs, not both")
        if not given("dataset"):
            args.dataset = "auto"
        if model == "mlp" and not given("hidden"):
            args.hidden = (2048, 2048)
        if not given("steps") and not given("epochs"):
            args.epochs = 2
        for name, v in (("batch_size", 128), ("eval_every", 0), ("target_acc", 0.85), ("warmup_lr_steps", 0)):
            if not given(name):
                setattr(args, name, v)
    if not given("optimizer"):
        args.optimizer = "adamw" if lm else "sgd"
    if args.optimizer == "sgd":
        for name in ("beta1", "beta2"):
            if given(name):
                bad(f"{_flag(name)} applies to --optimizer adamw, not sgd")
        d = (CNN_METHOD_DEFAULTS if model == "cnn" else METHOD_DEFAULTS).get(args.method, _COMMON_DEFAULTS)
        if not given("lr"):
            args.lr = d["lr"]
        if not given("momentum"):
            args.momentum = d["momentum"]
        if not given("weight_decay"):
            args.weight_decay = 0.0
    else:
        if given("momentum"):
            bad("--momentum applies to --optimizer sgd; AdamW takes --beta1/--beta2")
        for name, v in ADAMW_DEFAULTS.items():
            if not given(name):
                setattr(args, name, v)
    if not given("lr_schedule"):
        args.lr_schedule = "cosine" if lm else "constant"
    if args.lr_schedule == "constant":
        if given("min_lr"):
            bad("--min-lr applies to --lr-schedule cosine")
    else:
        if not given("min_lr"):
            args.min_lr = args.lr / 10
        if args.min_lr > args.lr:
            bad(f"--min-lr {args.min_lr:g} must be <= --lr {args.lr:g}")
    if not given("grad_clip"):
        args.grad_clip = 1.0 if lm else 0.0
    sync = SYNC_DEFAULTS.get(args.method)
    for name in ("sync_every", "outer_lr", "outer_momentum", "value_bits", "error_decay"):
        if sync is None and given(name):
            bad(f"{_flag(name)} applies to --method {'/'.join(SYNC_DEFAULTS)}, not {args.method}")
        if sync is not None and not given(name):
            setattr(args, name, sync[name])
    if sync is not None and args.outer_momentum >= 1:
        bad(f"--outer-momentum {args.outer_momentum:g} must be < 1")
    if not given("core_ratio"):
        args.core_ratio = sync.get("core_ratio", 0.01) if sync else 0.01
    if not given("explore_ratio"):
        args.explore_ratio = sync.get("explore_ratio", 0.01) if sync else 0.01
    if args.method == "ist" and args.grad_clip > 0:
        bad("--grad-clip does not apply to --method ist (ISTTrainer.step runs backward and the optimizer step "
            "itself)")
    return args


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str, final_ratio: float) -> float:
    """Learning-rate multiplier for the 0-based ``step`` of ``total_steps``.

    Linear warm-up ``(step + 1) / warmup_steps`` for the first
    ``warmup_steps`` steps; then ``1`` (``schedule="constant"``) or a half
    cosine from ``1`` down to ``final_ratio`` (``= min_lr / lr``) reached at
    the last step ``total_steps - 1`` (``"cosine"``). Steps past the end stay
    at ``final_ratio``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _make_optimizer(params, args, lr: Optional[float] = None) -> torch.optim.Optimizer:
    """SGD (L2 on every parameter) or AdamW (decoupled decay on tensors with ndim >= 2 only)."""
    lr = args.lr if lr is None else lr
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    params = list(params)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(args.beta1, args.beta2))


# ---------------------------------------------------------------------------
# Methods whose optimizer owns the synchronisation (no DDP)
# ---------------------------------------------------------------------------
#
# A builder here maps a method name to ``builder(args, model, inner) -> optimizer`` where
# ``inner`` is the torch optimizer built by _make_optimizer over ``model.parameters()`` (the
# learning-rate schedule drives ``inner``). The returned object owns every collective:
# ``step()`` (after the training loop's ``loss.backward()`` and the --grad-clip of the LOCAL
# gradient), ``zero_grad(set_to_none=True)``, ``stats`` (a dict with
# ``stats["total"]["bytes_sent"]``: payload bytes per rank by the module-level definition) and
# ``state_dict()``. The model is not wrapped in DDP. The slimcomm.optim.SlimDPOptimizer methods
# (diloco, sparseloco, slimdp-local) are wired here, with their names added to METHODS and their
# options to build_parser, once that class lands, e.g.
#
#     def _build_diloco(args, model, inner):
#         from .optim import SlimDPOptimizer
#         return SlimDPOptimizer(model, inner, sync_every=args.sync_every, compression="dense",
#                                outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
#                                nesterov=True, seed=args.seed)
#     SYNC_OPTIMIZER_BUILDERS["diloco"] = _build_diloco
#
# Between synchronisations the replicas differ, so an evaluation there averages the per-rank
# models' losses; such methods should evaluate at synchronisation steps (--eval-every a
# multiple of the sync period).
SYNC_OPTIMIZER_BUILDERS: Dict[str, Callable[[argparse.Namespace, nn.Module, torch.optim.Optimizer], Any]] = {}

# Per-method defaults of the local-step methods. diloco: the outer optimizer of Douillard et al.
# (arXiv 2311.08105, Sec. 3: Nesterov, lr 0.7, momentum 0.9); H = 24 instead of the paper's 500
# (1000-step runs here; H = 24 sends 2.1% of DDP's bytes per step in bf16). sparseloco: Sarfi et
# al. (arXiv 2508.15706): H = 15, error-feedback decay 0.95, top-k 64 of 4096 (1.56%), outer lr
# 1 -- with per-tensor top-k and bf16 values instead of the paper's 64x64 chunks and 2-bit
# values. slimdp-local: the measured best rule at <= 3% of DDP's bytes (bench/results/
# adamw_design.md): H = 3, every coordinate as a 2-bit code with error feedback; outer lr 1.4
# (GPT default, batch 4, seed 0, 1000 steps, val loss vs DDP's 2.1336: outer lr 1.0 2.1715,
# 1.4 2.1603, 1.7 2.1700; at batch 8: 1.0 2.0550, 1.4 2.0373, 2.0 2.4282 vs DDP 2.0098).
SYNC_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "diloco": dict(sync_every=24, outer_lr=0.7, outer_momentum=0.9, value_bits=None, error_decay=1.0),
    "sparseloco": dict(sync_every=15, outer_lr=1.0, outer_momentum=0.0, value_bits=None,
                       error_decay=0.95, core_ratio=64 / 4096, explore_ratio=0.0),
    "slimdp-local": dict(sync_every=3, outer_lr=1.4, outer_momentum=0.0, value_bits=2, error_decay=1.0),
}


def _build_sync_optimizer(args, model, inner):
    from .optim import SlimDPOptimizer

    m = args.method
    kw = dict(sync_every=args.sync_every, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
              nesterov=args.outer_momentum > 0, error_decay=args.error_decay, seed=args.seed,
              value_dtype=_VALUE_DTYPES[args.value_dtype] or torch.float32,
              value_bits=args.value_bits, bucket_cap_mb=args.bucket_cap_mb)
    if m == "diloco":
        kw.update(compression="dense")
    elif m == "sparseloco":
        kw.update(compression="local", score="grad", core_ratio=args.core_ratio,
                  explore_ratio=args.explore_ratio)
    else:
        full = args.core_ratio + args.explore_ratio >= 1 or args.value_bits is not None
        kw.update(compression="dense" if full else "shared", core_ratio=args.core_ratio,
                  explore_ratio=args.explore_ratio, core_refresh=args.core_refresh)
    return SlimDPOptimizer(model, inner, **kw)


for _m in SYNC_DEFAULTS:
    SYNC_OPTIMIZER_BUILDERS[_m] = _build_sync_optimizer


class _Method:
    """One training method: owns the (wrapped) model, the optimizer, the LR schedule and the byte accounting.

    Args:
        args: the resolved options.
        model: the full model (identical initial weights on every rank).
        world_size: number of ranks.
        loss_fn: ``loss_fn(output, target) -> scalar tensor`` (mean over the batch).
        total_steps: planned training steps (the end of the cosine schedule).
        classify: count correct predictions (``argmax(1) == y``) in :meth:`train_step`.
    """

    def __init__(self, args, model: nn.Module, world_size: int, loss_fn: Callable, total_steps: int,
                 classify: bool):
        self.args = args
        self.name = args.method
        self.model = model
        self.world_size = world_size
        self.loss_fn = loss_fn
        self.classify = classify
        self.params = list(model.parameters())
        self.num_params = sum(p.numel() for p in self.params)
        self.dense_step_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self.clip = float(args.grad_clip)
        self.steps = 0
        self.hook_state = None
        self.trainer = None
        self.ddp = None
        self.sched = None
        self.sync_optimizer = args.method in SYNC_OPTIMIZER_BUILDERS
        final_ratio = args.min_lr / args.lr if args.lr_schedule == "cosine" else 1.0
        self._scheduled = args.lr_schedule != "constant" or args.warmup_lr_steps > 0

        def factor(step):
            return lr_factor(step, total_steps, args.warmup_lr_steps, args.lr_schedule, final_ratio)

        self._factor = factor
        m = self.name
        if m == "ist":
            from .ist import ISTTrainer

            # The trainer builds a fresh optimizer every round; it starts at the schedule's lr
            # for the round's first step, and train_step keeps it on the schedule.
            self.trainer = ISTTrainer(
                model,
                lambda params: _make_optimizer(params, args, lr=args.lr * factor(self.steps)),
                local_steps=args.local_steps,
                seed=args.seed,
            )
            return
        if self.sync_optimizer:
            inner = _make_optimizer(model.parameters(), args)
            self.opt = SYNC_OPTIMIZER_BUILDERS[m](args, model, inner)
            self.forward_model = model
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            dev_ids = [model_device(model).index] if args.device == "cuda" else None
            self.ddp = DDP(model, device_ids=dev_ids, bucket_cap_mb=args.bucket_cap_mb)
            self.forward_model = self.ddp
            if m == "fp16":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                self.ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif m == "powersgd":
                from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

                self.hook_state = psgd.PowerSGDState(
                    process_group=None,
                    matrix_approximation_rank=args.powersgd_rank,
                    start_powerSGD_iter=args.powersgd_start_iter,
                    use_error_feedback=True,
                    warm_start=True,
                    random_seed=args.seed,
                )
                self.ddp.register_comm_hook(self.hook_state, psgd.powerSGD_hook)
            elif m in ("topk", "slimdp"):
                from .hooks import SlimDPState, slim_dp_hook

                kw = dict(
                    core_ratio=args.core_ratio,
                    explore_ratio=args.explore_ratio,
                    core_refresh=args.core_refresh,
                    index_mode="local" if m == "topk" else "shared",
                    value_dtype=_VALUE_DTYPES[args.value_dtype],
                    seed=args.seed,
                    warmup_steps=args.warmup_steps,
                )
                self.hook_state = SlimDPState(**kw).attach(model)
                self.ddp.register_comm_hook(self.hook_state, slim_dp_hook)
            inner = self.opt = _make_optimizer(self.ddp.parameters(), args)
        if self._scheduled:
            self.sched = torch.optim.lr_scheduler.LambdaLR(inner, factor)

    def train_step(self, x: torch.Tensor, y: torch.Tensor):
        """One training step; returns (loss float, number correct or None)."""
        self.steps += 1
        if self.trainer is not None:
            loss = self.trainer.step(x, y, self.loss_fn)
            if self._scheduled:  # lr of the next step, on the current round's optimizer
                lr = self.args.lr * self._factor(self.steps)
                for group in self.trainer.optimizer.param_groups:
                    group["lr"] = lr
            return float(loss), None
        self.opt.zero_grad(set_to_none=True)
        out = self.forward_model(x)
        loss = self.loss_fn(out, y)
        loss.backward()  # DDP: the comm hook has synchronised the gradient; sync optimizer: local only
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        correct = int((out.detach().argmax(1) == y).sum()) if self.classify else None
        return float(loss.detach()), correct

    def before_eval(self):
        if self.trainer is not None:
            self.trainer.synchronize()

    def eval_model(self) -> nn.Module:
        return self.model

    def eval_context(self):
        """Local-step methods evaluate the outer (global) parameters, identical on every rank."""
        if self.sync_optimizer:
            return self.opt.outer_weights()
        return contextlib.nullcontext()

    def bytes_sent(self) -> int:
        """Bytes sent per rank so far, by the module-level definition."""
        m = self.name
        if self.sync_optimizer:
            return int(self.opt.stats["total"]["bytes_sent"])
        if m == "ddp":
            return self.steps * self.dense_step_bytes
        if m == "fp16":
            return self.steps * self.num_params * 2
        if m == "powersgd":
            st = self.hook_state
            dense_steps = min(self.steps, st.start_powerSGD_iter)
            return dense_steps * self.dense_step_bytes + 4 * int(st.total_numel_after_compression)
        if m in ("topk", "slimdp"):
            return int(self.hook_state.stats["total"]["bytes_sent"])
        # IST: ISTStats.bytes_sent is the ring all-gather's link traffic, (W - 1) x the padded
        # buffer each rank hands to all_gather per round; the payload definition is that buffer.
        st = self.trainer.stats
        return int(st.bytes_sent) // (self.world_size - 1) if self.world_size > 1 else 0

    def stats(self) -> Dict[str, Any]:
        if self.sync_optimizer:
            return _jsonable(self.opt.stats)
        if self.name == "powersgd":
            rate, before, after = self.hook_state.compression_stats()
            return {"compression_rate": rate, "numel_before_compression": before,
                    "numel_after_compression": after, "iter": self.hook_state.iter}
        if self.hook_state is not None:
            return _jsonable(self.hook_state.stats)
        if self.trainer is not None:
            return _jsonable(self.trainer.stats)
        return {}


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist() if obj.numel() > 1 else obj.item()
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _jsonable(getattr(obj, k)) for k in obj.__dataclass_fields__}
    if hasattr(obj, "_asdict"):
        return _jsonable(obj._asdict())
    if hasattr(obj, "__dict__"):
        return _jsonable(vars(obj))
    return repr(obj)


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


# ---------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------

def _config_fingerprint(args, extra) -> int:
    keys = ("method", "model", "world_size", "dataset", "train_subset", "hidden", "epochs", "steps", "batch_size",
            "optimizer", "lr", "momentum", "beta1", "beta2", "weight_decay", "lr_schedule", "warmup_lr_steps",
            "min_lr", "grad_clip", "seed", "powersgd_rank", "powersgd_start_iter", "core_ratio", "explore_ratio",
            "core_refresh", "warmup_steps", "value_dtype", "local_steps", "eval_every", "device", "tokens",
            "n_layer", "n_embd", "n_head", "block_size", "dropout", "val_batches", "sync_every", "outer_lr",
            "outer_momentum", "value_bits", "error_decay")
    s = json.dumps([[k, getattr(args, k)] for k in keys] + [extra], default=str)
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:6], "little")


def _agree(error: Optional[BaseException], fingerprint: int, device) -> None:
    """All ranks: exchange (failed?, fingerprint) in one all-reduce; raise if anyone failed or disagrees.

    A rank that failed re-raises its own ``error``; the others raise a
    ``RuntimeError`` pointing at it.
    """
    if agree_across_ranks({"configuration": fingerprint}, error, device=device,
                          other_failed="another rank failed during setup (data or model); see its error"):
        raise RuntimeError("ranks were started with different configurations (method, data, model or "
                           "hyperparameters differ); every rank must get the same flags")


@torch.no_grad()
def _evaluate(model, x, y, rank, world_size, device):
    """Test loss and accuracy over the whole test set, split across ranks; one scalar all-reduce."""
    was = model.training
    model.eval()
    xs, ys = x[rank::world_size], y[rank::world_size]
    correct = 0.0
    loss_sum = 0.0
    for i in range(0, xs.shape[0], 2048):
        out = model(xs[i:i + 2048])
        loss_sum += float(F.cross_entropy(out, ys[i:i + 2048], reduction="sum"))
        correct += float((out.argmax(1) == ys[i:i + 2048]).sum())
    t = torch.tensor([correct, loss_sum, float(xs.shape[0])], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    model.train(was)
    return t[0].item() / t[2].item(), t[1].item() / t[2].item()


def _worker(rank: int, args: argparse.Namespace, init_method: str) -> Optional[Dict[str, Any]]:
    """Body of one rank. Returns the results dict on rank 0 (also written to args.out), else None."""
    setup_logging(log_level(args), rank)
    torch.set_num_threads(args.threads)
    world_size = args.world_size
    if args.device == "cuda":
        local = args.local_rank if args.local_rank is not None else rank
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    try:
        result = _train(rank, world_size, args, device, backend)
        # every rank is done with its collectives before any rank tears the group down (a rank
        # destroying its gloo group while a peer still finishes the last exchange was seen to
        # abort at exit: "terminate called without an active exception")
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


class _ImageTask:
    """``--model mlp`` / ``cnn``: per-rank shards of Fashion-MNIST or digits; metric: test accuracy."""

    metric = {"name": "test_acc", "goal": "max", "unit": "accuracy"}
    classify = True

    def __init__(self, args, rank: int, world_size: int, device):
        self.args, self.rank = args, rank
        ds = data_mod.load_dataset(args.dataset, args.data_dir,
                                   log=data_mod.logger.warning if rank == 0 else None)
        shard = data_mod.shard_indices(ds.x_train.shape[0], rank, world_size, seed=args.seed,
                                       subset=args.train_subset)
        if args.batch_size > shard.numel():
            raise ValueError(f"--batch-size {args.batch_size} is larger than the per-rank shard ({shard.numel()} samples)")
        x_train = ds.x_train[shard]
        x_test, y_test = ds.x_test, ds.y_test
        if args.test_subset is not None:
            x_test, y_test = x_test[: args.test_subset], y_test[: args.test_subset]
        if x_test.shape[0] < world_size:
            raise ValueError(f"--test-subset {x_test.shape[0]} must be >= --world-size {world_size}")
        self.side = None
        if args.model == "cnn":
            side = math.isqrt(ds.num_features)
            if side * side != ds.num_features:
                raise ValueError(f"--model cnn needs square single-channel images; {ds.name} has "
                                 f"{ds.num_features} features per sample")
            self.side = side
            x_train, x_test = x_train.view(-1, 1, side, side), x_test.reshape(-1, 1, side, side)
        self.x_train, self.y_train = x_train.to(device), ds.y_train[shard].to(device)
        self.x_test, self.y_test = x_test.to(device), y_test.to(device)
        torch.manual_seed(args.seed)
        if args.model == "cnn":
            self.model = models_mod.ConvNet(num_classes=ds.num_classes, in_channels=1, image_size=self.side)
        else:
            self.model = models_mod.build_mlp(ds.num_features, args.hidden, ds.num_classes)
            if args.method == "ist" and min(args.hidden) < world_size:
                raise ValueError(f"--hidden {args.hidden}: IST needs every hidden width >= --world-size {world_size}")
        self.model = self.model.to(device)
        self.ds, self.shard_size, self.device = ds, int(shard.numel()), device
        self.steps_per_epoch = self.shard_size // args.batch_size
        self.total_steps = args.steps if args.steps is not None else args.epochs * self.steps_per_epoch
        self.num_epochs = -(-self.total_steps // self.steps_per_epoch)
        if args.warmup_lr_steps > self.total_steps:
            raise ValueError(f"--warmup-lr-steps {args.warmup_lr_steps} exceeds the {self.total_steps} training steps")
        self.fingerprint_extra = [ds.name, self.shard_size]

    loss_fn = staticmethod(F.cross_entropy)

    def segments(self):
        """``(epoch, steps, get)`` per epoch; ``get(i)`` gives batch ``i``; the last epoch may be partial (--steps)."""
        left, epoch = self.total_steps, 0
        while left > 0:
            idx = data_mod.epoch_batches(self.shard_size, self.args.batch_size, epoch, self.args.seed, self.rank)
            idx = idx[:left]
            yield epoch, len(idx), (lambda i, idx=idx: (self.x_train[idx[i]], self.y_train[idx[i]]))
            left -= len(idx)
            epoch += 1

    def progress(self, epoch: int, steps_done: int) -> Dict[str, Any]:
        return {"epoch": round(epoch + steps_done / self.steps_per_epoch, 4)}

    def bar_label(self, epoch) -> str:
        return f"epoch {epoch + 1}/{self.num_epochs}"

    def evaluate(self, model, world_size) -> Dict[str, float]:
        acc, loss = _evaluate(model, self.x_test, self.y_test, self.rank, world_size, self.device)
        return {"test_acc": acc, "test_loss": loss}

    def reached(self, rec) -> Optional[float]:
        """The target if ``rec`` reaches it, else None."""
        return self.args.target_acc if rec["test_acc"] >= self.args.target_acc else None

    def describe(self) -> Dict[str, Any]:
        ds = self.ds
        return {"name": ds.name, "source": ds.source, "train_samples_per_rank": self.shard_size,
                "test_samples": int(self.x_test.shape[0]), "features": ds.num_features}

    def model_info(self) -> Dict[str, Any]:
        if self.args.model == "cnn":
            return {"name": "cnn", "image_size": self.side}
        return {"name": "mlp", "hidden": list(self.args.hidden)}


class _TextTask:
    """``--model gpt``: random windows from per-rank shards of a text corpus; metric: validation loss."""

    metric = {"name": "val_loss", "goal": "min", "unit": "nats/token"}
    classify = False
    steps_per_epoch = None

    def __init__(self, args, rank: int, world_size: int, device):
        self.args, self.rank, self.device = args, rank, device
        corpus = text_mod.load_corpus(args.text_file, args.tokens)
        self.corpus = corpus
        self.windows = text_mod.TrainWindows(corpus.train, args.block_size, args.batch_size, rank, world_size,
                                             seed=args.seed)
        self.val = [(x.to(device), y.to(device)) for x, y in
                    text_mod.validation_batches(corpus.val, args.block_size, args.batch_size, args.val_batches)]
        torch.manual_seed(args.seed)
        self.model = models_mod.GPT(corpus.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                                    n_embd=args.n_embd, n_head=args.n_head, dropout=args.dropout).to(device)
        # dropout masks: a different stream per rank (the initial weights are the same everywhere)
        torch.manual_seed(text_mod._rank_seed(args.seed, rank + 1_000_003))
        self.total_steps = args.steps
        self.vocab_size = corpus.vocab_size
        self.fingerprint_extra = [corpus.name, corpus.num_tokens, corpus.vocab_size]

    def loss_fn(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def segments(self):
        dev = self.device

        def get(i):
            x, y = self.windows.next_batch()
            return x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

        yield None, self.total_steps, get

    def progress(self, epoch, steps_done) -> Dict[str, Any]:
        return {}

    def bar_label(self, epoch) -> str:
        return f"{self.total_steps} steps"

    @torch.no_grad()
    def evaluate(self, model, world_size) -> Dict[str, float]:
        """Mean validation loss (nats/token) over all validation batches; each rank takes every W-th one."""
        was = model.training
        model.eval()
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)
        for x, y in self.val[self.rank::world_size]:
            acc[0] += F.cross_entropy(model(x).reshape(-1, self.vocab_size), y.reshape(-1), reduction="sum").double()
            acc[1] += y.numel()
        dist.all_reduce(acc)
        model.train(was)
        return {"val_loss": acc[0].item() / acc[1].item()}

    def reached(self, rec) -> Optional[float]:
        t = self.args.target_loss
        return t if t is not None and rec["val_loss"] <= t else None

    def describe(self) -> Dict[str, Any]:
        c, a = self.corpus, self.args
        return {"name": c.name, "source": c.source, "tokens": c.tokenizer, "vocab_size": c.vocab_size,
                "vocab": c.vocab, "train_tokens": int(c.train.numel()), "val_tokens": int(c.val.numel()),
                "train_tokens_per_rank": int(self.windows.shard.numel()),
                "val_batches": a.val_batches, "val_tokens_evaluated": a.val_batches * a.batch_size * a.block_size}

    def model_info(self) -> Dict[str, Any]:
        a = self.args
        return {"name": "gpt", "n_layer": a.n_layer, "n_embd": a.n_embd, "n_head": a.n_head,
                "block_size": a.block_size, "vocab_size": self.vocab_size, "dropout": a.dropout}


def _train(rank, world_size, args, device, backend):
    wall0 = time.perf_counter()
    err = None
    task = None
    wire = None
    try:
        task = (_TextTask if args.model == "gpt" else _ImageTask)(args, rank, world_size, device)
        fp = _config_fingerprint(args, task.fingerprint_extra)
        wire = WireCounter(args.wire_iface) if getattr(args, "wire_iface", None) else None
    except Exception as e:  # report to the other ranks before re-raising
        err = e
        fp = 0
    _agree(err, fp, device)  # collective: every rank gets here, failed or not

    method = _Method(args, task.model, world_size, task.loss_fn, task.total_steps, task.classify)
    if rank == 0 and method.sync_optimizer and task.total_steps < (args.sync_every or 1):
        log.warning("%s: --sync-every %d is more than the %d training steps: the ranks never synchronise "
                    "and the outer model stays at its initial weights", args.method, args.sync_every,
                    task.total_steps)
    metric = task.metric["name"]
    evals: List[Dict[str, Any]] = []
    epochs: List[Dict[str, Any]] = []
    train_time = 0.0
    eval_time = 0.0
    time_to_target = None
    stop = False
    bar = None
    use_bar = rank == 0 and not args.no_progress and not args.quiet and sys.stderr.isatty()
    if use_bar:
        from tqdm import tqdm
    since = [0.0, 0]  # training loss sum and count since the last evaluation

    def do_eval(position):
        nonlocal train_time, eval_time, time_to_target
        t0 = time.perf_counter()
        with wire.window() if wire is not None else contextlib.nullcontext():
            method.before_eval()  # IST: write back + repartition (communication, counted as training)
        t1 = time.perf_counter()
        with method.eval_context():
            scores = task.evaluate(method.eval_model(), world_size)
        t2 = time.perf_counter()
        train_time += t1 - t0
        eval_time += t2 - t1
        rec = dict(position)
        rec.update({"step": method.steps, "train_time_s": train_time, "bytes_sent_per_rank": method.bytes_sent()})
        rec.update(scores)
        rec["train_loss"] = since[0] / since[1] if since[1] else None
        since[0], since[1] = 0.0, 0
        evals.append(rec)
        target = task.reached(rec)
        if time_to_target is None and target is not None:
            time_to_target = {"target": target, "metric": metric, "train_time_s": train_time,
                              "step": method.steps, "bytes_sent_per_rank": rec["bytes_sent_per_rank"]}
            time_to_target.update(position)
        return rec

    def postfix(loss_avg, rec=None):
        post = {"loss": f"{loss_avg:.4f}"}
        if rec is not None:
            post[metric] = f"{rec[metric]:.4f}"
        post["MB"] = f"{(rec['bytes_sent_per_rank'] if rec else method.bytes_sent()) / 1e6:.1f}"
        return post

    for epoch, n_steps, get in task.segments():
        if use_bar:
            bar = tqdm(total=n_steps, desc=f"{args.method} {task.bar_label(epoch)}",
                       leave=True, dynamic_ncols=True, file=sys.stderr)
        loss_sum, correct, seen, n_loss = 0.0, 0, 0, 0
        for i in range(n_steps):
            t0 = time.perf_counter()
            xb, yb = get(i)
            with wire.window(step=True) if wire is not None else contextlib.nullcontext():
                loss, corr = method.train_step(xb, yb)
            train_time += time.perf_counter() - t0
            if not math.isfinite(loss):
                raise FloatingPointError(f"rank {rank}: training loss became {loss} at step {method.steps} "
                                         f"(method {args.method}); lower --lr")
            loss_sum += loss
            n_loss += 1
            since[0] += loss
            since[1] += 1
            if corr is not None:
                correct += corr
                seen += yb.numel()
            if bar is not None:
                post = postfix(loss_sum / n_loss)
                if seen:
                    post["acc"] = f"{correct / seen:.3f}"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
            last_in_segment = i == n_steps - 1
            if args.eval_every and method.steps % args.eval_every == 0 and not last_in_segment:
                rec = do_eval(task.progress(epoch, i + 1))
                if bar is not None:
                    bar.set_postfix(postfix(loss_sum / n_loss, rec))
                if args.stop_at_target and time_to_target is not None:
                    stop = True
                    break
        rec = do_eval(task.progress(epoch, n_steps)) if not stop else evals[-1]
        if epoch is not None:
            ep = dict(rec)
            ep.update({"epoch": epoch + 1 if n_steps == task.steps_per_epoch else rec["epoch"],
                       "train_loss": loss_sum / max(1, n_loss), "train_acc": (correct / seen) if seen else None})
            epochs.append(ep)
        if bar is not None:
            bar.set_postfix(postfix(loss_sum / max(1, n_loss), rec))
            bar.close()
        if stop or (args.stop_at_target and time_to_target is not None):
            break

    wire_ranks = None
    if wire is not None:  # one small collective after training, outside the counted windows
        wire_ranks = [None] * world_size
        dist.all_gather_object(wire_ranks, wire.summary())
    final = evals[-1]
    final_scores = {k: final[k] for k in final if k in ("test_acc", "test_loss", "val_loss")}
    model_info = task.model_info()
    model_info["num_params"] = method.num_params
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
              if k not in ("compare", "plot_from", "plot_band")}
    dataset_info = task.describe()
    result = {
        "format": RESULT_FORMAT,
        "method": args.method,
        "config": config,
        # groups runs that differ only by seed (--plot-from; slimcomm.report.config_key)
        "config_key": compute_config_key(config, dataset_info["name"]),
        "world_size": world_size,
        "backend": backend,
        "metric": task.metric,
        "dataset": dataset_info,
        "model": model_info,
        "steps_per_epoch": task.steps_per_epoch,
        "planned_steps": task.total_steps,
        "steps": method.steps,
        "completed_epochs": len(epochs),
        "stopped_at_target": bool(args.stop_at_target and time_to_target is not None
                                  and method.steps < task.total_steps),
        "bytes_definition": BYTES_DEFINITION,
        "dense_bytes_per_step": method.dense_step_bytes,
        "epochs": epochs,
        "evals": evals,
        "final": dict(final_scores, train_time_s=train_time, eval_time_s=eval_time,
                      wall_time_s=time.perf_counter() - wall0, bytes_sent_per_rank=method.bytes_sent(),
                      dense_bytes_per_rank=method.steps * method.dense_step_bytes),
        "time_to_target": time_to_target,
        "wire": wire_ranks,
        "stats": method.stats(),
        "env": {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
                "threads_per_rank": args.threads},
    }
    if rank == 0:
        _write_json_atomic(result, args.out)
        return result
    return None


def _write_json_atomic(obj: Any, out: str) -> None:
    """Write ``obj`` as JSON to ``out`` through a unique temporary file in the same folder, then rename.

    Concurrent writers of the same ``out`` never share a temporary file, and
    ``out`` is always either the old file or a complete new one.
    """
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    tmp = tempfile.NamedTemporaryFile("w", dir=folder, prefix=os.path.basename(out) + ".", suffix=".tmp",
                                      delete=False)
    try:
        with tmp:
            json.dump(obj, tmp, indent=1)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp.name, 0o666 & ~umask)  # like open(): the temporary file was private (0600)
        os.replace(tmp.name, out)
    except BaseException:
        if os.path.exists(tmp.name):
            os.unlink(tmp.name)
        raise


def _spawn_entry(rank, args, init_method):
    _worker(rank, args, init_method)


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------

def run(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """Run one method (``args.method``) to completion. Returns the results dict (rank 0 / spawner), else None."""
    apply_method_defaults(args)
    if args.out is None:
        args.out = os.path.join(args.out_dir, f"{args.method}.json")
    if os.path.isdir(args.out):
        raise SystemExit(f"error: --out {args.out} is a directory; --out names the results JSON file "
                         "(use --out-dir for a directory)")
    # Paths every rank would fail on, checked once here rather than in each spawned rank's traceback.
    if args.model == "gpt" and args.text_file is not None and not os.path.isfile(args.text_file):
        raise SystemExit(f"error: --text-file {args.text_file}: no such file")
    if args.model != "gpt" and args.data_dir is not None and not os.path.isdir(args.data_dir):
        raise SystemExit(f"error: --data-dir {args.data_dir}: no such directory (the folder with the "
                         "Fashion-MNIST IDX files; omit it to use the installed data set)")
    if args.external:
        os.environ["MASTER_ADDR"] = str(args.master_addr)
        os.environ["MASTER_PORT"] = str(args.master_port)
        return _worker(args.rank, args, "env://")
    import torch.multiprocessing as mp

    # A previous result stays in place until rank 0 atomically replaces it, so a
    # failed run loses nothing; a run that ends without rewriting it is an error.
    before = os.stat(args.out).st_mtime_ns if os.path.exists(args.out) else None
    with tempfile.TemporaryDirectory(prefix="slimcomm-train-") as tmp:
        init = "file://" + os.path.join(tmp, "store")
        mp.start_processes(_spawn_entry, args=(args, init), nprocs=args.world_size, join=True, start_method="spawn")
    if not os.path.exists(args.out) or os.stat(args.out).st_mtime_ns == before:
        raise RuntimeError(f"the training ranks exited without writing {args.out}")
    with open(args.out) as f:
        return json.load(f)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m slimcomm.train`` / ``slimcomm-train``; returns the exit status.

    Results tables and the paths written go to stdout; everything else (data
    set notices, the run directory, library diagnostics) is logged on stderr
    at ``--log-level``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(log_level(args))
    if args.plot_from:
        if not args.plot or args.plot == "auto":
            parser.error("--plot-from needs --plot OUT.png")
        from .report import plot_from

        return plot_from(args.plot_from, args.plot, band=args.plot_band)
    _resolve_launch(args)
    if args.out_dir is None:
        args.out_dir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
    if args.compare:
        if args.external:
            parser.error("--compare runs methods one after another and launches its own ranks; "
                         "run it without --rank/torchrun")
        if args.out is not None:
            parser.error("--out names one file; with --compare use --out-dir")
    plot = args.plot
    if plot == "auto":  # --plot without a path: next to the results
        folder = os.path.dirname(args.out) if args.out is not None and not args.compare else args.out_dir
        plot = os.path.join(folder, "plot.png")
    if not args.external or args.rank == 0:
        log.info("results go to %s", args.out or args.out_dir)
    methods = args.compare or [args.method]
    results = []
    for i, m in enumerate(methods):
        a = argparse.Namespace(**vars(args))
        a.method = m
        if args.compare:
            a.out = None
            log.info("method %d/%d: %s", i + 1, len(methods), m)
        r = run(a)
        if r is None:  # an externally launched rank other than 0
            return 0
        results.append(r)
        args.out = a.out if not args.compare else args.out
    print()
    print(setting_summary(results) + "; MB = payload bytes handed to collectives per rank")
    print(compare_table(results))
    if args.compare:
        print(f"wrote {', '.join(os.path.join(args.out_dir, m + '.json') for m in methods)}")
    else:
        print(f"wrote {args.out}")
    if plot:
        print(f"wrote {plot_results(results, plot, band=args.plot_band)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
