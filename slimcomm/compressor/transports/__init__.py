"""The transports: how one group's values travel, one module each.

Each is a function ``(state, layout, buf, world_size, ...) -> Future`` of ``buf``
that :meth:`SlimDPCompressor.synchronize <slimcomm.compressor.SlimDPCompressor.synchronize>`
dispatches to: :mod:`.dense` (plain average), :mod:`.shared` (Slim-DP: one all-reduce
at the shared index set), :mod:`.local` (per-rank top-k, all-gathered pairs),
:mod:`.lowbit` (low-bit codes at the shared index set, all-gathered),
:mod:`.reduce_scatter` (low-bit codes of a dense group, two-stage all-reduce), :mod:`.delayed`
(the DDP hook's ``delay_steps=1``: each step's all-reduce applied one step later). A new transport
is one new module here and one branch in ``synchronize``.

Ordering rule: every collective is issued from the caller's thread (for the
DDP hook, DDP's), never from a future callback (those run on the backend's
thread, concurrently with the next group's call, so a collective there could
be matched with a different collective on another rank). Non-finite values
are therefore signalled in-band: one flag element per position travels with
the values.
"""

from .delayed import _delayed
from .dense import _dense
from .local import _local
from .lowbit import _quantised
from .reduce_scatter import _reduce_scatter_codes
from .shared import _shared

__all__ = ["_delayed", "_dense", "_shared", "_local", "_quantised", "_reduce_scatter_codes"]
