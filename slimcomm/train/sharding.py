"""``--mesh R,S``: the GPT sharded with FSDP2 over a 2-D ``(replicate, shard)`` CPU/GPU mesh.

R replica groups ("nodes") of S ranks each, ``R * S = --world-size``; ranks
``r*S .. r*S+S-1`` form replica group ``r``. Every transformer block and then
the whole GPT are wrapped with ``fully_shard``; FSDP's all-gathers and
reduce-scatters stay inside a replica group (the fast links), and what crosses
between the groups (the slow link) depends on ``--method``:

* ``ddp``: plain HSDP, ``fully_shard`` over the 2-D mesh: FSDP's own dense
  all-reduce of every gradient shard across the replicate dimension;
* ``slimdp``: ``fully_shard`` over the 1-D shard sub-mesh and
  :func:`slimcomm.register_slim_dp_hook` with ``replicate_group=mesh["replicate"]``
  (the replicate all-reduce compressed by Slim-DP);
* ``slimdp-local`` / ``diloco`` / ``sparseloco``: ``fully_shard`` over the shard
  sub-mesh (the inner steps are FSDP inside the replica group) and
  :class:`slimcomm.optim.SlimDPOptimizer` with ``process_group=mesh["replicate"]``.

The other methods are refused (:func:`check_mesh_args`). Bytes are counted
across the replicate dimension only (:data:`REPLICATE_BYTES_DEFINITION`).
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

MESH_METHODS = ("ddp", "slimdp", "slimdp-local", "diloco", "sparseloco")
"""The methods ``--mesh`` supports (see the module docstring)."""

REPLICATE_BYTES_DEFINITION = (
    "--mesh R,S: payload bytes each rank hands to collectives across the replicate dimension (between the "
    "R replica groups, the slow link), summed over training steps: ddp (HSDP) = its padded gradient shard "
    "(fp32) every step, slimdp = the Slim-DP hook's payload, slimdp-local/diloco/sparseloco = "
    "SlimDPOptimizer's synchronisations; FSDP's all-gathers and reduce-scatters inside a replica group "
    "are not counted"
)


def parse_mesh(s: str) -> Tuple[int, int]:
    """argparse type of ``--mesh``: ``"R,S"`` -> ``(R, S)``, both positive integers."""
    parts = [x.strip() for x in s.split(",")]
    try:
        sizes = tuple(int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be two comma-separated integers R,S, got {s!r}") from None
    if len(sizes) != 2 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"must be two positive integers R,S (replica groups, shards per "
                                         f"group), got {s!r}")
    return sizes


def check_mesh_args(args: argparse.Namespace, bad: Callable[[str], None]) -> None:
    """Refuse what ``--mesh`` does not support, by calling ``bad(message)`` (which raises)."""
    mesh = getattr(args, "mesh", None)
    if mesh is None:
        return
    r, s = mesh
    if args.model != "gpt":
        bad(f"--mesh shards the GPT with FSDP2; it needs --model gpt, got --model {args.model}")
    if args.method not in MESH_METHODS:
        bad(f"--mesh supports --method {', '.join(MESH_METHODS)}; got --method {args.method}")
    ws = getattr(args, "world_size", None)
    if ws is not None and r * s != ws:
        bad(f"--mesh {r},{s} has {r * s} ranks but --world-size is {ws} (R * S must equal the world size)")
    if getattr(args, "profile", False):
        bad("--profile does not apply with --mesh (it times the DDP and optimizer-side methods unsharded)")
    if getattr(args, "min_compress_numel", None) is not None:
        bad("--min-compress-numel is an option of the DDP hook; with --mesh the FSDP hook "
            "compresses every parameter shard")
    if getattr(args, "delay_steps", 0):
        bad("--delay-steps 1 does not apply with --mesh (the FSDP2 Slim-DP hook has no delayed mode)")


def _padded_shard_numel(p: torch.Tensor, shard_size: int) -> int:
    """Elements of FSDP2's padded dim-0 shard of ``p`` over ``shard_size`` ranks."""
    if p.dim() == 0:
        return 1
    rows = math.ceil(p.shape[0] / shard_size)
    return rows * math.prod(p.shape[1:])


