"""``ISTStats``: the communication counters of one rank of an
:class:`~slimcomm.ist.ISTTrainer`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ISTStats:
    """Communication counters of one rank of an :class:`ISTTrainer` (bytes).

    Attributes:
        rounds: synchronisation rounds completed (collectives issued).
        steps: local training steps taken.
        payload_bytes: this rank's trained slices plus the shared output bias
            (and BatchNorm running statistics), unpadded, summed over rounds.
            Per round this is the analytic subnet size: per Linear,
            ``n_in * n_out / subnets`` for the first and last layer and
            ``n_in * n_out / subnets**2`` between hidden layers (exactly:
            the product of the block sizes), times the value size: the
            model's dtype with ``exchange_bits=None``, else ``exchange_bits/8``
            bytes per value (codes padded to an even byte count) plus 2 bytes
            per 4096-value chunk (bf16 scales).
            With shared neurons (``ISTTrainer(shared=f)``) it also counts the
            shared region handed to the extra ``all_reduce`` (fp32, 4 bytes
            per element) every round.
        bytes_sent, bytes_received: this rank's traffic in the synchronisation
            ``all_gather`` under the ring algorithm: ``(world_size - 1)`` times
            the padded buffer (the largest rank's payload) per round, each way;
            with shared neurons plus the ring ``all_reduce`` of the shared
            region, ``2 (world_size - 1) / world_size`` times its bytes.
        dense_bytes_sent, dense_bytes_received: what data-parallel training
            with a ring all-reduce of every trainable parameter's gradient
            (``N`` elements) would move per rank over the same ``steps``:
            ``steps * 2 * (world_size - 1) * N * itemsize // world_size``.
        check_bytes: bytes this rank put into the per-round agreement
            all-reduce (80 per synchronisation; not in ``bytes_sent``).
    """

    rounds: int = 0
    steps: int = 0
    payload_bytes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    dense_bytes_sent: int = 0
    dense_bytes_received: int = 0
    check_bytes: int = 0
