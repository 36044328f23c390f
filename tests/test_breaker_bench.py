"""Found by the breaker (bench scripts used as a new user would)."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import profile_table  # noqa: E402


def _prof():
    m = {"forward": 1.0, "backward_compute": 1.0, "hook": 1.0, "wait": 0.0, "optimizer": 1.0,
         "step": 4.0}
    return {"steps": 10, "skip": 3, "ranks": [m], "mean": m, "max": m}


def test_profile_table_reads_the_training_commands_own_out_dir(tmp_path):
    # slimcomm.train --profile --out-dir D writes D/slimdp.json (no "<rate>_" prefix): the
    # method was read as the rate and the method column left empty.
    with open(tmp_path / "slimdp.json", "w") as f:
        json.dump({"method": "slimdp", "world_size": 2, "profile": _prof()}, f)
    runs = profile_table.load([str(tmp_path)])
    assert runs == {"loopback": {"slimdp": runs["loopback"]["slimdp"]}}
    assert "| slimdp " in profile_table.table(runs["loopback"])