class MeshSetup:
    """The GPT sharded for one method: the mesh, the wrapped model and what synchronises it.

    Args:
        args: the resolved options (``args.mesh = (R, S)``, ``args.method`` in :data:`MESH_METHODS`).
        model: the full GPT (identical initial weights on every rank), sharded in place.
        make_optimizer: ``make_optimizer(params) -> torch optimizer`` (the command's SGD/AdamW).
        build_sync_optimizer: ``build_sync_optimizer(args, model, inner, process_group=...)``.

    Attributes:
        mesh: the 2-D ``DeviceMesh`` ``("replicate", "shard")``.
        opt: what the training step calls ``zero_grad`` / ``step`` on.
        inner: the torch optimizer the learning-rate schedule drives.
        hook_state: the :class:`slimcomm.SlimDPFSDPState` (``slimdp``), else None.
        dense_step_bytes: one dense replicate all-reduce of this rank's padded gradient shards (fp32).
    """

    def __init__(self, args, model: nn.Module, make_optimizer: Callable, build_sync_optimizer: Callable):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        r, s = args.mesh
        self.replicas, self.shards = r, s
        self.method = args.method
        self.mesh = init_device_mesh(args.device, (r, s), mesh_dim_names=("replicate", "shard"))
        hsdp = self.method == "ddp"
        fsdp_mesh = self.mesh if hsdp else self.mesh["shard"]
        for block in model.blocks:
            fully_shard(block, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
        self.model = model
        self.hook_state = None
        self.sync_optimizer = None
        element = next(model.parameters()).element_size()
        self.dense_step_bytes = sum(_padded_shard_numel(p, s) for p in model.parameters()) * element
        if self.method in ("slimdp-local", "diloco", "sparseloco"):
            self.inner = make_optimizer(model.parameters())
            self.opt = self.sync_optimizer = build_sync_optimizer(args, model, self.inner,
                                                                  process_group=self.mesh["replicate"])
        else:
            if self.method == "slimdp":
                from ..fsdp import register_slim_dp_hook
                from .methods import _VALUE_DTYPES

                self.hook_state = register_slim_dp_hook(
                    model, replicate_group=self.mesh["replicate"], core_ratio=args.core_ratio,
                    explore_ratio=args.explore_ratio, core_refresh=args.core_refresh,
                    warmup_steps=args.warmup_steps, value_dtype=_VALUE_DTYPES[args.value_dtype],
                    value_bits=args.value_bits, seed=args.seed, timeout=args.timeout)
            self.inner = self.opt = make_optimizer(model.parameters())
        self.steps = 0

    def replicate_bytes(self, steps: int) -> int:
        """Payload bytes per rank across the replicate dimension after ``steps`` training steps
        (:data:`REPLICATE_BYTES_DEFINITION`); 0 with one replica group."""
        if self.replicas == 1:
            return 0
        if self.sync_optimizer is not None:
            return int(self.sync_optimizer.stats["total"]["bytes_sent"])
        if self.hook_state is not None:
            return int(self.hook_state.stats["total"]["bytes_sent"])
        return steps * self.dense_step_bytes

    def describe(self, steps: int) -> Dict[str, Any]:
        """The ``"mesh"`` entry of the results JSON."""
        return {"replicate": self.replicas, "shard": self.shards,
                "fsdp": "hsdp-2d" if self.method == "ddp" else "shard-1d",
                "replicate_bytes_per_rank": self.replicate_bytes(steps),
                "dense_replicate_bytes_per_step": self.dense_step_bytes,
                "replicate_bytes_definition": REPLICATE_BYTES_DEFINITION}
