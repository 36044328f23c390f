"""Bytes on the wire: a network interface's kernel byte counters around training steps.

Used by the training command's ``--wire-iface`` (and through it by
``bench/netbench.py``) to report what each rank's link actually carried,
beside the payload bytes slimcomm hands to the collectives. The counters are
Linux's ``/sys/class/net/<iface>/statistics/{tx,rx}_bytes``: every byte of
every frame the interface sent or received (Ethernet + IP + TCP headers,
retransmissions, ACKs), inside the network namespace the process runs in
(``ip netns exec`` mounts that namespace's ``/sys``).
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple


class WireCounter:
    """Per-window TX/RX byte deltas of one interface.

    ``with counter.window(step=True): ...`` adds the bytes the interface sent
    and received during the block; windows marked ``step=True`` also append
    one entry to :attr:`per_step` (TX + RX bytes of that block), so steady
    state can be told apart from warm-up steps.

    Args:
        iface: interface name, e.g. ``"v0"`` (``GLOO_SOCKET_IFNAME``).

    Raises:
        ValueError: ``iface`` is not an existing interface of this network
            namespace (or its counters cannot be read).
    """

    def __init__(self, iface: str):
        base = os.path.join("/sys/class/net", iface, "statistics")
        self.iface = iface
        self._paths = (os.path.join(base, "tx_bytes"), os.path.join(base, "rx_bytes"))
        try:
            self._read()
        except (OSError, ValueError) as e:
            raise ValueError(f"--wire-iface {iface!r}: cannot read {base}/{{tx,rx}}_bytes ({e}); "
                             f"interfaces here: {sorted(os.listdir('/sys/class/net'))}") from None
        self.tx = 0
        self.rx = 0
        self.per_step: List[int] = []

    def _read(self) -> Tuple[int, int]:
        vals = []
        for p in self._paths:
            with open(p) as f:
                vals.append(int(f.read().strip()))
        return vals[0], vals[1]

    def window(self, step: bool = False) -> "_Window":
        """A context manager counting the bytes of one block (see the class docstring)."""
        return _Window(self, step)

    def summary(self) -> Dict[str, object]:
        """``{"iface", "tx_bytes", "rx_bytes", "per_step_bytes"}`` (totals over all windows)."""
        return {"iface": self.iface, "tx_bytes": self.tx, "rx_bytes": self.rx,
                "per_step_bytes": list(self.per_step)}


class _Window:
    __slots__ = ("c", "step", "t0", "r0")

    def __init__(self, counter: WireCounter, step: bool):
        self.c = counter
        self.step = step

    def __enter__(self):
        self.t0, self.r0 = self.c._read()
        return self

    def __exit__(self, *exc):
        t1, r1 = self.c._read()
        dt, dr = t1 - self.t0, r1 - self.r0
        self.c.tx += dt
        self.c.rx += dr
        if self.step:
            self.c.per_step.append(dt + dr)
        return False
