"""slimcomm.agreement: cross-rank checks on 3 gloo ranks (one all-reduce each)."""

import pytest
import torch

from _dist import run_workers
from slimcomm.agreement import agree_across_ranks, gather_across_ranks, max_min_across_ranks


def _body(rank, world_size, case):
    if case == "max_min":
        hi, lo = max_min_across_ranks(torch.tensor([rank, 7, -rank * 2**40], dtype=torch.int64))
        return hi.tolist(), lo.tolist()
    if case == "gather":
        return gather_across_ranks(10 * rank - 2**62)
    values = {"same": 5, "differs": 1 if (case == "differ" and rank == 2) else 0, "big": 2**62 + 1}
    error = ValueError(f"rank {rank}'s own problem") if (case == "fail" and rank == 1) else None
    try:
        return agree_across_ranks(values, error, other_failed="another rank failed")
    except Exception as e:  # noqa: BLE001 - report what each rank raised
        return f"{type(e).__name__}: {e}"


def test_max_min():
    for hi, lo in run_workers(_body, 3, "max_min", timeout=120):
        assert hi == [2, 7, 0] and lo == [0, 7, -2 * 2**40]


def test_gather():
    assert run_workers(_body, 3, "gather", timeout=120) == [[-2**62, 10 - 2**62, 20 - 2**62]] * 3


@pytest.mark.parametrize("case,expect", [
    ("agree", [[], [], []]),
    ("differ", [["differs"]] * 3),
    ("fail", ["RuntimeError: another rank failed (failed rank(s) [1] of the process group)",
              "ValueError: rank 1's own problem",
              "RuntimeError: another rank failed (failed rank(s) [1] of the process group)"]),
])
def test_agree_across_ranks(case, expect):
    assert run_workers(_body, 3, case, timeout=120) == expect
