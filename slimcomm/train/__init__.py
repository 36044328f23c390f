"""The training command: ``python -m slimcomm.train`` (console script ``slimcomm-train``).

Trains one of three workloads (:mod:`slimcomm.train.workloads`) with ``world_size``
ranks and one of the communication methods below, writes a results JSON per
run, and can compare methods in one table and plot the metric against wall
time and bytes (the tables, plots and ``--plot-from`` live in
:mod:`slimcomm.train.report`; the loop is :mod:`slimcomm.train.loop`):

========== ===================================================================
``--model``   workload
``mlp``       (default) MLP on Fashion-MNIST, or scikit-learn's digits set when
              Fashion-MNIST is not installed; metric: test accuracy.
``cnn``       :class:`~slimcomm.train.workloads.models.ConvNet` on the same images
              (``1 x 28 x 28``; digits: ``1 x 8 x 8``); metric: test accuracy.
``gpt``       :class:`~slimcomm.train.workloads.models.GPT`, a decoder-only
              transformer trained on a text corpus (Debian's ``fortunes`` or
              ``--text-file``, :mod:`slimcomm.train.workloads.text`) for ``--steps``
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
              With ``--model gpt``: :class:`slimcomm.ist.GPTISTTrainer`, the
              attention heads and FFN neurons of every block partitioned,
              embeddings, LayerNorms, residual biases and the head averaged
              (sent whole in the same all-gather); ``--grad-clip`` clips
              each rank's subnet gradient.
``local``     no communication at all: each rank trains its own replica alone on
              its own shard (same initial weights, batch and optimizer settings as
              ``ddp`` by default). Not a way to train: its ms/step is the compute
              limit of the other methods (``bench/netbench.py --methods ...,local``).
              Evaluation: every rank scores its own model on the whole evaluation
              set, the reported score is the mean over ranks.
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
counted. With ``--world-size 1`` every method reports 0 (a collective over one
rank sends nothing). Per method:

* ``ddp``: ``4 * P`` bytes per step (``P`` = number of parameters, fp32).
* ``fp16``: ``2 * P`` bytes per step.
* ``powersgd``: ``4 * P`` per step for the first ``--powersgd-start-iter``
  steps (dense warm-up), then ``4 * sum((n + m) * r)`` over compressed
  ``n x m`` gradients plus ``4 * numel`` for tensors left uncompressed
  (PowerSGD's own ``total_numel_after_compression`` counter).
* ``topk`` / ``slimdp``: the hook's ``state.stats`` byte counter.
* ``topk``'s all-gather counts this rank's own (index, value) pairs.
* ``ist``: per synchronisation round, the padded buffer of this rank's
  trained slices (with the GPT: plus the shared tensors) handed to the one ``all_gather`` (``ISTStats.bytes_sent``
  divided by ``W - 1``, its ring traffic factor).
* ``local``: 0.

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

Times on slower links (``--link-times``, default ``1gbit,100mbit`` for
spawned ranks): after training every rank times a few collectives of the
method's kind on the link it used (loopback), and rank 0 records under
``"link_times"`` its compute time (train time minus those collectives) and its
train time and time-to-target projected onto each rate with the cost model of
:mod:`slimcomm.train.projection`; the table printed after the comparison marks
every figure measured or projected.

Modules
-------
The application, apart from the library (nothing in ``slimcomm`` outside this
subpackage imports it):

* :mod:`slimcomm.train.loop`: one rank's training loop, the results JSON and
  the driver (:func:`run`, :func:`main`);
* :mod:`slimcomm.train.tasks`: the workloads as the loop sees them (data,
  model, batches, evaluation);
* :mod:`slimcomm.train.args`: the options, their defaults and validation, the
  launch and the logging;
* :mod:`slimcomm.train.methods`: how each method wraps the model and
  optimizer, and counts its bytes;
* :mod:`slimcomm.train.projection`: the cost model of ring collectives behind
  ``--link-times``;
* :mod:`slimcomm.train.report`: tables, plots and ``--plot-from``;
* :mod:`slimcomm.train.wire`: the network-interface counters of ``--wire-iface``;
* :mod:`slimcomm.train.workloads`: the models, the image data and the text corpus.

The names callers use are available here (``slimcomm.train.main``,
``slimcomm.train.build_parser``, ...), imported on first use, so that
``import slimcomm.train.report`` (which never imports torch) stays light.
"""

import importlib as _importlib
import typing as _typing

# public name -> the submodule that defines it
_NAMES = {
    "loop": ("run", "main", "build_model", "machine_note", "BYTES_DEFINITION", "_write_json_atomic"),
    "args": ("ADAMW_DEFAULTS", "CNN_METHOD_DEFAULTS", "GPT_DEFAULTS", "LOG_FORMAT", "LOG_LEVELS",
             "METHOD_DEFAULTS", "METHODS", "MODELS", "SYNC_DEFAULTS", "apply_method_defaults", "build_parser",
             "log_level", "setup_logging", "_resolve_launch"),
    "methods": ("SYNC_OPTIMIZER_BUILDERS", "lr_factor", "model_device", "_Method"),
    "report": ("RESULT_FORMAT", "compare_table", "plot_results"),
}
_HOME = {name: module for module, names in _NAMES.items() for name in names}

__all__ = ["METHODS", "MODELS", "build_parser", "build_model", "apply_method_defaults", "run", "compare_table",
           "plot_results", "main"]


def __getattr__(name: str) -> _typing.Any:
    try:
        module = _HOME[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(_importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> _typing.List[str]:
    return sorted(set(globals()) | set(_HOME))
