#!/usr/bin/env python3
"""Time gloo's all-reduce and all-gather through the emulated slow network, idle gaps included.

The cost model (``bench/costmodel.py``) needs the time of one collective of
``B`` bytes on ``W`` ranks at a link rate. Inferring it from training step
times (compute and transfer fitted together) cannot tell per-hop latency from
compute on 2 ranks; this script measures it directly: every rank of a
:class:`netbench.EmulatedNetwork` runs this file with ``--worker``, and for each
collective kind and message size times ``--repeats`` calls (after a warm-up),
each one preceded by ``--gap-ms`` of idle time on every rank, because a
training step leaves the link idle during compute and Linux TCP restarts slow
start on a connection idle for longer than its retransmission timeout
(``net.ipv4.tcp_slow_start_after_idle``, RFC 2861), which back-to-back timing
would hide. ``--gap-mode compute`` keeps every rank's thread busy during the
gap instead (a fixed amount of work; ranks beyond the machine's cores share
them and reach the collective at different times, as in a training step), so the link alone and the link next to compute can be told
apart.

For every (rate, world size, gap) the JSON holds per (kind, bytes) the median
over repeats of the call's time from the last rank's entry to the last rank's
exit (the collective itself; ``time.perf_counter`` is CLOCK_MONOTONIC, one clock
for every process on the host) and the entry skew (how much earlier the first
rank arrived: compute imbalance, not the link), and, per rate, the alpha-beta
:class:`costmodel.LinkModel` fitted on the 2-rank timings only
(:func:`costmodel.fit_link`; it refuses fewer than two message sizes) with its
prediction error on every larger world size. ``bench/costmodel.py --links``
reads the file instead of fitting the link from step times.

Bytes: all-reduce ``B`` = the buffer (fp32); all-gather ``B`` = each rank's
contribution. Needs root (network namespaces), like ``bench/netbench.py``.

Example (the committed table)::

    sudo .venv/bin/python bench/collbench.py --world-sizes 2,8 --rates 100mbit,1gbit --gaps-ms 0,300 \\
        --out bench/results/scale/collbench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KINDS = ("allreduce", "allgather")


def _int_list(name: str, s: str, lo: int) -> List[int]:
    try:
        out = [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} {s!r}: expected comma-separated integers") from None
    if not out or any(x < lo for x in out):
        raise argparse.ArgumentTypeError(f"{name} {s!r}: every entry must be >= {lo}")
    return out


def worker(a: argparse.Namespace) -> None:
    """One rank: time every (kind, size) after each gap; rank 0 writes the times from the last entry."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master_addr}:{a.port}", rank=a.rank,
                            world_size=a.world_size)
    w = a.world_size
    m, mo = torch.rand(128, 128), torch.empty(128, 128)
    times: Dict[str, Dict[int, List[float]]] = {k: {} for k in KINDS}
    for kind in KINDS:
        for nbytes in a.sizes:
            if kind == "allgather" and nbytes > a.max_allgather_bytes:
                continue
            x = torch.ones(max(1, nbytes // 4))
            outs = [torch.empty_like(x) for _ in range(w)]
            row = []
            for i in range(a.warmup + a.repeats):
                dist.barrier()
                if a.gap_mode == "sleep":
                    time.sleep(a.gap_ms / 1000.0)
                else:  # a training step's compute: a fixed amount of work (gap ms on a core of its own)
                    for _ in range(a.gap_iters):
                        torch.mm(m, m, out=mo)
                t0 = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process on the host
                if kind == "allreduce":
                    dist.all_reduce(x)
                else:
                    dist.all_gather(outs, x)
                if i >= a.warmup:
                    row.append((t0, time.perf_counter()))
            times[kind][nbytes] = row
    # per repeat: the collective's own time, from the last rank's entry to the last rank's exit, and the
    # spread of the entries (ranks reaching it at different times: compute skew, not the link)
    pairs = [p for k in KINDS for n in sorted(times[k]) for p in times[k][n]]
    last = torch.tensor([v for p in pairs for v in p], dtype=torch.float64)
    first = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    dist.all_reduce(last, op=dist.ReduceOp.MAX)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    if a.rank == 0:
        out, i = [], 0
        for k in KINDS:
            for n in sorted(times[k]):
                ent, ext = last[2 * i:2 * (i + a.repeats):2], last[2 * i + 1:2 * (i + a.repeats):2]
                vals = (ext - ent).tolist()
                skew = (ent - first[i:i + a.repeats]).tolist()
                i += a.repeats
                out.append({"kind": k, "bytes": n, "median_s": statistics.median(vals), "times_s": vals,
                            "entry_skew_s": statistics.median(skew)})
        with open(a.result, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def calibrate_iters(gap_ms: float) -> int:
    """128x128 fp32 matrix products one thread does in ``gap_ms`` on an otherwise idle core."""
    import torch

    torch.set_num_threads(1)
    m, mo = torch.rand(128, 128), torch.empty(128, 128)
    for _ in range(50):
        torch.mm(m, m, out=mo)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        torch.mm(m, m, out=mo)
        n += 1
    return int(round(gap_ms / 1000.0 * n / (time.perf_counter() - t0)))


def run_world(net, a: argparse.Namespace, gap_ms: float, port: int) -> List[Dict]:
    """Launch one worker per namespace of ``net``; return rank 0's timings."""
    import tempfile

    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    common = ["--worker", "--world-size", str(net.world_size), "--master-addr", net.addrs[0],
              "--port", str(port), "--sizes", ",".join(map(str, a.sizes)), "--repeats", str(a.repeats),
              "--warmup", str(a.warmup), "--gap-ms", str(gap_ms), "--gap-mode", a.gap_mode,
              "--gap-iters", str(calibrate_iters(gap_ms) if a.gap_mode == "compute" else 0), "--result", result,
              "--max-allgather-bytes", str(a.max_allgather_bytes)]
    procs = []
    try:
        for r in range(net.world_size):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=net.ifnames[r])
            procs.append(subprocess.Popen(net.exec_prefix(r) + [sys.executable, os.path.abspath(__file__)]
                                          + common + ["--rank", str(r)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + a.timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        if any(c != 0 for c in codes):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            logs = "\n".join(f"--- rank {r} (exit {c}) ---\n{(p.communicate()[0] or '')[-1500:]}"
                             for r, (p, c) in enumerate(zip(procs, codes)))
            raise RuntimeError(f"collbench at {net.rate}, {net.world_size} ranks failed or timed out:\n{logs}")
        with open(result) as f:
            return json.load(f)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        os.remove(result)


def fit_and_check(rows: Sequence[Dict]) -> Dict[str, Dict]:
    """Per (rate, gap): the link fitted on the 2-rank timings and its error on every other world size."""
    from costmodel import fit_link

    out: Dict[str, Dict] = {}
    for key in sorted({(r["rate"], r["gap_ms"]) for r in rows}):
        rate, gap = key
        sel = [r for r in rows if r["rate"] == rate and r["gap_ms"] == gap]
        two = [(t["kind"], t["bytes"], 2, 1.0, t["median_s"]) for r in sel if r["world_size"] == 2
               for t in r["timings"]]
        link = fit_link(two)
        checks = []
        for r in sel:
            for t in r["timings"]:
                pred = link.collective_s(t["kind"], t["bytes"], r["world_size"])
                checks.append({"world_size": r["world_size"], "kind": t["kind"], "bytes": t["bytes"],
                               "measured_s": t["median_s"], "predicted_s": pred,
                               "entry_skew_s": t.get("entry_skew_s", 0.0),
                               "error": pred / t["median_s"] - 1.0})
        out[f"{rate}@{gap:g}ms"] = {"rate": rate, "gap_ms": gap, "alpha_s": link.alpha_s,
                                    "goodput_bps": link.goodput_bps, "checks": checks}
    return out


def markdown(doc: Dict) -> str:
    from tabulate import tabulate

    lines = [f"# gloo collectives through the emulated network ({doc['date']})\n",
             f"Command: `{doc['command']}`\n",
             "Median over repeats of each call's time from the last rank's entry to the last rank's exit "
             "(entry skew = how much earlier the first rank arrived); every call follows "
             f"{'/'.join(str(g) for g in doc['gaps_ms'])} ms of "
             + ("idle time on every rank (a barrier, then sleep)" if doc.get("gap_mode", "sleep") == "sleep" else
                "compute on every rank (a barrier, then the 128x128 matrix products one idle core does in that time)")
             + f" on a {doc.get('cores', '?')}-core machine. all-reduce bytes = fp32 buffer, all-gather bytes = each rank's contribution. "
             "alpha-beta link fitted on the 2-rank timings only (bench/costmodel.py fit_link), checked "
             "on the others.\n"]
    for key, f in doc["fits"].items():
        errs = [abs(c["error"]) for c in f["checks"] if c["world_size"] > 2]
        gap = "idle gap" if doc.get("gap_mode", "sleep") == "sleep" else "compute gap"
        lines.append(f"## {f['rate']}, {gap} {f['gap_ms']:g} ms: alpha {1e3 * f['alpha_s']:.2f} ms/hop, "
                     f"goodput {f['goodput_bps'] / 1e6:.1f} Mbit/s"
                     + (f"; larger world sizes: median |error| {100 * statistics.median(errs):.0f}%, "
                        f"max {100 * max(errs):.0f}%" if errs else "") + "\n")
        lines.append(tabulate([[c["world_size"], c["kind"], c["bytes"], f"{1e3 * c['measured_s']:.2f}",
                                f"{1e3 * c['predicted_s']:.2f}", f"{100 * c['error']:+.0f}%",
                                f"{1e3 * c['entry_skew_s']:.1f}"]
                               for c in f["checks"]],
                              headers=["ranks", "collective", "bytes", "measured ms", "model ms", "error",
                                       "entry skew ms"],
                              tablefmt="github") + "\n")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", default="100mbit,1gbit", help="comma-separated tbf rates per link")
    p.add_argument("--world-sizes", default="2,8", type=lambda s: _int_list("--world-sizes", s, 2),
                   help="comma-separated world sizes; 2 is needed for the fit")
    p.add_argument("--sizes", default="4096,16384,65536,262144,1048576,4194304,16777216",
                   type=lambda s: _int_list("--sizes", s, 4), help="message sizes in bytes")
    p.add_argument("--max-allgather-bytes", type=int, default=4194304,
                   help="skip all-gathers of larger per-rank contributions (W x the time of an all-reduce)")
    p.add_argument("--gaps-ms", default="0,300", type=lambda s: _int_list("--gaps-ms", s, 0),
                   help="idle time before every call, ms (a training step's compute)")
    p.add_argument("--gap-mode", choices=("sleep", "compute"), default="sleep",
                   help="what every rank does during the gap: sleep (an idle CPU), or compute (a fixed number of "
                        "matrix products that take the gap on an idle core, as a training step's work: ranks "
                        "beyond the cores share them and finish at different times)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--port", type=int, default=29710)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per (rate, world size, gap)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "collbench"),
                   help="output base path (writes BASE.json and BASE.md)")
    # worker side (one rank, started by the launcher inside its namespace)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--master-addr", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--gap-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    p.add_argument("--gap-iters", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.repeats < 1 or a.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    if a.worker:
        worker(a)
        return 0
    if 2 not in a.world_sizes:
        p.error(f"--world-sizes {a.world_sizes}: needs 2 (the link model is fitted on 2 ranks only)")
    from netbench import EmulatedNetwork, parse_rate

    rates = [r.strip() for r in a.rates.split(",")]
    for r in rates:
        try:
            parse_rate(r)
        except ValueError as e:
            p.error(str(e))
    import datetime

    rows, port = [], a.port
    for rate in rates:
        for w in a.world_sizes:
            with EmulatedNetwork(w, rate) as net:
                for gap in a.gaps_ms:
                    t0 = time.perf_counter()
                    timings = run_world(net, a, gap, port)
                    port += 1
                    rows.append({"rate": rate, "world_size": w, "gap_ms": gap, "timings": timings})
                    print(f"[collbench] {rate} {w} ranks gap {gap} ms: "
                          + ", ".join(f"{t['kind']} {t['bytes']} B {1e3 * t['median_s']:.1f} ms" for t in timings)
                          + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    doc = {"date": datetime.date.today().isoformat(), "command": " ".join(["bench/collbench.py"] + list(argv or sys.argv[1:])),
           "gaps_ms": a.gaps_ms, "gap_mode": a.gap_mode, "cores": os.cpu_count(), "rows": rows,
           "fits": fit_and_check(rows)}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    md = markdown(doc)
    with open(a.out + ".md", "w") as f:
        f.write(md)
    print(md)
    print(f"[collbench] wrote {a.out}.json and {a.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
