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
              for ``--local-steps`` steps, then one collective re-assembles the model;
              gradients scaled so one lr serves every world size (``--no-scale-grads``:
              the original update), ``--ist-shared F`` for overlapping subnets.
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
the ``synchronize()`` that precedes each evaluation. The clock starts after a
collective that every rank enters once its model is wrapped (DDP's broadcast
of rank 0's parameters done), so no rank's start-up is charged to a training
step. Time-to-target is the
``train_time_s`` of the first evaluation whose metric reaches the target:
test accuracy >= ``--target-acc`` (mlp, cnn) or validation loss <=
``--target-loss`` (gpt).

Modules
-------
This module holds the workloads' tasks, the training loop, the results JSON
and the driver (:func:`run`, :func:`main`). The options, their defaults and
their validation live in :mod:`slimcomm.train_args`; how each method wraps the
model and optimizer, and counts its bytes, in :mod:`slimcomm.train_methods`.
Their names are re-exported here (``slimcomm.train.build_parser``, ...).
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
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .workloads import data as data_mod
from .workloads import models as models_mod
from .workloads import text as text_mod
from .agreement import agree_across_ranks
from .report import RESULT_FORMAT, compare_table, compute_config_key, plot_results, setting_summary
from .wire import WireCounter
from .train_args import (ADAMW_DEFAULTS, CNN_METHOD_DEFAULTS, GPT_DEFAULTS, LOG_FORMAT, LOG_LEVELS,  # noqa: F401
                         METHOD_DEFAULTS, METHODS, MODELS, SYNC_DEFAULTS, _resolve_launch,
                         apply_method_defaults, build_parser, log_level, setup_logging)
from .train_methods import SYNC_OPTIMIZER_BUILDERS, _Method, lr_factor, model_device  # noqa: F401

log = logging.getLogger("slimcomm.train" if __name__ == "__main__" else __name__)

__all__ = ["METHODS", "MODELS", "build_parser", "build_model", "apply_method_defaults", "run", "compare_table",
           "plot_results", "main"]

BYTES_DEFINITION = (
    "payload bytes each rank hands to collectives (all_reduce input size or own all_gather contribution), "
    "summed over training steps; a ring all-reduce puts 2(W-1)/W times this on each rank's link"
)


build_model = models_mod.build_mlp  # the MLP builder, kept under its old name


# ---------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------

def _config_fingerprint(args, extra) -> int:
    keys = ("method", "model", "world_size", "dataset", "train_subset", "hidden", "epochs", "steps", "batch_size",
            "optimizer", "lr", "momentum", "beta1", "beta2", "weight_decay", "lr_schedule", "warmup_lr_steps",
            "min_lr", "grad_clip", "seed", "powersgd_rank", "powersgd_start_iter", "core_ratio", "explore_ratio",
            "core_refresh", "warmup_steps", "value_dtype", "local_steps", "eval_every", "device", "tokens",
            "n_layer", "n_embd", "n_head", "block_size", "dropout", "val_batches", "sync_every", "outer_lr",
            "outer_momentum", "value_bits", "error_decay", "no_scale_grads", "time_budget", "ist_shared")
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

    method = None
    try:
        method = _Method(args, task.model, world_size, task.loss_fn, task.total_steps, task.classify)
    except Exception as e:
        err = e
    # Collective again: the training clock starts with every rank ready. DDP's constructor
    # broadcasts rank 0's parameters, and the ranks leave it at different times (at 8 ranks
    # over 100 Mbit/s, seconds apart); without this the wait lands in the first
    # synchronisation and is charged to whichever training step holds it.
    _agree(err, fp, device)
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

    budget = {"hit": False}

    def budget_spent():
        """--time-budget: has the slowest rank's training time reached it? Collective (one
        all-reduce of a scalar at an evaluation point, outside the training clock)."""
        if args.time_budget is None:
            return False
        t = torch.tensor([train_time], dtype=torch.float64, device=device)
        if world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        budget["hit"] = budget["hit"] or float(t) >= args.time_budget
        return budget["hit"]

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
                if budget_spent():
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
        if stop or (args.stop_at_target and time_to_target is not None) or budget_spent():
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
        "stopped_at_budget": budget["hit"],
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
