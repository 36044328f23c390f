"""The training command: ``python -m slimcomm.train`` (console script ``slimcomm-train``).

Trains an MLP on Fashion-MNIST (or scikit-learn's digits set when
Fashion-MNIST is not installed) with ``world_size`` ranks and one of the
communication methods below, writes a results JSON per run, and can compare
methods in one table and plot accuracy against wall time and bytes.

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

Timing: ``train_time_s`` is the wall time spent in training steps (forward,
backward, communication, optimizer), excluding evaluation; for IST it includes
the ``synchronize()`` that precedes each evaluation. Time-to-accuracy is the
``train_time_s`` of the first evaluation whose test accuracy reaches
``--target-acc``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .workloads import data as data_mod
from .agreement import agree_across_ranks

__all__ = ["METHODS", "build_parser", "build_model", "run", "compare_table", "plot_results", "main"]

METHODS = ("ddp", "fp16", "powersgd", "topk", "slimdp", "ist")
RESULT_FORMAT = "slimcomm.train/1"
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
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}")
        if v < lo or (hi is not None and v > hi):
            bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"{name} must be {bound}, got {v}")
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
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}")
        if not 0.0 < v <= 1.0:
            raise argparse.ArgumentTypeError(f"{name} must be in (0, 1], got {v}")
        return v
    return conv


def _positive_float(name):
    def conv(s):
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}")
        if not v > 0 or not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{name} must be a positive finite number, got {s!r}")
        return v
    return conv


def _hidden(s: str):
    try:
        sizes = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hidden must be comma-separated integers, got {s!r}")
    if not sizes or any(h < 1 for h in sizes):
        raise argparse.ArgumentTypeError(f"--hidden needs at least one positive width, got {s!r}")
    return sizes


def _methods(s: str):
    ms = [m.strip() for m in s.split(",") if m.strip()]
    bad = [m for m in ms if m not in METHODS]
    if not ms or bad:
        raise argparse.ArgumentTypeError(f"--compare: unknown method(s) {bad or s!r}; choose from {', '.join(METHODS)}")
    if len(set(ms)) != len(ms):
        raise argparse.ArgumentTypeError(f"--compare lists a method twice: {s!r}")
    return ms


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: ...)`` unless the help text already states the default."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slimcomm-train",
        description="Data-parallel / subnet-parallel MLP training with slimcomm's communication methods.",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("what to run")
    g.add_argument("--method", choices=METHODS, default="slimdp", help="communication method")
    g.add_argument("--compare", type=_methods, default=None, metavar="M1,M2,...",
                   help="run these methods one after another (same seed) and print one table")
    g.add_argument("--plot", default=None, metavar="PNG",
                   help="write a PNG of test accuracy vs train time and vs MB sent for the runs")
    g.add_argument("--plot-from", nargs="+", default=None, metavar="JSON",
                   help="with --plot: plot these result files instead of training")

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

    g = p.add_argument_group("data and model")
    g.add_argument("--dataset", choices=("auto", "fashion-mnist", "digits"), default="auto",
                   help="auto: Fashion-MNIST if installed, else scikit-learn digits")
    g.add_argument("--data-dir", default=None, help=f"directory with the Fashion-MNIST IDX files (default {data_mod.FASHION_MNIST_DIR})")
    g.add_argument("--train-subset", type=_positive_int("--train-subset"), default=None,
                   help="use only this many training samples (all ranks together)")
    g.add_argument("--test-subset", type=_positive_int("--test-subset"), default=None,
                   help="evaluate on only the first this-many test samples")
    g.add_argument("--hidden", type=_hidden, default=(2048, 2048),
                   help="hidden layer widths, comma-separated (default: 2048,2048)")

    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=_positive_int("--epochs"), default=2, help="passes over each rank's shard")
    g.add_argument("--batch-size", type=_positive_int("--batch-size"), default=128, help="per-rank mini-batch")
    g.add_argument("--lr", type=_positive_float("--lr"), default=None,
                   help="SGD learning rate (default: 0.05 for ddp/fp16/powersgd/ist, 0.4 for topk, 0.6 for slimdp)")
    g.add_argument("--momentum", type=float, default=None,
                   help="SGD momentum (default: 0.9 for ddp/fp16/powersgd/ist, 0 for topk/slimdp)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="SGD weight decay")
    g.add_argument("--seed", type=_int_in("--seed", 0, 2**63 - 1), default=0,
                   help="seed of the model initialisation, data order and Slim-DP/PowerSGD/IST sampling")
    g.add_argument("--bucket-cap-mb", type=_positive_float("--bucket-cap-mb"), default=25.0, help="DDP bucket size")
    g.add_argument("--eval-every", type=_nonneg_int("--eval-every"), default=0,
                   help="also evaluate every this many steps (0: only at the end of each epoch)")
    g.add_argument("--target-acc", type=_ratio("--target-acc"), default=0.85, help="test accuracy for time-to-accuracy")
    g.add_argument("--stop-at-target", action="store_true",
                   help="stop training at the first evaluation that reaches --target-acc")

    g = p.add_argument_group("powersgd")
    g.add_argument("--powersgd-rank", type=_positive_int("--powersgd-rank"), default=4,
                   help="matrix_approximation_rank")
    g.add_argument("--powersgd-start-iter", type=_int_in("--powersgd-start-iter", 2), default=2,
                   help="dense all-reduce steps before compression starts (>= 2: PowerSGD's error "
                        "feedback needs a dense warm-up)")

    g = p.add_argument_group("topk / slimdp (slimcomm.hooks.SlimDPState)")
    g.add_argument("--core-ratio", type=_ratio("--core-ratio"), default=0.01, help="core set size / parameter numel")
    g.add_argument("--explore-ratio", type=_ratio("--explore-ratio"), default=0.01, help="explore set size / parameter numel")
    g.add_argument("--core-refresh", type=_positive_int("--core-refresh"), default=10,
                   help="steps between core set refreshes (slimdp)")
    g.add_argument("--warmup-steps", type=_int_in("--warmup-steps", 2), default=2,
                   help="dense all-reduce steps first (>= 2)")
    g.add_argument("--value-dtype", choices=("fp32", "bf16", "fp16"), default="bf16", help="dtype of values on the wire")

    g = p.add_argument_group("ist (slimcomm.ist.ISTTrainer)")
    g.add_argument("--local-steps", type=_positive_int("--local-steps"), default=10,
                   help="local steps per synchronisation round")

    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="results JSON path (single method; default OUT_DIR/METHOD.json)")
    g.add_argument("--out-dir", default="runs", help="directory for results JSONs")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return p


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
    if args.momentum is not None and not 0.0 <= args.momentum < 1.0:
        raise SystemExit(f"error: --momentum must be in [0, 1), got {args.momentum}")
    if args.weight_decay < 0:
        raise SystemExit(f"error: --weight-decay must be >= 0, got {args.weight_decay}")
    if args.core_ratio + args.explore_ratio > 1.0:
        raise SystemExit("error: --core-ratio + --explore-ratio must be <= 1")


# ---------------------------------------------------------------------------
# Model and methods
# ---------------------------------------------------------------------------

def build_model(in_features: int, hidden: Sequence[int], num_classes: int) -> nn.Sequential:
    """``nn.Sequential`` MLP: Linear(in, h1), ReLU, ..., Linear(h_last, num_classes).

    With the defaults (784 inputs, hidden 2048, 2048, 10 classes) it has
    5,824,522 parameters.
    """
    layers: List[nn.Module] = []
    prev = in_features
    for h in hidden:
        layers += [nn.Linear(prev, h), nn.ReLU()]
        prev = h
    layers.append(nn.Linear(prev, num_classes))
    return nn.Sequential(*layers)


_VALUE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

METHOD_DEFAULTS = {
    # Sparsified methods with error feedback (topk, slimdp) default to plain SGD: heavy-ball
    # momentum applied to the sparse, residual-delayed updates over-shoots (Lin et al., Deep
    # Gradient Compression, arXiv 1712.01887, Sec. 3.2 "momentum correction"); measured here on
    # Fashion-MNIST, MLP 784-2048-2048-10, 2 ranks, batch 128: slimdp with momentum 0.9 / lr 0.05
    # missed 0.85 test accuracy in 2 epochs (2 seeds); plain SGD at lr 0.6 (slimdp, core refresh
    # 10) or 0.4 (topk) reached it in 170-190 steps, as fast as ddp at lr 0.05 / momentum 0.9
    # (bench/results/netbench_sweeps/steps_to_target.md).
    "topk": {"lr": 0.4, "momentum": 0.0},
    "slimdp": {"lr": 0.6, "momentum": 0.0},
}
_COMMON_DEFAULTS = {"lr": 0.05, "momentum": 0.9}


def apply_method_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill ``--lr`` / ``--momentum`` left unset with ``args.method``'s defaults (in place)."""
    d = METHOD_DEFAULTS.get(args.method, _COMMON_DEFAULTS)
    if args.lr is None:
        args.lr = d["lr"]
    if args.momentum is None:
        args.momentum = d["momentum"]
    return args


