#!/usr/bin/env python3
"""Time-to-accuracy of slimcomm's methods over an emulated slow network.

Each rank of a ``slimcomm.train`` job runs in its own Linux network namespace;
the namespaces are joined by a veth pair (2 ranks) or by veth pairs to a
bridge in a hub namespace (more ranks), and every link is rate-limited with a
``tbf`` qdisc on both directions (``netem`` is not available on these
kernels, so there is no added delay beyond queueing). Traffic only flows
between the test namespaces; nothing is routed to the host or outside.

For every rate and every method the job is launched with one process per rank
(``ip netns exec <ns> python -m slimcomm.train --rank r ...``), and the
results JSONs are collected under ``--results-dir`` (``bench/out/`` by default,
ignored by git; ``--results-dir bench/results`` for the committed results):

* ``<out-dir>/netbench_<W>ranks.md``: one markdown table per rate: time to the
  target test accuracy, speed-up over ddp, final accuracy after equal epochs,
  MB sent per rank, and the link throughput measured before the runs;
* ``<out-dir>/netbench_<W>ranks.png``: test accuracy vs training wall time,
  one panel per rate;
* ``<out-dir>/netbench_<W>ranks/<rate>_<method>.json``: the raw results
  (per-rank logs under ``.../logs/``).

With ``local`` among ``--methods`` (every rank trains alone on its shard, no
collective in a step) each table adds the *compute limit* -- ddp's steps to the
target x local's measured ms/step in the same run -- and every method's time to
the target as a multiple of it. ``bench/latency_tables.py`` projects the same
results onto links with added one-way delay.

The namespaces are deleted in a ``finally`` block that also runs on SIGINT,
SIGTERM and SIGHUP, and the script checks that they are gone. Needs root
(``ip netns``), ``ip`` and ``tc`` (iproute2).

Example (the headline run, see bench/results/netbench_2ranks.md)::

    sudo .venv/bin/python bench/netbench.py --rates 100mbit,1gbit --results-dir bench/results \\
        --methods ddp,fp16,powersgd,topk,slimdp,ist -- --epochs 2 --batch-size 128 --eval-every 25

Everything after ``--`` is passed to ``slimcomm.train`` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from netbench_projection import apply_budget, project_run, timed_args  # noqa: E402

METHODS = ("ddp", "fp16", "powersgd", "topk", "slimdp", "ist", "diloco", "sparseloco", "slimdp-local", "local")
"""``local``: every rank trains alone (no communication); with ddp in the same run the tables give the
compute limit, ddp's steps to the target x local's ms/step (:func:`netbench_report.compute_limit`)."""
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(s: str) -> float:
    """'100mbit' -> 1e8 bits/s. Raises ValueError naming the argument."""
    m = _RATE_RE.match(s.strip().lower())
    if not m:
        raise ValueError(f"--rates: {s!r} is not a rate like 100mbit, 1gbit, 10gbit")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_timed_steps(spec: str) -> Dict[Optional[str], int]:
    """``"120,ddp=24"`` -> ``{None: 120, "ddp": 24}`` (None: every other method; default 120).

    Raises:
        ValueError: an entry that is not a positive integer, a repeated method or default."""
    out: Dict[Optional[str], int] = {}
    for item in spec.split(","):
        key, _, val = item.strip().rpartition("=")
        key = key.strip() or None
        try:
            n = int(val)
        except ValueError:
            raise ValueError(f"{item!r} is not N or METHOD=N") from None
        if n < 1:
            raise ValueError(f"steps must be >= 1, got {n} in {item!r}")
        if key in out:
            raise ValueError(f"{key or 'the default'} given twice")
        out[key] = n
    out.setdefault(None, 120)
    return out


def _ip(*cmd: str) -> None:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")


class EmulatedNetwork:
    """Per-node network namespaces joined by rate-limited veth links.

    ``with EmulatedNetwork(world_size, rate, nodes=N) as net:`` creates one
    namespace per node, ``net.namespaces[n]`` (names carry this process id, so
    concurrent runs do not collide), gives node n the address ``net.addrs[n]``
    on its uplink interface ``net.ifnames[n]``, and removes everything on exit.
    Ranks ``n*S .. n*S+S-1`` (``S = world_size / nodes``) run in node n's
    namespace (:meth:`node_of`, :meth:`exec_prefix`) and share its address:
    between them traffic goes over the namespace's loopback (not limited), and
    everything between nodes crosses the uplinks. ``nodes`` defaults to
    ``world_size``: one rank per node, every rank on its own limited link.

    Topology: 2 nodes -> one veth pair; more -> one veth pair per node into a
    bridge in a hub namespace. A ``tbf`` qdisc at ``rate`` sits on both ends
    of every veth pair, so each node's send and receive are both limited.
    """

    def __init__(self, world_size: int, rate: str, subnet: int = 77, nodes: Optional[int] = None):
        if world_size < 2:
            raise ValueError(f"--world-size must be >= 2 for a network benchmark, got {world_size}")
        if world_size > 250:
            raise ValueError(f"--world-size {world_size} too large for one /24")
        nodes = world_size if nodes is None else nodes
        if nodes < 2:
            raise ValueError(f"--nodes must be >= 2 (the rate-limited link is between nodes), got {nodes}")
        if world_size % nodes:
            raise ValueError(f"--nodes {nodes} does not divide --world-size {world_size}")
        self.world_size = world_size
        self.nodes = nodes
        self.ranks_per_node = world_size // nodes
        self.rate = rate
        self.rate_bps = parse_rate(rate)
        tag = f"scb{os.getpid()}"
        self.namespaces = [f"{tag}r{n}" for n in range(nodes)]
        self.hub = f"{tag}hub" if nodes > 2 else None
        self.ifnames = [f"v{n}" for n in range(nodes)]
        self.addrs = [f"10.{subnet}.0.{n + 1}" for n in range(nodes)]
        self.created: List[str] = []

    def node_of(self, rank: int) -> int:
        """The node (namespace index) rank ``rank`` runs in."""
        return rank // self.ranks_per_node

    def uplink_bytes(self) -> List[Dict[str, int]]:
        """Every node's uplink kernel counters now: ``[{"tx_bytes", "rx_bytes"}, ...]`` by node."""
        out = []
        for n, ns in enumerate(self.namespaces):
            vals = {}
            for k in ("tx_bytes", "rx_bytes"):
                r = subprocess.run(["ip", "netns", "exec", ns, "cat",
                                    f"/sys/class/net/{self.ifnames[n]}/statistics/{k}"],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    raise RuntimeError(f"reading {k} of {self.ifnames[n]} in {ns} failed: {r.stderr.strip()}")
                vals[k] = int(r.stdout.strip())
            out.append(vals)
        return out

    def _tbf(self, ns: str, dev: str) -> None:
        # burst must cover at least one timer tick at this rate, else tbf under-delivers.
        burst = max(64 * 1024, int(self.rate_bps / 8 / 250))
        _ip("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", self.rate, "burst", str(burst), "latency", "20ms")

    def __enter__(self) -> "EmulatedNetwork":
        try:
            for ns in self.namespaces + ([self.hub] if self.hub else []):
                _ip("ip", "netns", "add", ns)
                self.created.append(ns)
                _ip("ip", "-n", ns, "link", "set", "lo", "up")
            if self.hub is None:
                a, b = self.namespaces
                _ip("ip", "link", "add", "v0", "netns", a, "type", "veth", "peer", "name", "v1", "netns", b)
                for r, ns in enumerate(self.namespaces):
                    _ip("ip", "-n", ns, "addr", "add", f"{self.addrs[r]}/24", "dev", self.ifnames[r])
                    _ip("ip", "-n", ns, "link", "set", self.ifnames[r], "up")
                    self._tbf(ns, self.ifnames[r])
            else:
                _ip("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
                _ip("ip", "-n", self.hub, "link", "set", "br0", "up")
                for r, ns in enumerate(self.namespaces):
                    _ip("ip", "link", "add", self.ifnames[r], "netns", ns, "type", "veth",
                        "peer", "name", f"b{r}", "netns", self.hub)
                    _ip("ip", "-n", self.hub, "link", "set", f"b{r}", "master", "br0")
                    _ip("ip", "-n", self.hub, "link", "set", f"b{r}", "up")
                    _ip("ip", "-n", ns, "addr", "add", f"{self.addrs[r]}/24", "dev", self.ifnames[r])
                    _ip("ip", "-n", ns, "link", "set", self.ifnames[r], "up")
                    self._tbf(ns, self.ifnames[r])
                    self._tbf(self.hub, f"b{r}")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Delete every namespace this object created (their veth ends go with them)."""
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created = []

    def __exit__(self, *exc) -> None:
        self.close()

    def leftovers(self) -> List[str]:
        """Namespaces of this object that still exist (should be [] after close())."""
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        names = {line.split()[0] for line in out.splitlines() if line.strip()}
        return [n for n in self.namespaces + ([self.hub] if self.hub else []) if n in names]

    def exec_prefix(self, rank: int) -> List[str]:
        """The command prefix that runs a process of rank ``rank`` in its node's namespace."""
        return ["ip", "netns", "exec", self.namespaces[self.node_of(rank)]]

    def measure_mbit(self, megabytes: float = 8.0, port: int = 29411, timeout: float = 120.0) -> float:
        """TCP throughput from node 1 to node 0 through the emulated link, in Mbit/s."""
        server = (
            "import socket,sys\n"
            "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('{self.addrs[0]}', {port})); s.listen(1); print('ready', flush=True)\n"
            "c,_=s.accept(); n=0\n"
            "while True:\n"
            "    b=c.recv(1<<20)\n"
            "    if not b: break\n"
            "    n+=len(b)\n"
            "c.sendall(b'done'); c.close(); print(n, flush=True)\n"
        )
        client = (
            "import socket,time\n"
            f"c=socket.create_connection(('{self.addrs[0]}', {port})); buf=b'x'*(1<<20)\n"
            f"t=time.perf_counter()\n"
            f"for _ in range({int(megabytes)}): c.sendall(buf)\n"
            "c.shutdown(socket.SHUT_WR); c.recv(16); print(time.perf_counter()-t, flush=True)\n"
        )
        srv = subprocess.Popen(["ip", "netns", "exec", self.namespaces[0], sys.executable, "-c", server],
                               stdout=subprocess.PIPE, text=True)
        try:
            if srv.stdout.readline().strip() != "ready":
                raise RuntimeError("link throughput probe: server did not start")
            out = subprocess.run(["ip", "netns", "exec", self.namespaces[1], sys.executable, "-c", client],
                                 capture_output=True, text=True, timeout=timeout)
            if out.returncode != 0:
                raise RuntimeError(f"link throughput probe failed: {out.stderr.strip()}")
            secs = float(out.stdout.strip())
        finally:
            try:
                srv.wait(timeout=10)
            except subprocess.TimeoutExpired:
                srv.kill()
                srv.wait()
        return int(megabytes) * (1 << 20) * 8 / secs / 1e6


def run_job(net: EmulatedNetwork, method: str, out_json: str, train_args: Sequence[str], port: int,
            timeout: float, threads: int, log_dir: str) -> Dict:
    """Run one slimcomm.train job with one process per rank inside the namespaces; return rank 0's JSON."""
    procs = []
    logs = []
    os.makedirs(log_dir, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    if os.path.exists(out_json):
        os.remove(out_json)
    uplinks0 = net.uplink_bytes()
    try:
        for r in range(net.world_size):
            iface = net.ifnames[net.node_of(r)]  # the node's uplink; ranks of one node meet over loopback
            e = dict(env, GLOO_SOCKET_IFNAME=iface)
            cmd = net.exec_prefix(r) + [
                sys.executable, "-m", "slimcomm.train", "--method", method,
                "--rank", str(r), "--world-size", str(net.world_size),
                "--master-addr", net.addrs[0], "--master-port", str(port),
                "--threads", str(threads), "--out", out_json, "--timeout", str(timeout),
                "--wire-iface", iface,
            ] + (["--no-progress"] if r > 0 else []) + list(train_args)
            log = open(os.path.join(log_dir, f"{os.path.basename(out_json)[:-5]}_rank{r}.log"), "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:  # only the processes this function started
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if any(c != 0 for c in codes):
        tails = []
        for r in range(net.world_size):
            with open(os.path.join(log_dir, f"{os.path.basename(out_json)[:-5]}_rank{r}.log")) as f:
                tails.append(f"--- rank {r} (exit {codes[r]}) ---\n" + "".join(f.readlines()[-15:]))
        raise RuntimeError(f"{method} at {net.rate} failed or timed out:\n" + "\n".join(tails))
    uplinks1 = net.uplink_bytes()
    with open(out_json) as f:
        res = json.load(f)
    res["nodes"] = {
        "nodes": net.nodes, "ranks_per_node": net.ranks_per_node, "uplink_iface": list(net.ifnames),
        "uplink_tx_bytes": [b["tx_bytes"] - a["tx_bytes"] for a, b in zip(uplinks0, uplinks1)],
        "uplink_rx_bytes": [b["rx_bytes"] - a["rx_bytes"] for a, b in zip(uplinks0, uplinks1)],
        "definition": NODE_BYTES_DEFINITION}
    with open(out_json, "w") as f:
        json.dump(res, f, indent=1)
    return res


NODE_BYTES_DEFINITION = (
    "kernel tx/rx byte counters of each node's rate-limited uplink (the veth of its namespace), read by "
    "netbench before the ranks start and after they exit: the whole job (rendezvous, training, evaluation, "
    "TCP/IP framing); traffic between ranks of one node stays on its loopback and is not in them"
)


from netbench_report import (  # noqa: E402,F401  (re-exported: tests, costmodel)
    _is_lm, markdown, markdown_lm, plot, plot_lm, steady_bytes_per_step)


def _reusable(path: str, extra: Sequence[str]) -> Optional[Dict]:
    """The result at ``path`` if it exists and was produced with exactly the flags ``extra``."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        r = json.load(f)
    return r if r.get("netbench_args") == list(extra) else None


def _run_job_retry(net: EmulatedNetwork, method: str, path: str, *args) -> Dict:
    """:func:`run_job`, once more if it fails (the run is deterministic, so a rerun gives the
    same trajectory); the first failure is printed, a second one raises."""
    try:
        return run_job(net, method, path, *args)
    except RuntimeError as e:
        print(f"[netbench] WARNING: {e}\n[netbench] rerunning {os.path.basename(path)} once", file=sys.stderr,
              flush=True)
        return run_job(net, method, path, *args)


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", default="100mbit,1gbit", help="comma-separated tbf rates per link")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated slimcomm.train methods; METHOD@TAG is a labelled variant of METHOD "
                        "(give it its own --method-args)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--nodes", type=int, default=None, metavar="R",
                   help="R nodes of world-size/R ranks each (ranks r*S..r*S+S-1 form node r): the ranks of a node "
                        "share one namespace and meet over its loopback, the nodes are joined by the rate-limited "
                        "links, and each node's uplink bytes are in the results ('nodes'); with --model gpt pass "
                        "--mesh R,S after -- to shard the GPT inside the nodes (default: one rank per node)")
    p.add_argument("--threads", type=int, default=None, help="threads per rank (default: cores / ranks)")
    p.add_argument("--stop-at-target", default="", metavar="RATES",
                   help="rates at which runs stop once the target accuracy is reached (saves time; the "
                        "accuracy trajectory does not depend on the link, so equal-epoch accuracy comes "
                        "from the other rates)")
    p.add_argument("--timed-rates", default="", metavar="RATES",
                   help="rates at which every run trains only --timed-steps steps to measure its ms/step; its "
                        "table row is the full run of the same method and seed at the first other rate with "
                        "times rescaled to that ms/step, marked projected (bench/netbench_projection.py)")
    p.add_argument("--timed-steps", default="120", metavar="N[,METHOD=N...]",
                   help="training steps of a timed run, optionally per method label, e.g. 120,ddp=24,fp16=24 "
                        "(a multiple of the local-step methods' H keeps their synchronisations in proportion; "
                        "methods without periodic steps, such as ddp, need only a few steps)")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="training seconds per run: every full run gets slimcomm.train --time-budget S (it "
                        "stops at the first evaluation past S s, so a method with cheap steps runs as many as "
                        "S allows; --epochs/--steps after -- stay the upper bound) and every projected row is "
                        "cut at S s of its projected time; the tables then compare accuracy at the budget")
    p.add_argument("--timed-eval-every", type=int, default=None, metavar="N",
                   help="--eval-every of the timed runs only (default: the one after --); the steady ms/step "
                        "needs several evaluation windows in the timed steps, e.g. 20 of 120")
    p.add_argument("--method-args", action="append", default=[], metavar="METHOD=ARGS",
                   help="extra slimcomm.train flags for one method, e.g. slimdp='--momentum 0 --lr 0.2' "
                        "(repeatable; shown in the table)")
    p.add_argument("--seeds", default=None,
                   help="comma-separated seeds: every (rate, method) runs once per seed and the tables report "
                        "medians (default: the --seed after --, else 0)")
    p.add_argument("--reuse", action="store_true",
                   help="load a (rate, method) result JSON that already exists with the same flags instead of "
                        "rerunning it (the link is still set up and measured)")
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per job")
    p.add_argument("--results-dir", "--out-dir", dest="out_dir", metavar="DIR", default=os.path.join(REPO, "bench", "out"),
                   help="output directory (default bench/out/, ignored by git; --results-dir "
                        "bench/results for the committed results)")
    p.add_argument("--name", default=None, help="output base name (default netbench_<W>ranks)")
    a = p.parse_args(argv)
    rates = [r.strip() for r in a.rates.split(",") if r.strip()]
    for r in rates:
        parse_rate(r)
    stop_rates = {r.strip() for r in a.stop_at_target.split(",") if r.strip()}
    if stop_rates - set(rates):
        p.error(f"--stop-at-target {sorted(stop_rates - set(rates))} not in --rates")
    timed_rates = {r.strip() for r in a.timed_rates.split(",") if r.strip()}
    if timed_rates - set(rates):
        p.error(f"--timed-rates {sorted(timed_rates - set(rates))} not in --rates")
    if timed_rates and timed_rates >= set(rates):
        p.error("--timed-rates: at least one rate of --rates must run in full (the trajectory)")
    if a.time_budget is not None and not a.time_budget > 0:
        p.error(f"--time-budget must be > 0, got {a.time_budget}")
    if timed_rates & stop_rates:
        p.error(f"--timed-rates and --stop-at-target share {sorted(timed_rates & stop_rates)}")
    try:
        timed_steps = parse_timed_steps(a.timed_steps)
    except ValueError as e:
        p.error(f"--timed-steps {a.timed_steps!r}: {e}")
    full_rates = [r for r in rates if r not in timed_rates]
    traj_rate = full_rates[0]
    rates = full_rates + [r for r in rates if r in timed_rates]  # trajectories first
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m.split("@")[0] not in METHODS]
    if bad or not methods:
        p.error(f"--methods: unknown {bad}; choose from {', '.join(METHODS)}")
    if os.geteuid() != 0:
        p.error("network namespaces need root")
    forbidden_args = ["--rank", "--world-size", "--master-addr", "--master-port", "--method", "--compare", "--out",
                      "--wire-iface"]
    if a.time_budget is not None:
        forbidden_args.append("--time-budget")
    if a.seeds is not None:
        forbidden_args.append("--seed")
        try:
            seeds = [int(x) for x in a.seeds.split(",")]
        except ValueError:
            p.error(f"--seeds {a.seeds!r}: expected comma-separated integers without empty entries")
        if any(not 0 <= sd < 2**63 for sd in seeds):
            p.error(f"--seeds {a.seeds!r}: every seed must be in [0, 2**63) (slimcomm.train --seed)")
        if len(set(seeds)) != len(seeds):
            p.error(f"--seeds {a.seeds!r}: expected distinct integers")
    else:
        seeds = [None]
    for tok in train_args:  # also --flag=value and abbreviations, which argparse accepts
        flag = tok.split("=", 1)[0]
        if tok.startswith("--") and len(flag) > 2:
            hit = [f for f in forbidden_args if f == flag or f.startswith(flag)]
            if hit:
                p.error(f"{hit[0]} is set by netbench; do not pass it after -- (got {tok!r})")
    per_method: Dict[str, List[str]] = {}
    for item in a.method_args:
        if "=" not in item:
            p.error(f"--method-args {item!r}: expected METHOD=ARGS")
        m, rest = item.split("=", 1)
        if m not in methods:
            p.error(f"--method-args {item!r}: {m} is not in --methods")
        per_method[m] = shlex.split(rest)
    unknown = sorted(set(timed_steps) - {None} - set(methods))
    if unknown:
        p.error(f"--timed-steps: {unknown} not in --methods")
    nodes = a.nodes if a.nodes is not None else a.world_size
    if nodes < 2 or a.world_size % nodes:
        p.error(f"--nodes {nodes}: must be >= 2 and divide --world-size {a.world_size}")
    mesh_arg = [t for i, t in enumerate(train_args) if i > 0 and train_args[i - 1] == "--mesh"] + \
        [t.split("=", 1)[1] for t in train_args if t.startswith("--mesh=")]
    if mesh_arg and mesh_arg[-1].split(",")[0].strip() != str(nodes):
        p.error(f"--mesh {mesh_arg[-1]} after -- must have R = --nodes {nodes} (one replica group per node)")
    threads = a.threads or max(1, (os.cpu_count() or 1) // a.world_size)
    name = a.name or f"netbench_{a.world_size}ranks"
    json_dir = os.path.join(a.out_dir, name)
    os.makedirs(json_dir, exist_ok=True)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)

    results: Dict[str, Dict[str, Dict]] = {}
    measured: Dict[str, float] = {}
    for rate in rates:
        net = EmulatedNetwork(a.world_size, rate, nodes=nodes)
        try:
            with net:
                measured[rate] = net.measure_mbit(megabytes=max(4, min(64, net.rate_bps / 8e6 * 3)))
                print(f"[netbench] {rate}: {nodes} namespaces up ({net.ranks_per_node} rank(s) each), "
                      f"measured {measured[rate]:.0f} Mbit/s",
                      flush=True)
                results[rate] = {}
                for m in methods:
                    results[rate][m] = []
                    for seed in seeds:
                        extra = (list(train_args) + per_method.get(m, [])
                                 + (["--stop-at-target"] if rate in stop_rates else [])
                                 + (["--time-budget", f"{a.time_budget:g}"] if a.time_budget else [])
                                 + (["--seed", str(seed)] if seed is not None else []))
                        t0 = time.perf_counter()
                        suffix = f"_s{seed}" if seed is not None else ""
                        path = os.path.join(json_dir, f"{rate}_{m}{suffix}.json")
                        timed = rate in timed_rates
                        if timed:
                            n_timed = timed_steps.get(m, timed_steps[None])
                            extra = timed_args(extra, n_timed, a.timed_eval_every)
                            path = path[:-5] + "_timed.json"
                        r = _reusable(path, extra) if a.reuse else None
                        if r is None:
                            r = _run_job_retry(net, m.split("@")[0], path, extra, a.port, a.timeout, threads,
                                               os.path.join(json_dir, "logs"))
                        else:
                            print(f"[netbench] {rate} {m}{suffix}: reusing {path}", flush=True)
                        r["netbench_args"] = extra
                        r["link"] = {"rate": rate, "measured_mbit": round(measured[rate], 1)}
                        r["method_flags"] = per_method.get(m, [])
                        if timed:
                            with open(path, "w") as f:
                                json.dump(r, f, indent=1)
                            traj = results[traj_rate][m][len(results[rate][m])]
                            r = project_run(traj, r, traj_rate)
                            if a.time_budget:
                                r = apply_budget(r, a.time_budget)
                            r["link"] = {"rate": rate, "measured_mbit": round(measured[rate], 1)}
                            path = path[:-len("_timed.json")] + ".json"
                            print(f"[netbench] {rate} {m}{suffix}: {r['projected']['ms_per_step']:.0f} ms/step "
                                  f"over {n_timed} timed steps; trajectory from {traj_rate}", flush=True)
                        with open(path, "w") as f:
                            json.dump(r, f, indent=1)
                        results[rate][m].append(r)
                        t = r.get("time_to_target")
                        score = (f"val loss {r['final']['val_loss']:.4f}" if "val_loss" in r["final"] else
                                 f"acc {r['final']['test_acc']:.4f}, time to {r['config']['target_acc']:g}: "
                                 f"{'%.1f s' % t['train_time_s'] if t else 'not reached'}")
                        print(f"[netbench] {rate} {m}{suffix}: {score}, "
                              f"{r['final']['bytes_sent_per_rank'] / 1e6:.1f} MB/rank, "
                              + (f"uplink TX MB per node {[round(b / 1e6, 2) for b in r['nodes']['uplink_tx_bytes']]}, "
                                 if r.get("nodes") and net.ranks_per_node > 1 else "")
                              + f"job {time.perf_counter() - t0:.0f} s", flush=True)
        finally:
            left = net.leftovers()
            if left:
                print(f"[netbench] WARNING: namespaces left behind: {left}", file=sys.stderr)
    any_r = next(iter(next(iter(results.values())).values()))[0]
    cfg = any_r["config"]
    if _is_lm(results):
        return _finish_lm(results, measured, a, argv, train_args, threads, seeds, name)
    optim = "; ".join(
        f"{m} lr {runs[0]['config']['lr']:g} momentum {runs[0]['config']['momentum']:g}"
        + (f" wire {runs[0]['config']['value_dtype']}, warm-up {runs[0]['config']['warmup_steps']}"
           if m.split("@")[0] in ("topk", "slimdp") else "")
        for m, runs in next(iter(results.values())).items())
    header = (
        f"## slimcomm netbench: {_topology(a)}\n\n"
        f"Data {any_r['dataset']['name']} ({any_r['dataset']['train_samples_per_rank']} training samples per rank), "
        f"{_model_words(any_r, cfg)} ({any_r['model']['num_params']:,} parameters), "
        f"batch {cfg['batch_size']} per rank, "
        f"{str(cfg['epochs']) + ' epochs' if cfg.get('epochs') is not None else str(cfg.get('steps')) + ' steps'}, "
        f"evaluation every {cfg['eval_every'] or 'epoch'} steps, {threads} thread(s) per rank, "
        f"{_loop_priority(results)}, "
        + (f"time budget {a.time_budget:g} s of training per run (runs stop at the first evaluation past it; "
           f"projected rows are cut at it), " if a.time_budget else "") +
        f"{'seeds ' + ', '.join(map(str, seeds)) + ' (medians)' if seeds[0] is not None else 'seed %d' % cfg['seed']}.\n"
        f"SGD per method: {optim}.\n"
        f"Time = training wall time (evaluation excluded). MB = {any_r['bytes_definition']}.\n"
        f"slimdp/topk: core {cfg['core_ratio']}, explore {cfg['explore_ratio']}, refresh {cfg['core_refresh']}; "
        f"powersgd rank {cfg['powersgd_rank']}, start iter {cfg['powersgd_start_iter']}; ist local steps {cfg['local_steps']}.\n"
        f"Command: `bench/netbench.py {' '.join(argv)} -- {' '.join(train_args)}`\n"
    )
    if stop_rates:
        header += (f"At {', '.join(sorted(stop_rates))} runs stop at the target accuracy; test accuracy after "
                   "equal epochs is reported at the other rate(s) (same seed, same arithmetic, so the same trajectory).\n")
    md = markdown(results, measured, header)
    md_path = os.path.join(a.out_dir, f"{name}.md")
    png_path = os.path.join(a.out_dir, f"{name}.png")
    with open(md_path, "w") as f:
        f.write(md)
    plot(results, png_path)
    print(md)
    print(f"[netbench] wrote {md_path} and {png_path}")
    return 0


def _model_words(run, cfg) -> str:
    """The heading's name of the model: ``MLP hidden [..]`` or the model's name (``CNN``)."""
    name = run.get("model", {}).get("name") or cfg.get("model") or "mlp"
    return f"MLP hidden {cfg.get('hidden')}" if name == "mlp" else name.upper()


def _loop_priority(results) -> str:
    """The heading's note of the gloo loop threads' priority (``--comm-thread-priority``;
    runs made before the option were ``normal``), per method where the runs differ. A
    projected run counts with its timed run's priority (its times come from that run; its
    trajectory may be reused from a run made with another)."""
    per = {}
    for by_method in results.values():
        for m, runs in by_method.items():
            for r in runs:
                prio = r.get("projected", {}).get("comm_thread_priority")
                per.setdefault(m, set()).add(prio or r["config"].get("comm_thread_priority", "normal"))
    every = set().union(*per.values()) if per else {"normal"}
    if len(every) == 1:
        return f"gloo loop threads {every.pop()} (--comm-thread-priority)"
    return "gloo loop threads (--comm-thread-priority): " + ", ".join(
        f"{m} {'/'.join(sorted(p))}" for m, p in per.items())


def _topology(a) -> str:
    """The heading's description of the emulated network."""
    nodes = a.nodes if a.nodes is not None else a.world_size
    if nodes == a.world_size:
        return f"{a.world_size} ranks, one network namespace each, tbf-limited veth links"
    s = a.world_size // nodes
    return (f"{a.world_size} ranks as {nodes} nodes of {s} (one network namespace per node, its ranks over "
            f"loopback), tbf-limited veth links between the nodes; wire = the node's uplink counters, "
            f"shared by its {s} ranks; uplink bytes per node in each JSON's 'nodes'")


def _finish_lm(results, measured, a, argv, train_args, threads, seeds, name) -> int:
    any_r = next(iter(next(iter(results.values())).values()))[0]
    cfg = any_r["config"]
    flags = "; ".join(f"{m}: " + ", ".join(f"{k} {runs[0]['config'][k]}" for k in (
        "sync_every", "outer_lr", "outer_momentum", "value_bits", "error_decay", "core_ratio", "explore_ratio")
        if runs[0]["config"].get(k) is not None) for m, runs in next(iter(results.values())).items()
        if m.split("@")[0] in ("diloco", "sparseloco", "slimdp-local", "slimdp", "topk"))
    header = (
        f"## slimcomm netbench (GPT): {_topology(a)}\n\n"
        f"GPT {cfg['n_layer']} layers, {cfg['n_embd']}-dim, {cfg['n_head']} heads, block {cfg['block_size']} "
        f"({any_r['model']['num_params']:,} parameters), {cfg['tokens']}-level text ({cfg.get('text_file') or 'fortunes'}), "
        f"batch {cfg['batch_size']} sequences per rank, {any_r['steps']} steps, AdamW lr {cfg['lr']:g} "
        f"(warm-up {cfg['warmup_lr_steps']}, cosine to {cfg['min_lr']:g}), betas ({cfg['beta1']}, {cfg['beta2']}), "
        f"weight decay {cfg['weight_decay']}, clip {cfg['grad_clip']}; validation loss every {cfg['eval_every']} steps "
        f"on {cfg['val_batches']} fixed batches (local-step methods: the outer parameters); "
        f"{threads} thread(s) per rank, {_loop_priority(results)}; "
        f"{'seeds ' + ', '.join(map(str, seeds)) + ' (medians)' if seeds[0] is not None else 'seed %d' % cfg['seed']}.\n"
        f"Method settings: {flags}.\n"
        f"Time = training wall time (evaluation excluded); time to target = the first evaluation at or below "
        f"ddp's final validation loss of the same seed (with several seeds; else ddp's median). MB = {any_r['bytes_definition']}.\n"
        f"Command: `bench/netbench.py {' '.join(argv)} -- {' '.join(train_args)}`\n")
    md = markdown_lm(results, measured, header)
    md_path = os.path.join(a.out_dir, f"{name}.md")
    png_path = os.path.join(a.out_dir, f"{name}.png")
    with open(md_path, "w") as f:
        f.write(md)
    plot_lm(results, png_path)
    print(md)
    print(f"[netbench] wrote {md_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
