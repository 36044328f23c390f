"""The training command's smaller checks of issue 23 (item 10).

* ``--world-size 1``: no method reports bytes "sent" (a collective over one
  rank sends nothing); before, slimdp reported its hook's byte counter.
* A bad ``--text-file`` is one ``error:`` line from the parent, before any
  rank is spawned, instead of a ValueError inside every rank's traceback.
"""

import pytest
import torch
import torch.nn.functional as F

from slimcomm import train as T

from _dist import run_workers


def _world_size_1_body(rank, world_size, method):
    args = T.build_parser().parse_args(["--method", method, "--dataset", "digits"])
    T.apply_method_defaults(args)
    args.device = "cpu"
    torch.manual_seed(0)
    model = T.build_model(5, (7,), 3)
    m = T._Method(args, model, 1, F.cross_entropy, total_steps=4, classify=True)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    for _ in range(4):
        m.train_step(x, y)
    sent = m.bytes_sent()
    del m, model   # DDP's reducer before the process group (tests/_dist.py destroys it)
    return sent


@pytest.mark.parametrize("method", ["slimdp", "topk", "ddp", "slimdp-local"])
def test_world_size_1_sends_nothing(method):
    # In a fresh process (tests/_dist.py, bounded by its timeout): a gloo group and a DDP
    # reducer torn down inside the pytest process once hung in ~ProcessGroupGloo's join.
    assert run_workers(_world_size_1_body, 1, method, timeout=120)[0] == 0


@pytest.mark.parametrize("content,extra,needle", [
    (b"\xff\xfe not utf-8 \xff" * 50, [], "not UTF-8"),
    (b"tiny corpus", ["--block-size", "64"], "--block-size 64"),
])
def test_bad_text_file_is_one_line_from_the_parent(content, extra, needle, tmp_path, monkeypatch):
    f = tmp_path / "corpus.txt"
    f.write_bytes(content)

    def no_spawn(*a, **k):
        raise AssertionError("ranks were spawned for a corpus the parent can reject")

    import torch.multiprocessing as mp
    monkeypatch.setattr(mp, "start_processes", no_spawn)
    with pytest.raises(SystemExit) as exc:
        T.main(["--model", "gpt", "--method", "ddp", "--world-size", "2", "--text-file", str(f),
                "--steps", "2", "--out-dir", str(tmp_path / "out"), "--no-progress", *extra])
    msg = str(exc.value)
    assert msg.startswith("error: --") and needle in msg and "\n" not in msg