def _make_optimizer(params, args):
    return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)


class _Method:
    """One training method: owns the (wrapped) model, the optimizer and the byte accounting."""

    def __init__(self, args, model: nn.Module, world_size: int):
        self.args = args
        self.name = args.method
        self.model = model
        self.world_size = world_size
        self.num_params = sum(p.numel() for p in model.parameters())
        self.dense_step_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.steps = 0
        self.hook_state = None
        self.trainer = None
        m = self.name
        if m == "ist":
            from .ist import ISTTrainer

            self.trainer = ISTTrainer(
                model,
                lambda params: _make_optimizer(params, args),
                local_steps=args.local_steps,
                seed=args.seed,
            )
            return
        from torch.nn.parallel import DistributedDataParallel as DDP

        dev_ids = [model_device(model).index] if args.device == "cuda" else None
        self.ddp = DDP(model, device_ids=dev_ids, bucket_cap_mb=args.bucket_cap_mb)
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
        self.opt = _make_optimizer(self.ddp.parameters(), args)

    def train_step(self, x: torch.Tensor, y: torch.Tensor):
        """One training step; returns (loss float, number correct or None)."""
        self.steps += 1
        if self.trainer is not None:
            loss = self.trainer.step(x, y, F.cross_entropy)
            return float(loss), None
        self.opt.zero_grad(set_to_none=True)
        out = self.ddp(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        self.opt.step()
        return float(loss.detach()), int((out.detach().argmax(1) == y).sum())

    def before_eval(self):
        if self.trainer is not None:
            self.trainer.synchronize()

    def eval_model(self) -> nn.Module:
        return self.model

    def bytes_sent(self) -> int:
        """Bytes sent per rank so far, by the module-level definition."""
        m = self.name
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
    keys = ("method", "world_size", "dataset", "train_subset", "hidden", "epochs", "batch_size", "lr", "momentum",
            "weight_decay", "seed", "powersgd_rank", "powersgd_start_iter", "core_ratio", "explore_ratio",
            "core_refresh", "warmup_steps", "value_dtype", "local_steps", "eval_every", "device")
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
        return _train(rank, world_size, args, device, backend)
    finally:
        dist.destroy_process_group()


def _train(rank, world_size, args, device, backend):
    wall0 = time.perf_counter()
    err = None
    try:
        ds = data_mod.load_dataset(args.dataset, args.data_dir, log=print if rank == 0 else None)
        shard = data_mod.shard_indices(ds.x_train.shape[0], rank, world_size, seed=args.seed, subset=args.train_subset)
        if args.batch_size > shard.numel():
            raise ValueError(f"--batch-size {args.batch_size} is larger than the per-rank shard ({shard.numel()} samples)")
        x_train = ds.x_train[shard].to(device)
        y_train = ds.y_train[shard].to(device)
        x_test, y_test = ds.x_test, ds.y_test
        if args.test_subset is not None:
            x_test, y_test = x_test[: args.test_subset], y_test[: args.test_subset]
        if x_test.shape[0] < world_size:
            raise ValueError(f"--test-subset {x_test.shape[0]} must be >= --world-size {world_size}")
        x_test, y_test = x_test.to(device), y_test.to(device)
        torch.manual_seed(args.seed)
        model = build_model(ds.num_features, args.hidden, ds.num_classes).to(device)
        if args.method == "ist" and min(args.hidden) < world_size:
            raise ValueError(f"--hidden {args.hidden}: IST needs every hidden width >= --world-size {world_size}")
        fp = _config_fingerprint(args, [ds.name, shard.numel()])
    except Exception as e:  # report to the other ranks before re-raising
        err = e
        fp = 0
    _agree(err, fp, device)  # collective: every rank gets here, failed or not

    method = _Method(args, model, world_size)
    steps_per_epoch = shard.numel() // args.batch_size
    evals: List[Dict[str, Any]] = []
    epochs: List[Dict[str, Any]] = []
    train_time = 0.0
    eval_time = 0.0
    time_to_target = None
    stop = False
    bar = None
    use_bar = rank == 0 and not args.no_progress
    if use_bar:
        from tqdm import tqdm

    def do_eval(epoch_float):
        nonlocal train_time, eval_time, time_to_target
        t0 = time.perf_counter()
        method.before_eval()  # IST: write back + repartition (communication, counted as training)
        t1 = time.perf_counter()
        acc, loss = _evaluate(method.eval_model(), x_test, y_test, rank, world_size, device)
        t2 = time.perf_counter()
        train_time += t1 - t0
        eval_time += t2 - t1
        rec = {"epoch": round(epoch_float, 4), "step": method.steps, "train_time_s": train_time,
               "bytes_sent_per_rank": method.bytes_sent(), "test_acc": acc, "test_loss": loss}
        evals.append(rec)
        if time_to_target is None and acc >= args.target_acc:
            time_to_target = {"target": args.target_acc, "train_time_s": train_time, "step": method.steps,
                              "epoch": rec["epoch"], "bytes_sent_per_rank": rec["bytes_sent_per_rank"]}
        return rec

    for epoch in range(args.epochs):
        batches = data_mod.epoch_batches(shard.numel(), args.batch_size, epoch, args.seed, rank)
        if use_bar:
            bar = tqdm(total=len(batches), desc=f"{args.method} epoch {epoch + 1}/{args.epochs}",
                       leave=True, dynamic_ncols=True, file=sys.stderr)
        loss_sum, correct, seen, n_loss = 0.0, 0, 0, 0
        for i, idx in enumerate(batches):
            t0 = time.perf_counter()
            xb, yb = x_train[idx], y_train[idx]
            loss, corr = method.train_step(xb, yb)
            train_time += time.perf_counter() - t0
            if not math.isfinite(loss):
                raise FloatingPointError(f"rank {rank}: training loss became {loss} at step {method.steps} "
                                         f"(method {args.method}); lower --lr")
            loss_sum += loss
            n_loss += 1
            if corr is not None:
                correct += corr
                seen += yb.numel()
            if bar is not None:
                post = {"loss": f"{loss_sum / n_loss:.4f}", "MB": f"{method.bytes_sent() / 1e6:.1f}"}
                if seen:
                    post["acc"] = f"{correct / seen:.3f}"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
            last_in_epoch = i == len(batches) - 1
            if args.eval_every and method.steps % args.eval_every == 0 and not last_in_epoch:
                rec = do_eval(epoch + (i + 1) / len(batches))
                if bar is not None:
                    bar.set_postfix({"loss": f"{loss_sum / n_loss:.4f}", "test_acc": f"{rec['test_acc']:.4f}",
                                     "MB": f"{rec['bytes_sent_per_rank'] / 1e6:.1f}"})
                if args.stop_at_target and time_to_target is not None:
                    stop = True
                    break
        rec = do_eval(epoch + 1.0) if not stop else evals[-1]
        ep = dict(rec)
        ep.update({"epoch": epoch + 1, "train_loss": loss_sum / max(1, n_loss),
                   "train_acc": (correct / seen) if seen else None})
        epochs.append(ep)
        if bar is not None:
            bar.set_postfix({"loss": f"{ep['train_loss']:.4f}", "test_acc": f"{rec['test_acc']:.4f}",
                             "MB": f"{rec['bytes_sent_per_rank'] / 1e6:.1f}"})
            bar.close()
        if stop or (args.stop_at_target and time_to_target is not None):
            break

    final = evals[-1]
    result = {
        "format": RESULT_FORMAT,
        "method": args.method,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
                   if k not in ("compare", "plot_from")},
        "world_size": world_size,
        "backend": backend,
        "dataset": {"name": ds.name, "source": ds.source, "train_samples_per_rank": int(shard.numel()),
                    "test_samples": int(x_test.shape[0]), "features": ds.num_features},
        "model": {"hidden": list(args.hidden), "num_params": method.num_params},
        "steps_per_epoch": steps_per_epoch,
        "steps": method.steps,
        "completed_epochs": len(epochs),
        "stopped_at_target": bool(stop or (args.stop_at_target and time_to_target is not None and len(epochs) < args.epochs)),
        "bytes_definition": BYTES_DEFINITION,
        "dense_bytes_per_step": method.dense_step_bytes,
        "epochs": epochs,
        "evals": evals,
        "final": {"test_acc": final["test_acc"], "test_loss": final["test_loss"], "train_time_s": train_time,
                  "eval_time_s": eval_time, "wall_time_s": time.perf_counter() - wall0,
                  "bytes_sent_per_rank": method.bytes_sent(),
                  "dense_bytes_per_rank": method.steps * method.dense_step_bytes},
        "time_to_target": time_to_target,
        "stats": method.stats(),
        "env": {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
                "threads_per_rank": args.threads},
    }
    if rank == 0:
        out = args.out
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, out)
        return result
    return None


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


