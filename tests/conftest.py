"""Suite-wide settings.

The single-process oracles (e.g. the hook simulation in test_hooks.py) are
compared bit for bit with multi-rank runs whose ranks use one intra-op thread
(tests/_dist.py). A matmul's summation order can depend on the thread count,
so the test process uses one thread too; tests that check thread independence
set their own counts.
"""

import torch

torch.set_num_threads(1)
