"""The workloads as the training loop sees them: one task class per ``--model``.

A task loads its data (per-rank shards) and builds its model
(:mod:`slimcomm.train.workloads`), yields the training batches, evaluates the
model (one small all-reduce over the ranks) and describes itself for the
results JSON. :class:`_ImageTask` is ``--model mlp`` / ``cnn`` (metric: test
accuracy); :class:`_TextTask` is ``--model gpt`` (metric: validation loss).
The loop that drives them is :mod:`slimcomm.train.loop`.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .workloads import data as data_mod
from .workloads import models as models_mod
from .workloads import text as text_mod


@torch.no_grad()
def _evaluate(model, x, y, rank, world_size, device, split=True):
    """Test loss and accuracy over the whole test set, split across ranks; one scalar all-reduce.

    ``split=False`` (ranks with different models): every rank scores its own model on the whole
    test set and the result is the mean over ranks of their accuracies and losses (the same
    all-reduce of counts: correct and sample totals summed over ranks)."""
    was = model.training
    model.eval()
    xs, ys = (x[rank::world_size], y[rank::world_size]) if split else (x, y)
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

    def evaluate(self, model, world_size, split: bool = True) -> Dict[str, float]:
        """Test accuracy and mean loss; collective (one all-reduce). ``split=False``: the mean over
        ranks of each rank's own model on the whole test set (see :func:`_evaluate`)."""
        acc, loss = _evaluate(model, self.x_test, self.y_test, self.rank, world_size, self.device, split)
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
    def evaluate(self, model, world_size, split: bool = True, lockstep: bool = False) -> Dict[str, float]:
        """Mean validation loss (nats/token) over all validation batches; each rank takes every W-th one.
        Collective (one all-reduce). ``split=False``: every rank scores its own model on every batch;
        the result is the mean over ranks. ``lockstep=True`` (a model sharded with FSDP, whose forward
        is collective inside a replica group): every rank runs the same number of forwards,
        ceil(batches / W); a rank left without a batch of its own scores the first one again, uncounted."""
        was = model.training
        model.eval()
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)
        mine = self.val[self.rank::world_size] if split else self.val
        rounds = len(mine)
        if lockstep and split:
            rounds = -(-len(self.val) // world_size)
        for i in range(rounds):
            x, y = mine[i] if i < len(mine) else self.val[0]
            loss = F.cross_entropy(model(x).reshape(-1, self.vocab_size), y.reshape(-1), reduction="sum").double()
            if i < len(mine):
                acc[0] += loss
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