def _fmt_ratio(x):
    return "-" if x is None else f"{x:.3g}x"


def compare_table(results: Sequence[Dict[str, Any]], baseline: str = "ddp", fmt: str = "github") -> str:
    """One table: method, final test accuracy, train time, MB sent per rank, ratios vs ``baseline``.

    ``results`` are results dicts (as written to the JSON files). Ratios are
    ``method / baseline`` and shown only when the baseline is among them.
    Time-to-target is shown when any run reached it.
    """
    base = next((r for r in results if r["method"] == baseline), None)
    has_ttt = any(r.get("time_to_target") for r in results)
    headers = ["method", "test acc", "train time (s)", "MB sent/rank", f"MB vs {baseline}", f"time vs {baseline}"]
    if has_ttt:
        tgt = next(r["time_to_target"]["target"] for r in results if r.get("time_to_target"))
        headers.append(f"time to {tgt:g} (s)")
    rows = []
    for r in results:
        f = r["final"]
        mb = f["bytes_sent_per_rank"] / 1e6
        row = [r["method"], f"{f['test_acc']:.4f}", f"{f['train_time_s']:.1f}", f"{mb:.2f}",
               _fmt_ratio(f["bytes_sent_per_rank"] / base["final"]["bytes_sent_per_rank"]) if base else "-",
               _fmt_ratio(f["train_time_s"] / base["final"]["train_time_s"]) if base else "-"]
        if has_ttt:
            t = r.get("time_to_target")
            row.append(f"{t['train_time_s']:.1f}" if t else "not reached")
        rows.append(row)
    try:
        from tabulate import tabulate
    except ImportError:  # plain fallback with the same content
        widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
        line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
        return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])
    return tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True)


