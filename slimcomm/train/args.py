"""The command line of :mod:`slimcomm.train`: its options, their defaults and their validation.

:func:`build_parser` (the parser; options left at ``None`` are filled later),
:func:`apply_method_defaults` (fills them from ``--model``, ``--optimizer`` and
``--method``; refuses options that do not apply), the per-method default
tables (``METHOD_DEFAULTS``, ``ADAMW_DEFAULTS``, ``SYNC_DEFAULTS``, ...),
:func:`_resolve_launch` (world size and external-rank settings from flags and
environment) and the command's logging set-up. It builds no model and trains
nothing; the methods live in :mod:`slimcomm.train.methods`.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from typing import Any, Dict, Optional

import torch

from .comm_threads import POLICIES as COMM_THREAD_POLICIES
from .workloads import data as data_mod
from .workloads import text as text_mod


METHODS = ("ddp", "fp16", "powersgd", "topk", "slimdp", "ist", "diloco", "sparseloco", "slimdp-local", "local")
"""``local``: no communication (each rank trains alone on its shard): the compute limit, not a method to train with."""
MODELS = ("mlp", "cnn", "gpt")

GPT_DEFAULTS = {"n_layer": 2, "n_embd": 192, "n_head": 3, "block_size": 64, "batch_size": 4, "steps": 1000,
                "warmup_lr_steps": 30, "eval_every": 50, "val_batches": 16}
"""Defaults of ``--model gpt`` (see the README for why this size: DDP is network-bound at 100 Mbit/s)."""


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


def _exchange_bits(s: str):
    if s.lower() == "none":
        return 0   # exact values (ISTTrainer(exchange_bits=None)); None = not given
    if s not in ("1", "2", "4", "8"):
        raise argparse.ArgumentTypeError(f"--ist-exchange-bits must be 1, 2, 4, 8 or none, got {s!r}")
    return int(s)


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


def _mesh(s: str):
    from .sharding import parse_mesh

    return parse_mesh(s)


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
    g.add_argument("--method", choices=METHODS, default="slimdp",
                   help="communication method; local: none (each rank trains alone on its own shard with ddp's "
                        "settings; the compute limit of the others)")
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
    g.add_argument("--comm-thread-priority", choices=COMM_THREAD_POLICIES, default="idle",
                   help="scheduling priority of gloo's event-loop threads (slimcomm.train.comm_threads): "
                        "they busy-poll while a peer's bytes wait for this rank to enter the collective, "
                        "which on ranks sharing cores takes the CPU of the late rank's step; idle: "
                        "SCHED_IDLE, low: nice 19, normal: unchanged (default: idle)")
    g.add_argument("--timeout", type=_positive_float("--timeout"), default=600.0,
                   help="seconds a collective may wait before the job fails")
    g.add_argument("--link-times", type=_link_rates, default=None, metavar="RATES",
                   help="after training, time a few collectives on the link the ranks used (loopback) and project "
                        "the run's train time onto these emulated link rates (comma-separated, from "
                        f"{', '.join(_projection_rates())}; 'none' turns it off), from its compute time and its "
                        "counted bytes (slimcomm.train.projection); default: 1gbit,100mbit for ranks this command "
                        "spawns, none for externally launched ones (bench/netbench.py measures their link)")
    g.add_argument("--profile", action="store_true",
                   help="time the phases of every training step on every rank (forward, backward, the comm "
                        "hook, the wait for the collectives, the optimizer; slimcomm.train.profile) into the "
                        "results JSON's 'profile'; CPU only, not for --method ist")
    g.add_argument("--mesh", type=_mesh, default=None, metavar="R,S",
                   help="--model gpt only: shard the GPT with FSDP2 over a (replicate, shard) mesh of R replica "
                        "groups ('nodes': ranks r*S..r*S+S-1) of S ranks each, R*S = --world-size; methods ddp "
                        "(HSDP), slimdp (the FSDP2 Slim-DP hook), slimdp-local, diloco, sparseloco "
                        "(SlimDPOptimizer across the replicate dimension); bytes are counted across the "
                        "replicate dimension (slimcomm.train.sharding)")
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
                   help="peak learning rate (default: AdamW 1e-3; SGD 0.05 for ddp/fp16/powersgd, 0.03 for ist, "
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
    g.add_argument("--time-budget", type=_positive_float("--time-budget"), default=None, metavar="S",
                   help="stop at the first evaluation (--eval-every, epoch ends) at which the training wall "
                        "time (evaluation excluded; the slowest rank's) reaches S seconds, so a method with "
                        "cheap steps runs as many as its time allows; --epochs/--steps stay the upper bound")

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
    g.add_argument("--warmup-steps", type=_int_in("--warmup-steps", 1), default=1,
                   help="dense all-reduce steps first, in --value-dtype (>= 1: G starts from a dense average)")
    g.add_argument("--value-dtype", choices=("fp32", "bf16", "fp16"), default="bf16", help="dtype of values on the wire")
    g.add_argument("--min-compress-numel", type=_nonneg_int("--min-compress-numel"), default=None,
                   help="parameters with fewer elements are sent whole (SlimDPState(min_compress_numel=); "
                        "default: 2048 for slimdp, 0 for topk, the top-k baseline; 0 compresses every "
                        "parameter)")
    g.add_argument("--fuse-sgd", action=argparse.BooleanOptionalAction, default=None,
                   help="slimdp only: the hook applies plain SGD at the index set itself "
                        "(SlimDPState.fuse_sgd: no dense bucket write, no dense optimizer pass); default: "
                        "on where it applies (--optimizer sgd, --momentum 0, no weight decay, no --grad-clip, "
                        "--delay-steps 0)")
    g.add_argument("--delay-steps", type=int, choices=(0, 1), default=None,
                   help="slimdp only: 1 applies each step's all-reduce one step later, so the collective "
                        "overlaps the next step's computation (SlimDPState(delay_steps=)); default 0")
    g.add_argument("--allreduce-algorithm", choices=("backend", "two_shot"), default=None,
                   help="slimdp only: how a compressed bucket's values are summed "
                        "(SlimDPState(allreduce_algorithm=)): the process group's all_reduce (gloo: a ring, "
                        "2(W-1) hops of latency) or two direct all-to-all exchanges of the same bytes (2 hops; "
                        "for links with a large one-way delay); default backend")

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
    g.add_argument("--lowbit-collective", choices=("all_reduce", "all_gather"), default="all_reduce",
                   help="how dense low-bit codes travel (SlimDPOptimizer(lowbit_collective=)): two-stage "
                        "all-reduce, bytes per rank bounded in the world size (default), or all-gather")
    g.add_argument("--delay-syncs", type=int, choices=(0, 1), default=None,
                   help="1 applies each synchronisation one period later, so its collectives overlap the "
                        "next --sync-every inner steps (SlimDPOptimizer(delay_syncs=)); default 0")
    g.add_argument("--overlap-steps", type=_positive_int("--overlap-steps"), default=None,
                   help="with --delay-syncs 1: apply each synchronisation this many inner steps after "
                        "its launch (SlimDPOptimizer(overlap_steps=); default --sync-every)")
    g.add_argument("--inner-optimizer", choices=("adamw", "local-adamw"), default=None,
                   help="inner optimizer of the optimizer-side methods under --optimizer adamw: local-adamw = "
                        "slimcomm.optim.LocalAdamW (AdamW normalised by the second moment of the average "
                        "gradient of the ranks it synchronises with); default local-adamw for slimdp-local, "
                        "adamw (the published algorithms) for diloco and sparseloco")
    g.add_argument("--no-error-feedback", action="store_true",
                   help="error_feedback=False for the slimdp/topk hook and SlimDPOptimizer: drop what the "
                        "compression did not send "
                        "(for measurements; error feedback is the default)")

    g = p.add_argument_group("ist (slimcomm.ist.ISTTrainer; --model gpt: slimcomm.ist.GPTISTTrainer)")
    g.add_argument("--local-steps", type=_positive_int("--local-steps"), default=10,
                   help="local steps per synchronisation round")
    g.add_argument("--ist-shared", type=_float_range("--ist-shared", 0.0, 1.0), default=0.0, metavar="F",
                   help="fraction of every hidden layer's neurons in every rank's subnet, averaged at each "
                        "synchronisation (ISTTrainer(shared=F); 0 = disjoint subnets)")
    g.add_argument("--ist-subnets", type=_positive_int("--ist-subnets"), default=None, metavar="G",
                   help="distinct subnets per round: rank r trains subnet r %% G, the ranks of a subnet are "
                        "averaged (ISTTrainer(subnets=G); default min(world size, 4))")
    g.add_argument("--ist-exchange-bits", type=_exchange_bits, default=None, metavar="B",
                   help="bits per value of the round's update in the exchange: 1, 2, 4 or 8 (per-chunk "
                        "scaled codes) or 'none' (exact values) (ISTTrainer(exchange_bits=B); default 4)")
    g.add_argument("--no-scale-grads", action="store_true",
                   help="the original IST update: do not scale each sliced tensor's gradient by its share "
                        "of the tensor (world_size**-k); its stable lr then shrinks with the world size")

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


def _projection_rates():
    from .projection import EMULATED_LINKS

    return tuple(EMULATED_LINKS)


def _link_rates(s: str):
    """``--link-times``: ``"1gbit,100mbit"`` -> ("1gbit", "100mbit"); ``"none"`` -> ()."""
    if s.strip().lower() == "none":
        return ()
    rates = tuple(r.strip() for r in s.split(",") if r.strip())
    known = _projection_rates()
    bad = [r for r in rates if r not in known]
    if not rates or bad:
        raise argparse.ArgumentTypeError(f"unknown link rate(s) {bad or s!r}; choose from {', '.join(known)} or none")
    if len(set(rates)) != len(rates):
        raise argparse.ArgumentTypeError(f"lists a rate twice: {s!r}")
    return rates


def _slimcomm_version() -> str:
    from .._version import __version__

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
    if getattr(args, "mesh", None) is not None:
        if args.link_times:
            raise SystemExit("error: --link-times does not apply with --mesh (the projection models one link "
                             "per rank; bench/netbench.py measures the link between nodes)")
        args.link_times = ()
    if args.link_times is None:
        from .projection import DEFAULT_RATES

        args.link_times = () if external else tuple(DEFAULT_RATES)
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
    # IST with ISTTrainer's gradient scaling (issue 24): lr 0.02-0.05 trains at 2, 4 and 8 ranks
    # (Fashion-MNIST MLP, batch 32 per rank, 2 epochs: 0.800-0.836), 0.1 degrades at 8 ranks
    # (0.601), and the unscaled update diverged at 0.05 on 4 and 8 ranks
    # (bench/results/ist_scaling/lr_sweep.md); 0.03 is the middle of the window that works at
    # every world size (and ahead of 0.05 at 8 ranks over 1500 steps in a simulation).
    "ist": {"lr": 0.03, "momentum": 0.9},
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

# Inner AdamW of the optimizer-side methods: LocalAdamW for slimcomm's own (GPT, 8 ranks, 500 steps,
# seed 0: val loss 2.0802 with it and outer lr 1.0 vs 2.2334 with AdamW and outer lr 1.4, DDP 2.0429;
# bench/results/adamw_8ranks_inner.md); the published algorithms keep theirs.
INNER_OPTIMIZER_DEFAULTS = {"slimdp-local": "local-adamw", "diloco": "adamw", "sparseloco": "adamw"}
# With LocalAdamW the ranks' steps already have DDP's size where the noise dominates, so the outer
# step is the plain average (outer lr 1.0): outer lr 1.4 made up for AdamW's smaller steps and
# over-shoots with LocalAdamW (byte-level 4-layer GPT on Python source, 2 ranks, seed 1: 2.2473 at
# 1.4, 2.0286 at 1.0, DDP 2.0021; the GPT default at 8 ranks: 2.0751 / 2.0802, a tie).
LOCAL_ADAMW_SYNC_DEFAULTS = {"slimdp-local": {"outer_lr": 1.0}}

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
            contradict each other (``--method ist`` with ``--model cnn``,
            ``--method local`` with ``--sync-every``/``--outer-lr``/... or ``--core-ratio``/``--explore-ratio``,
            ``--grad-clip`` or ``--ist-shared`` with ist where they do not apply, ``--steps`` with ``--epochs``,
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
    from .sharding import check_mesh_args

    check_mesh_args(args, bad)  # first: --mesh's refusals name --mesh
    if args.method == "ist" and model not in ("mlp", "gpt"):
        bad(f"--method ist needs --model mlp or gpt (IST partitions the hidden neurons of an nn.Sequential "
            f"MLP, or the attention heads and FFN neurons of the GPT's blocks); got --model {model}")
    if args.method == "ist" and lm and getattr(args, "ist_shared", 0.0):
        bad("--ist-shared applies to --method ist with --model mlp; the GPT's IST (GPTISTTrainer) "
            "partitions heads and FFN neurons without shared ones")
    if args.method == "ist" and lm:
        for flag in ("--ist-subnets", "--ist-exchange-bits"):
            if given(flag.lstrip("-").replace("-", "_")):
                bad(f"{flag} applies to --method ist with --model mlp (ISTTrainer); the GPT's IST "
                    f"(GPTISTTrainer) exchanges exact values, one subnet per rank")
    ws = getattr(args, "world_size", None)
    if args.method == "ist" and getattr(args, "ist_subnets", None) and ws and args.ist_subnets > ws:
        bad(f"--ist-subnets {args.ist_subnets} exceeds the world size {ws} (every subnet needs a rank)")
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
        ws = getattr(args, "world_size", None)
        if args.method == "ist" and ws is not None and args.n_head < ws:
            bad(f"--method ist --model gpt gives every rank at least one attention head: --n-head "
                f"{args.n_head} is smaller than --world-size {ws}")
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
    if given("inner_optimizer") and (args.method not in SYNC_DEFAULTS or args.optimizer != "adamw"):
        bad(f"--inner-optimizer applies to the optimizer-side methods ({', '.join(SYNC_DEFAULTS)}) with "
            f"--optimizer adamw, not --method {args.method} with --optimizer {args.optimizer}")
    if args.method in SYNC_DEFAULTS and args.optimizer == "adamw" and not given("inner_optimizer"):
        args.inner_optimizer = INNER_OPTIMIZER_DEFAULTS[args.method]
    sync = SYNC_DEFAULTS.get(args.method)
    if sync is not None and getattr(args, "inner_optimizer", None) == "local-adamw":
        sync = dict(sync, **LOCAL_ADAMW_SYNC_DEFAULTS.get(args.method, {}))
    for name in ("sync_every", "outer_lr", "outer_momentum", "value_bits", "error_decay"):
        if sync is None and given(name):
            bad(f"{_flag(name)} applies to --method {'/'.join(SYNC_DEFAULTS)}, not {args.method}"
                + (" (no communication: the ranks never synchronise)" if args.method == "local" else ""))
        if sync is not None and not given(name):
            setattr(args, name, sync[name])
    if sync is not None and args.outer_momentum >= 1:
        bad(f"--outer-momentum {args.outer_momentum:g} must be < 1")
    if args.method == "local":
        # no DDP, no hook, no synchronisation: the compressors' options would silently do nothing
        for name in ("core_ratio", "explore_ratio"):
            if given(name):
                bad(f"{_flag(name)} does not apply to --method local (no communication: each rank trains "
                    "alone on its shard, the compute limit of the other methods)")
        # (left unset, so that a second call, e.g. run() after _resolve_launch(), still refuses only
        # what the user gave)
    elif not given("core_ratio"):
        args.core_ratio = sync.get("core_ratio", 0.01) if sync else 0.01
    if args.method != "local" and not given("explore_ratio"):
        args.explore_ratio = sync.get("explore_ratio", 0.01) if sync else 0.01
    if getattr(args, "profile", False) and (args.method == "ist" or getattr(args, "device", "cpu") != "cpu"):
        bad("--profile times the steps of the DDP and optimizer-side methods on --device cpu; not --method ist "
            "or --device cuda")
    if getattr(args, "no_error_feedback", False) and args.method not in ("slimdp", "topk", *SYNC_DEFAULTS):
        bad(f"--no-error-feedback applies to the Slim-DP hook (slimdp, topk) and the optimizer-side methods "
            f"({', '.join(SYNC_DEFAULTS)}), not {args.method}")
    if given("delay_steps") and args.method != "slimdp":
        bad(f"--delay-steps applies to --method slimdp (the Slim-DP DDP hook), not {args.method}")
    if given("min_compress_numel") and args.method not in ("slimdp", "topk"):
        bad(f"--min-compress-numel applies to the Slim-DP hook (slimdp, topk), not {args.method}")
    if given("allreduce_algorithm") and args.method != "slimdp":
        bad(f"--allreduce-algorithm applies to --method slimdp (the Slim-DP DDP hook), not {args.method}")
    # the defaults only where the option applies (left unset elsewhere, so that a second call
    # still refuses only what the user gave)
    if args.method == "slimdp" and not given("delay_steps"):
        args.delay_steps = 0
    if args.method in ("slimdp", "topk") and not given("min_compress_numel") and \
            getattr(args, "mesh", None) is None:
        # slimdp: SlimDPState's default; topk, the top-k / DGC baseline as published, compresses
        # every parameter (its small dense tensors would also all-gather their indices)
        from ..hooks import MIN_COMPRESS_NUMEL

        args.min_compress_numel = MIN_COMPRESS_NUMEL if args.method == "slimdp" else 0
    if args.method == "slimdp" and not given("allreduce_algorithm"):
        args.allreduce_algorithm = "backend"
    if args.method == "slimdp" and args.allreduce_algorithm == "two_shot" and args.delay_steps:
        bad("--allreduce-algorithm two_shot needs --delay-steps 0 (the delayed all-reduce is the "
            "process group's own)")
    # what keeps the slimdp hook from fusing the SGD step (SlimDPState.fuse_sgd), if anything
    unfusable = None
    if args.method == "slimdp":
        if args.optimizer != "sgd":
            unfusable = f"--optimizer {args.optimizer} (the fused step is plain SGD)"
        elif args.momentum != 0:
            unfusable = f"--momentum {args.momentum:g}"
        elif args.weight_decay != 0:
            unfusable = f"--weight-decay {args.weight_decay:g}"
        elif args.grad_clip != 0:
            unfusable = (f"--grad-clip {args.grad_clip:g} (the update is applied inside backward, "
                         f"before any clipping)")
        elif args.delay_steps:
            unfusable = "--delay-steps 1"
    if given("fuse_sgd"):
        if args.method != "slimdp":
            bad(f"--fuse-sgd/--no-fuse-sgd apply to --method slimdp (the Slim-DP DDP hook), not {args.method}")
        if args.fuse_sgd and unfusable:
            bad(f"--fuse-sgd needs plain SGD in the hook; not with {unfusable}")
    elif args.method == "slimdp":
        args.fuse_sgd = unfusable is None
    if given("delay_syncs") and args.method not in SYNC_DEFAULTS:
        bad(f"--delay-syncs applies to the optimizer-side methods ({', '.join(SYNC_DEFAULTS)}), "
            f"not {args.method}")
    if args.method in SYNC_DEFAULTS and not given("delay_syncs"):
        args.delay_syncs = 0
    if given("overlap_steps") and not args.delay_syncs:
        bad("--overlap-steps applies with --delay-syncs 1")
    if given("overlap_steps") and args.overlap_steps > args.sync_every:
        bad(f"--overlap-steps {args.overlap_steps} exceeds --sync-every {args.sync_every}")
    if args.method == "ist" and args.grad_clip > 0 and not lm:
        bad("--grad-clip does not apply to --method ist with --model mlp (ISTTrainer.step runs backward and the "
            "optimizer step itself; with --model gpt, GPTISTTrainer clips each rank's subnet gradient)")
    return args
