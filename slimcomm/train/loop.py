"""The training loop of one rank, the results JSON and the driver of the command.

:func:`main` is ``python -m slimcomm.train`` / ``slimcomm-train`` (what the
command does is described in :mod:`slimcomm.train`); :func:`run` runs one
method, spawning its ranks or joining an external launch; :func:`_train` is one
rank's loop over a task's batches (:mod:`slimcomm.train.tasks`), with the
evaluations, the time to target and the per-link projection, and writes the
results JSON (:func:`_write_json_atomic`). The options live in
:mod:`slimcomm.train.args`, the methods in :mod:`slimcomm.train.methods`, the
tables and plots in :mod:`slimcomm.train.report`.
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

from .workloads import models as models_mod
from .workloads import text as text_mod
from ..agreement import agree_across_ranks
from .report import RESULT_FORMAT, compare_table, compute_config_key, plot_results, setting_summary
from .wire import WireCounter
from .comm_threads import set_comm_thread_priority
from . import projection as train_projection
from .args import _resolve_launch, apply_method_defaults, build_parser, log_level, setup_logging
from .methods import _Method
from .sharding import REPLICATE_BYTES_DEFINITION
from .tasks import _ImageTask, _TextTask

log = logging.getLogger("slimcomm.train")  # the command's name in its log lines

__all__ = ["build_model", "run", "main", "machine_note"]  # the package re-exports these (slimcomm.train.main, ...)

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
            "outer_momentum", "value_bits", "error_decay", "no_scale_grads", "time_budget", "ist_shared", "mesh")
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
    set_comm_thread_priority(args.comm_thread_priority)
    try:
        result = _train(rank, world_size, args, device, backend)
        # every rank is done with its collectives before any rank tears the group down (a rank
        # destroying its gloo group while a peer still finishes the last exchange was seen to
        # abort at exit: "terminate called without an active exception")
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()



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
    set_comm_thread_priority(args.comm_thread_priority)  # the loop threads of groups made since
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
            kw = {"lockstep": True} if method.eval_lockstep else {}  # --mesh: sharded forwards in step
            scores = task.evaluate(method.eval_model(), world_size, split=method.eval_split, **kw)
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

    probe = None
    if args.link_times and world_size > 1:  # collective: every rank times the same few calls, after training
        probe = train_projection.probe_link(train_projection.pattern_of(args.method, vars(args)),
                                           world_size, device)
    profile = method.profiler.summary() if method.profiler is not None else None  # collective
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
        # groups runs that differ only by seed (--plot-from; slimcomm.train.report.config_key)
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
        "bytes_definition": BYTES_DEFINITION if method.mesh is None else REPLICATE_BYTES_DEFINITION,
        # --mesh R,S: the sizes and the bytes across the replicate dimension (the slow link); else None
        "mesh": method.mesh.describe(method.steps) if method.mesh is not None else None,
        "dense_bytes_per_step": method.dense_step_bytes,
        "epochs": epochs,
        "evals": evals,
        "final": dict(final_scores, train_time_s=train_time, eval_time_s=eval_time,
                      wall_time_s=time.perf_counter() - wall0, bytes_sent_per_rank=method.bytes_sent(),
                      dense_bytes_per_rank=method.steps * method.dense_step_bytes),
        "time_to_target": time_to_target,
        "wire": wire_ranks,
        "stats": method.stats(),
        "profile": profile,
        "env": {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
                "threads_per_rank": args.threads, "cpu": _cpu_model(), "cpus": os.cpu_count()},
    }
    if probe is not None:
        train_projection.add_link_times(result, probe, args.link_times)
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
    """One spawned rank. After a normal return (results written, process group destroyed)
    the process ends with ``os._exit(0)`` once its output is flushed: under load, a gloo
    rank was seen to abort in interpreter teardown ("terminate called without an active
    exception", SIGABRT) after all its work was done, failing a finished run. An error
    still propagates and exits non-zero as before."""
    _worker(rank, args, init_method)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _check_corpus(args: argparse.Namespace) -> None:
    """Load the text corpus and cut every rank's windows once in the parent, so that a bad
    ``--text-file`` (not UTF-8, too short for ``--block-size`` or for a rank's shard) is one
    line (``SystemExit``) instead of an error inside every spawned rank's traceback."""
    try:
        corpus = text_mod.load_corpus(args.text_file, args.tokens)
        text_mod.TrainWindows(corpus.train, args.block_size, args.batch_size, 0,  # equal shards
                              args.world_size, seed=args.seed)
        text_mod.validation_batches(corpus.val, args.block_size, args.batch_size, args.val_batches)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"error: {exc}") from None


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
    if args.model == "gpt":
        _check_corpus(args)
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
    what = ("payload bytes per rank across the replicate dimension (--mesh: between replica groups)"
            if any(r.get("mesh") for r in results) else "payload bytes handed to collectives per rank")
    print(setting_summary(results) + "; MB = " + what)
    print(compare_table(results))
    print(machine_note(results))
    projected = [r for r in results if r.get("link_times")]
    if projected:
        rates = list(projected[0]["link_times"]["links"])
        print()
        print(f"train time and time to {_target_text(results)} per link (the loopback rows are the runs above):")
        print(train_projection.links_table(results))
        print(train_projection.projection_note(rates, [r["method"] for r in projected],
                                               any(train_projection.overlaps(r) for r in projected)) + ".")
    if args.compare:
        print(f"wrote {', '.join(os.path.join(args.out_dir, m + '.json') for m in methods)}")
    else:
        print(f"wrote {args.out}")
    if plot:
        if projected:
            slow = "100mbit" if "100mbit" in rates else rates[-1]
            shown = results + [train_projection.link_result(r, slow) for r in projected]
            titles = {None: "loopback (measured, this machine)",
                      slow: f"{train_projection.LINK_NAMES.get(slow, slow)} per link (projected)"}
            print(f"wrote {plot_results(shown, plot, band=args.plot_band, rate_titles=titles, log_time=True)}")
        else:
            print(f"wrote {plot_results(results, plot, band=args.plot_band)}")
    return 0


def _target_text(results) -> str:
    for r in results:
        if r.get("time_to_target"):
            return f"{r['time_to_target']['target']:g}"
    cfg = results[0].get("config", {})
    return f"{cfg['target_acc']:g}" if cfg.get("target_acc") is not None else "target"


def machine_note(results) -> str:
    """One line: which columns depend on this machine (and its load now), which are exact."""
    try:
        load = "load average %.1f / %.1f / %.1f (1 / 5 / 15 min)" % os.getloadavg()
    except OSError:
        load = "load average unknown"
    threads = sorted({r.get("env", {}).get("threads_per_rank") for r in results} - {None})
    what = ("train time, time vs ddp and time to target" if len(results) > 1 and any(r["method"] == "ddp" for r in results)
            else "train time and time to target")
    return (f"{what}: measured on this machine ({platform.node()}, "
            f"{os.cpu_count()} cores, {','.join(map(str, threads))} thread(s) per rank, {load} at the end), "
            "so they change with the machine and its load; test acc: the same for the same seed, torch and "
            "threads; MB: exact byte counts, the same on every machine")


def _cpu_model() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``; else ``platform.processor()``), for the
    results' ``env``: timings from runs on different CPUs do not compare."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