def plot_results(results: Sequence[Dict[str, Any]], out_png: str, title: Optional[str] = None) -> str:
    """PNG with two panels: test accuracy vs train time (s) and vs MB sent per rank (log x). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        ev = r["evals"]
        label = r.get("label") or r["method"]
        t = [e["train_time_s"] for e in ev]
        b = [max(e["bytes_sent_per_rank"], 1) / 1e6 for e in ev]
        acc = [e["test_acc"] for e in ev]
        a1.plot(t, acc, marker="o", ms=3, label=label)
        a2.plot(b, acc, marker="o", ms=3, label=label)
    tgt = next((r["time_to_target"]["target"] for r in results if r.get("time_to_target")), None)
    for a in (a1, a2):
        a.set_ylabel("test accuracy")
        a.grid(alpha=0.3)
        if tgt is not None:
            a.axhline(tgt, color="gray", ls="--", lw=0.8)
    a1.set_xlabel("training wall time (s)")
    a2.set_xlabel("MB sent per rank (log)")
    a2.set_xscale("log")
    a1.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png


def _load_result(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            r = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: --plot-from {path}: cannot read a results JSON: {e}")
    if r.get("format") != RESULT_FORMAT:
        raise SystemExit(f"error: --plot-from {path}: not a slimcomm.train results file (format {r.get('format')!r})")
    return r


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot_from:
        if not args.plot:
            parser.error("--plot-from needs --plot OUT.png")
        results = [_load_result(p) for p in args.plot_from]
        print(compare_table(results))
        print(f"wrote {plot_results(results, args.plot)}")
        return 0
    _resolve_launch(args)
    if args.compare:
        if args.external:
            parser.error("--compare runs methods one after another and launches its own ranks; "
                         "run it without --rank/torchrun")
        if args.out is not None:
            parser.error("--out names one file; with --compare use --out-dir")
        results = []
        for m in args.compare:
            a = argparse.Namespace(**vars(args))
            a.method = m
            a.out = None
            results.append(run(a))
        print()
        print(f"{results[0]['dataset']['name']}, MLP {results[0]['model']['num_params']:,} params, "
              f"{args.world_size} ranks, {args.epochs} epoch(s), batch {args.batch_size}/rank; "
              f"MB = payload bytes handed to collectives per rank")
        print(compare_table(results))
        if args.plot:
            print(f"wrote {plot_results(results, args.plot)}")
        return 0
    result = run(args)
    if result is not None:
        print(compare_table([result]))
        print(f"wrote {args.out}")
        if args.plot:
            print(f"wrote {plot_results([result], args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
