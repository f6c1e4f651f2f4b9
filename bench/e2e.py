"""End-to-end capture throughput on a GPU: plain SGLang against the capture server, per mode.

    python bench/e2e.py MODEL_DIR OUT_DIR [--tokens 2048] [--concurrency 64] [--seconds 20]
                        [--ab-rounds 3] [--capture-rate 12.5] [--json-requests 8]
                        [--capture-args "..."] [--sglang-args "..."]

Two servers are started on MODEL_DIR (e.g. a Kimi-width tiny DeepSeek-V3: 4 layers, hidden
7168) and loaded with random-token prompts (never a radix-cache hit), closed loop
(``--concurrency`` clients sending back to back for ``--seconds``) or open loop (a fixed rate):

- (a) ``plain``: ``python -m sglang.launch_server``, prefill-heavy (max_new_tokens 1)
- (b) ``launcher-idle``: ``python -m sglang_capture.launch``, no request captures; (a) and (b)
  run together (half the GPU memory each) and are measured in alternating windows
- (d) ``file-capture``: every request captures 3 aux layers + final hidden state (capacity)
- (d-open-loop): capture requests arriving at ``--capture-rate`` whatever happens (sustained?)
- (a-mixed) / (d-mixed): the same open-loop stream beside ``--concurrency``/2 closed-loop clients
  with max_new_tokens 16, on each server; only on (d) does the stream capture
- (c) ``json``: SGLang's built-in ``return_hidden_states`` (final hidden state only) on the
  capture server's non-capture path (identical to plain SGLang's), ``--json-requests`` requests
- (b-mixed, ``--idle-mixed``): the mixed load on the capture server with nothing capturing, each
  round after (a): the capture server's own baseline on that load
- ``--profile-steps N``: after the mixed windows, N forward steps of each server profiled under
  the mixed load (SGLang's ``/start_profile``), summarized by ``trace_summary.py``

On capture servers each window also records the scheduler thread's time per patched seam, for
batches that capture and batches that do not (the writer stats' ``scheduler_thread``).

Reports tokens/s, raw capture GB/s, p50/p99 latency, bytes on disk, compression ratio, peak RSS
of the server's process tree, and the writer's queue depth and peak held host memory (from its
stats file), then checks the targets of issue 4 and names the bottleneck stage if one is missed.
Writes OUT_DIR/e2e.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import glob
import itertools
import json
import multiprocessing
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Dict, List, Optional

import numpy
import psutil
import requests

import pyspy_summary
import trace_summary
from sglang_capture.testbed.cpu import server_env
from sglang_capture.testbed.once import cache_dir
from sglang_capture.testbed.server import Server, start_server, stop_server
from sglang_capture.writer import read_stats

_NAMES = itertools.count()  # capture names and seeds, unique over the whole run
BASE_ARGS = ["--attention-backend", "triton", "--grammar-backend", "none", "--sleep-on-idle", "--mem-fraction-static", "0.3",
             "--cuda-graph-max-bs", "64", "--chunked-prefill-size", "16384", "--max-running-requests", "128"]


class GpuSampler:
    """GPU utilisation, SM clock, power and temperature over a window, from ``nvidia-smi -lms``:
    whether two windows of the same server differ because the GPU ran slower (clocks, power
    cap, heat) or because it was given less work. Reports nothing where there is no nvidia-smi."""

    FIELDS = ("utilization.gpu", "clocks.sm", "power.draw", "temperature.gpu")

    def __init__(self, interval_ms: int = 250) -> None:
        self.rows: List[List[float]] = []
        try:
            self.proc: Optional[subprocess.Popen] = subprocess.Popen(
                ["nvidia-smi", "--id=0", f"--query-gpu={','.join(self.FIELDS)}", "--format=csv,noheader,nounits",
                 f"-lms={interval_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.rows.append([float(x) for x in line.split(",")])
            except ValueError:  # "[N/A]" fields
                continue

    def stop(self) -> Optional[Dict[str, float]]:
        if self.proc is None:
            return None
        self.proc.terminate()
        self.proc.wait()
        if not self.rows:
            return None
        cols = list(zip(*self.rows))
        return {"util_pct": round(statistics.mean(cols[0]), 1), "sm_mhz_mean": round(statistics.mean(cols[1])),
                "sm_mhz_min": min(cols[1]), "power_w": round(statistics.mean(cols[2]), 1), "temp_c_max": max(cols[3]),
                "samples": len(self.rows)}


class RssSampler(threading.Thread):
    """Peak resident memory of a server's whole process tree, sampled every 0.2 s, plus the CPU
    the tree and the whole host used over the window (which stage is starved of cores)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.peak = 0
        self.stop_event = threading.Event()
        self.cpu_first: Dict[int, float] = {}
        self.cpu_last: Dict[int, float] = {}
        self.sched_first: Dict[int, float] = {}
        self.sched_last: Dict[int, float] = {}
        self.writer_pids: Dict[int, bool] = {}  # pid -> is it one of the package's writer processes
        psutil.cpu_percent(None)
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                procs = [self.root] + self.root.children(recursive=True)
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs if p.is_running()))
                for p in procs:
                    t = p.cpu_times()
                    self.cpu_first.setdefault(p.pid, t.user + t.system)
                    self.cpu_last[p.pid] = t.user + t.system
                    if p.pid not in self.writer_pids:
                        self.writer_pids[p.pid] = "sglang_capture.writer_process" in p.cmdline()
                    if "scheduler" in p.name():  # SGLang names it sglang::scheduler
                        for th in p.threads():
                            self.sched_first.setdefault(th.id, th.user_time + th.system_time)
                            self.sched_last[th.id] = th.user_time + th.system_time
            except psutil.Error:
                pass
            time.sleep(0.2)

    def cpu(self) -> Dict[str, float]:
        """Cores busy on average: the server's process tree, and the whole host."""
        wall = max(time.monotonic() - self.t0, 1e-9)
        used = sum(last - self.cpu_first[pid] for pid, last in self.cpu_last.items())
        threads = sorted((last - self.sched_first[tid] for tid, last in self.sched_last.items()), reverse=True)
        writers = sum(last - self.cpu_first[pid] for pid, last in self.cpu_last.items() if self.writer_pids.get(pid))
        return {"server_cores": round(used / wall, 2), "host_busy_pct": psutil.cpu_percent(None),
                "writer_processes_cores": round(writers / wall, 2),
                # the busiest threads of the scheduler process (the first is usually SGLang's own)
                "scheduler_top_threads_cores": [round(t / wall, 2) for t in threads[:4]],
                "scheduler_threads_cores": round(sum(threads) / wall, 2)}


class Prompts:
    """Request bodies built without per-request Python loops, so that the load generator (64
    threads in one interpreter) does not become the bottleneck at 600 K tok/s.

    Every prompt starts with 4 tokens taken from a global counter, so no two prompts share a
    first token sequence and the radix cache never matches; the rest is one of 64 random tails.
    """

    def __init__(self, tokens: int, vocab: int, seed: int = 0) -> None:
        rng = numpy.random.default_rng(seed)
        self.base = vocab - 3
        self.tails = [",".join(map(str, rng.integers(3, vocab, tokens - 4).tolist())) for _ in range(64)]

    def body(self, max_new: int, capture: Optional[str], json_hs: bool) -> bytes:
        n = next(_NAMES)
        head = [3 + (n // self.base ** k) % self.base for k in range(4)]
        params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
        if capture:
            params["custom_params"] = {"capture": True, "capture_name": capture}
        return ('{"input_ids":[%s,%s],"sampling_params":%s%s}' % (
            ",".join(map(str, head)), self.tails[n % len(self.tails)], json.dumps(params),
            ',"return_hidden_states":true' if json_hs else "")).encode()


def _reserve_names() -> int:
    """A block of prompt/capture numbers for one client process (its own counter, no overlap)."""
    global _NAMES
    base = next(_NAMES)
    _NAMES = itertools.count(base + 10_000_000)
    return base


_PROMPTS: Dict[str, Prompts] = {}  # the run's prompts, inherited by forked client processes


def _client_process(url: str, clients: List[dict], stop_at: float, name_base: int) -> List[dict]:
    """Closed-loop clients in a process of their own, until ``stop_at`` (CLOCK_MONOTONIC is shared)."""
    global _NAMES
    _NAMES = itertools.count(name_base)
    load = Load(url, _PROMPTS["run"])
    load.closed_loop(clients, stop_at)
    return load.results


class Load:
    """Closed-loop clients (each sends its next request when the last one returns) plus an
    optional open-loop stream (requests at a fixed rate, whatever the server's state), for
    ``seconds``; per-kind tokens/s, latency percentiles and capture outcomes.

    The closed-loop clients run in ``procs`` processes: at 900 K tok/s plain SGLang answers ~440
    requests/s, which leaves one interpreter little headroom. Spread over 4 processes the client
    used 0.3 cores on the H200 (r17) while windows of the same server still differed by up to
    20%, so that spread does not come from the client (bench/RESULTS.md, sixth round)."""

    def __init__(self, url: str, prompts: Prompts) -> None:
        self.url = url
        self.prompts = prompts
        self.results: List[dict] = []
        self.lock = threading.Lock()
        self.local = threading.local()

    def send(self, spec: dict) -> None:
        session = getattr(self.local, "session", None)
        if session is None:
            session = self.local.session = requests.Session()
        name = f"bench-{os.getpid()}-{next(_NAMES)}" if spec["capture"] else None
        data = self.prompts.body(spec["max_new"], name, spec["json"])
        t0 = time.monotonic()
        r = session.post(self.url + "/generate", data=data, headers={"Content-Type": "application/json"}, timeout=900)
        end = time.monotonic()
        ok = r.status_code == 200
        # only capture responses are parsed: a JSON-path response is hundreds of MB of floats
        ref = r.json().get("meta_info", {}).get("capture") if ok and spec["capture"] else None
        with self.lock:
            self.results.append({"kind": spec["kind"], "tokens": spec["tokens"], "start": t0, "latency": end - t0,
                                 "ok": ok, "capture_ok": bool(ref and ref.get("status") == "ok"),
                                 "bytes": (ref or {}).get("bytes", 0), "end": end})

    def closed_loop(self, clients: List[dict], stop_at: float, max_requests: Optional[int] = None) -> None:
        """One thread per client, each sending its next request when the last one returns."""
        counter = [0]

        def closed(spec: dict) -> None:
            while True:
                with self.lock:
                    if (max_requests is not None and counter[0] >= max_requests) or time.monotonic() >= stop_at:
                        return
                    counter[0] += 1
                self.send(spec)

        with ThreadPoolExecutor(max(1, len(clients))) as pool:
            for f in [pool.submit(closed, c) for c in clients]:
                f.result()

    def run(self, clients: List[dict], seconds: float, max_requests: Optional[int] = None,
            open_spec: Optional[dict] = None, rate: float = 0.0, procs: int = 1) -> Dict:
        t0 = time.monotonic()
        stop_at = t0 + seconds
        procs = min(procs, len(clients)) if max_requests is None else 1  # a request cap needs one counter
        with ThreadPoolExecutor(1) as local, ThreadPoolExecutor(256) as arrivals, \
                ProcessPoolExecutor(max(procs, 1), mp_context=multiprocessing.get_context("fork")) as children:
            if procs > 1:
                groups = [clients[i::procs] for i in range(procs)]
                futures = [children.submit(_client_process, self.url, g, stop_at, _reserve_names()) for g in groups]
            else:
                futures = [local.submit(self.closed_loop, clients, stop_at, max_requests)]
            if open_spec is not None and rate > 0:
                due = t0
                while due < stop_at:
                    time.sleep(max(0.0, due - time.monotonic()))
                    arrivals.submit(self.send, open_spec)
                    due += 1.0 / rate
            for f in futures:
                if procs > 1:
                    self.results.extend(f.result())
                else:
                    f.result()
        return summarize(self.results, t0, time.monotonic())


def summarize(results: List[dict], t0: float, t1: float) -> Dict:
    """Per kind: tokens/s over the window (until the last response), latency p50/p99, and for
    open-loop streams how latency moved from the first to the last quarter of arrivals."""
    out = {}
    for kind in sorted({r["kind"] for r in results}):
        rs = sorted((r for r in results if r["kind"] == kind), key=lambda r: r["start"])
        lat = sorted(r["latency"] for r in rs)
        toks = sum(r["tokens"] for r in rs)
        q = max(1, len(rs) // 4)
        first, last = sorted(r["latency"] for r in rs[:q]), sorted(r["latency"] for r in rs[-q:])
        ends = sorted(r["end"] for r in rs)
        out[kind] = {"requests": len(rs), "failed": sum(not r["ok"] for r in rs),
                     "capture_ok": sum(r["capture_ok"] for r in rs), "tokens": toks, "seconds": t1 - t0,
                     "tok_per_s": toks / (t1 - t0), "p50_s": lat[len(lat) // 2],
                     "p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))], "bytes_on_disk": sum(r["bytes"] for r in rs),
                     "latency_first_quarter_s": first[len(first) // 2], "latency_last_quarter_s": last[len(last) // 2],
                     # the rate responses came back at, first to last: for an open-loop stream
                     # that keeps up, the offered rate
                     "completion_tok_per_s": (toks - rs[0]["tokens"]) / (ends[-1] - ends[0]) if len(rs) > 1 and ends[-1] > ends[0] else 0.0}
    return out


def run_server(cmd: List[str], out: str, name: str, capture_dir: str = "") -> Server:
    t0 = time.time()
    env = server_env(cache_dir())  # unchanged on a GPU machine
    s = start_server(cmd, env, os.path.join(out, f"{name}.log"), capture_dir)
    print(f"{name} server up in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return s


PY_SPY_RATE = 200  # samples/s: enough for ms-scale seams over a 10 s window, little load on the host


def _py_spy() -> Optional[str]:
    """The py-spy executable: on PATH, or in a bin/ beside an installed package (pip --target)."""
    found = shutil.which("py-spy")
    if found:
        return found
    return next((p for p in (os.path.join(d, "bin", "py-spy") for d in sys.path if d) if os.path.exists(p)), None)


def py_spy_window(server: Server, name: str, seconds: float, out_dir: str, res: Dict) -> threading.Thread:
    """Sample ``server``'s scheduler process for ``seconds``, 2 s from now, with and without idle
    samples at once (``pyspy_summary`` says why both); the summary goes to ``res['pyspy'][name]``.
    ``--nonblocking``: the process is never paused, so the window's throughput is not disturbed."""
    def record() -> None:
        summaries = res.setdefault("pyspy", {})
        exe = _py_spy()
        sched = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True) if "scheduler" in p.name()]
        if exe is None or not sched:
            summaries[name] = {"error": "no py-spy executable" if exe is None else "no scheduler process found"}
            return
        time.sleep(2.0)
        os.makedirs(out_dir, exist_ok=True)
        paths = {kind: os.path.join(out_dir, f"{name}.{kind}.txt") for kind in ("active", "all")}
        procs = [subprocess.Popen([exe, "record", "--pid", str(sched[0]), "--duration", f"{seconds:g}", "--rate",
                                   str(PY_SPY_RATE), "--nonblocking", "--threads", "--full-filenames", "--format", "raw",
                                   "-o", path, *(["--idle"] if kind == "all" else [])],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for kind, path in paths.items()]
        errors = [p.communicate(timeout=seconds + 60)[1] for p in procs]
        if not all(os.path.exists(p) for p in paths.values()):
            summaries[name] = {"error": " | ".join(e.strip().splitlines()[-1] for e in errors if e.strip()) or "no output"}
            return
        summaries[name] = pyspy_summary.summarize(pyspy_summary.load(paths["active"]), pyspy_summary.load(paths["all"]),
                                                  seconds, PY_SPY_RATE)
        print(f"py-spy {name}: " + json.dumps({k: v for k, v in summaries[name].items() if k != "leaves_top"}),
              file=sys.stderr, flush=True)

    thread = threading.Thread(target=record, daemon=True)
    thread.start()
    return thread


def _at_least(low: int):
    """An argparse type: an int no smaller than ``low`` (a zero count would measure nothing, quietly)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    parse.__name__ = "integer"  # argparse names the type in its message for a non-number
    return parse


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--tokens", type=_at_least(1), default=2048)
    p.add_argument("--concurrency", type=_at_least(1), default=64)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--ab-rounds", type=_at_least(0), default=3, help="alternating (a)/(b) windows of --seconds / 2 each")
    p.add_argument("--capture-rate", type=float, default=12.5, help="open-loop capture requests/s (12.5 x 2,048 = 25.6 K tok/s)")
    p.add_argument("--mixed-rates", default="", help="','-separated capture requests/s for the mixed load (default: "
                   "--capture-rate); rates other than --capture-rate are reported as a_mixed@R / d_mixed@R")
    p.add_argument("--json-requests", type=_at_least(1), default=8)
    p.add_argument("--client-procs", type=_at_least(1), default=4, help="processes the closed-loop clients are spread over")
    p.add_argument("--mixed-rounds", type=_at_least(1), default=1, help="per mixed rate: rounds of (a, d, variants) windows, "
                   "then (a) once more; each (d) is compared with the (a) windows around it")
    p.add_argument("--capture-dir", default=None)
    p.add_argument("--capture-args", default="--capture-layers 1,2,3")
    p.add_argument("--sglang-args", default=" ".join(BASE_ARGS))
    p.add_argument("--phases", default="ab,capacity,open,mixed,json", help="which measurements to run")
    p.add_argument("--idle-mixed", action="store_true", help="also run the mixed load on the capture server with "
                   "nothing capturing (b_mixed), each round after (a)")
    p.add_argument("--profile-steps", type=_at_least(0), default=0, help="after the mixed windows, profile this many forward "
                   "steps of each server under the mixed load (torch profiler via /start_profile; summaries in the results)")
    p.add_argument("--profile-activities", default="GPU", help="torch-profiler activities for --profile-steps: GPU "
                   "(kernels, copies, CUDA calls) or CPU,GPU (also the operators the scheduler thread runs; slows it)")
    p.add_argument("--py-spy-seconds", type=float, default=0.0, help="sample each server's scheduler process with "
                   "py-spy for this long in its first mixed window (py-spy on PATH or beside the package; summaries in "
                   "the results): where its main thread's wall time goes, on CPU or waiting")
    p.add_argument("--variants", default="", help="';'-separated extra capture-args: one more capture server each, "
                   "measured on the mixed load beside the others (A/B of capture settings in one run)")
    a = p.parse_args(argv)
    phases = set(a.phases.split(","))
    variants = [v.strip() for v in a.variants.split(";") if v.strip()]
    os.makedirs(a.out, exist_ok=True)
    capture_dir = a.capture_dir or os.path.join(a.out, "captures")
    os.makedirs(capture_dir, exist_ok=True)
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    sg = shlex.split(a.sglang_args) + ["--model-path", a.model]
    T, C = a.tokens, a.concurrency
    prompts = _PROMPTS["run"] = Prompts(T, vocab)
    spec = lambda kind, max_new=1, capture=False, json_hs=False: {
        "kind": kind, "tokens": T, "max_new": max_new, "capture": capture, "json": json_hs}
    res: Dict[str, Dict] = {"config": {"tokens": T, "concurrency": C, "seconds": a.seconds, "hidden": hidden,
                                       "bytes_per_token_raw": (3 + 1) * hidden * 2, "sglang_args": sg,
                                       "capture_args": a.capture_args, "capture_rate": a.capture_rate}}

    def measure(server: Server, name: str, clients: List[dict], seconds: float, spy: bool = False, **kw) -> Dict:
        Load(server.url, prompts).run(clients[:4], 3, max_requests=8)  # warm-up
        spying = py_spy_window(server, name.split(" ")[0], a.py_spy_seconds, os.path.join(a.out, "pyspy"), res) \
            if spy and a.py_spy_seconds > 0 else None
        sampler = RssSampler(server.proc.pid)
        sampler.start()
        client_cpu, vm, gpu = _client_cpu_s(), _vmstat(), GpuSampler()
        t0 = time.monotonic()
        r = Load(server.url, prompts).run(clients, seconds, procs=a.client_procs, **kw)
        client_cores = round((_client_cpu_s() - client_cpu) / (time.monotonic() - t0), 2)  # before nvidia-smi is reaped
        r["_gpu"] = gpu.stop()
        sampler.stop_event.set()
        r["_peak_rss_bytes"] = sampler.peak
        if spying is not None:
            spying.join()
        r["_cpu"] = {**sampler.cpu(), "client_cores": client_cores, "vm": _vm_window(vm)}
        print(f"{name}: " + ", ".join(f"{k} {v['tok_per_s']:,.0f} tok/s" for k, v in r.items() if isinstance(v, dict) and "tok_per_s" in v)
              + f"; cpu {r['_cpu']}; gpu {r['_gpu']}",
              file=sys.stderr, flush=True)
        save(res, a.out, {name: r})  # so that a run cut short (device time limit) keeps what it measured
        return r

    def fresh_stats(server: Server, cdir: str) -> Dict:
        """The writer's stats after one small capture (the stats file is written after each outcome)."""
        Load(server.url, prompts).run([spec("stats", capture=True)], 60, max_requests=1)
        return read_stats(cdir)

    def measure_capture(server: Server, cdir: str, name: str, clients: List[dict], spy: bool = False, **kw) -> Dict:
        """``measure`` on a capture server, plus its writer's stats and the scheduler thread's time
        per seam in this window; its files are removed after."""
        before = fresh_stats(server, cdir).get("scheduler_thread") or {}
        r = measure(server, name, clients, a.seconds, spy=spy, **kw)
        r["_writer"] = fresh_stats(server, cdir)
        r["_scheduler_thread"] = _clock_delta(before, r["_writer"].get("scheduler_thread") or {})
        _clean(cdir)
        return r

    def profile_window(server: Server, name: str, load) -> Dict:
        """``load()`` with ``--profile-steps`` forward steps profiled 2 s into it; the trace's summary."""
        pdir = os.path.join(a.out, "profile", name)
        body = {"output_dir": pdir, "num_steps": a.profile_steps, "activities": a.profile_activities.split(","),
                "with_stack": False, "record_shapes": False, "profile_id": name}
        starter = threading.Timer(2.0, lambda: requests.post(server.url + "/start_profile", json=body, timeout=120))
        starter.start()
        load()
        starter.join()
        deadline = time.monotonic() + 120  # the scheduler exports the trace after the last profiled step
        while not (traces := glob.glob(os.path.join(pdir, "*.trace.json.gz"))) and time.monotonic() < deadline:
            time.sleep(1)
        if not traces:
            return {"error": f"no trace in {pdir}"}
        summary = trace_summary.summarize(trace_summary.load(traces[0]), a.profile_steps)
        print(f"profile {name}: " + json.dumps({k: v for k, v in summary.items() if not k.endswith("_top")}), file=sys.stderr, flush=True)
        return summary

    def capture_cmd(cdir: str, extra: str = "") -> List[str]:
        os.makedirs(cdir, exist_ok=True)
        return [sys.executable, "-m", "sglang_capture.launch", "--capture-dir", cdir,
                *shlex.split(a.capture_args), *shlex.split(extra), *sg]

    # All servers are up together so that (a) and (b) can alternate: the closed-loop rate drifts
    # by several percent between windows minutes apart.
    variant_dirs = [f"{capture_dir}-v{i}" for i in range(len(variants))]
    with ThreadPoolExecutor(2 + len(variants)) as starter:
        plain_f = starter.submit(run_server, [sys.executable, "-m", "sglang.launch_server", *sg], a.out, "plain")
        capture_f = starter.submit(run_server, capture_cmd(capture_dir), a.out, "capture", capture_dir)
        variant_fs = [starter.submit(run_server, capture_cmd(d, v), a.out, f"variant{i}", d)
                      for i, (d, v) in enumerate(zip(variant_dirs, variants))]
        plain, capture = plain_f.result(), capture_f.result()
        variant_servers = [f.result() for f in variant_fs]
    res["config"]["variants"] = variants
    try:
        prefill = [spec("prefill")] * C
        windows = []
        for _ in range(a.ab_rounds if "ab" in phases else 0):
            windows.append((measure(plain, "a_plain", prefill, a.seconds / 2), measure(capture, "b_launcher_idle", prefill, a.seconds / 2)))
        if windows:
            res["a_plain"], res["b_launcher_idle"] = (merge([w[i] for w in windows]) for i in (0, 1))
            res["ab_windows"] = [[w[0]["prefill"]["tok_per_s"], w[1]["prefill"]["tok_per_s"]] for w in windows]
        if "capacity" in phases:
            res["d_file_capture"] = measure_capture(capture, capture_dir, "d_file_capture", [spec("capture", capture=True)] * C)
        if "open" in phases:
            res["d_open_loop"] = measure_capture(capture, capture_dir, "d_open_loop", [],
                                                 open_spec=spec("capture-open", capture=True), rate=a.capture_rate)
        # Mixed: the same open-loop stream of capture-sized requests beside 32 closed-loop
        # decode clients, on each server; only on (d) do the stream's requests capture.
        others = [spec("mixed-other", max_new=16)] * (C // 2)
        rates = [float(r) for r in a.mixed_rates.split(",") if r.strip()] or [a.capture_rate]
        res["config"]["mixed_rates"] = rates
        if "mixed" in phases:  # each server's first mixed window ran slow (new batch shapes): not measured
            for srv, d in [(plain, None), (capture, capture_dir), *zip(variant_servers, variant_dirs)]:
                Load(srv.url, prompts).run(others, 5, procs=a.client_procs, open_spec=spec("mixed-capture", capture=d is not None), rate=rates[0])
                if d:
                    _clean(d)
        for rate in rates if "mixed" in phases else []:
            tag = "" if rate == a.capture_rate else f"@{rate:g}"
            plain_stream, capturing = spec("mixed-capture"), spec("mixed-capture", capture=True)
            capturing_servers = [(capture, capture_dir, "d_mixed" + tag, "d_mixed" + tag)] + [
                (srv, d, f"d_mixed_v{i}{tag}", f"d_mixed_v{i}{tag} ({variants[i]})")
                for i, (srv, d) in enumerate(zip(variant_servers, variant_dirs))]
            windows: Dict[str, List[Dict]] = {"a_mixed" + tag: []}
            # (a) first and last, capture servers in between: each (d) window has (a) windows on both sides
            for round_ in range(a.mixed_rounds):
                spy = round_ == 0 and rate == rates[0]
                windows["a_mixed" + tag].append(measure(plain, "a_mixed" + tag, others, a.seconds, spy=spy,
                                                        open_spec=plain_stream, rate=rate))
                if a.idle_mixed:  # the capture server, nothing capturing: its scheduler thread's baseline
                    windows.setdefault("b_mixed" + tag, []).append(measure_capture(
                        capture, capture_dir, "b_mixed" + tag, others, spy=spy, open_spec=plain_stream, rate=rate))
                for srv, d, key, label in capturing_servers:
                    windows.setdefault(key, []).append(measure_capture(srv, d, label, others, spy=spy,
                                                                       open_spec=capturing, rate=rate))
            windows["a_mixed" + tag].append(measure(plain, "a_mixed" + tag, others, a.seconds, open_spec=plain_stream, rate=rate))
            for key, ws in windows.items():
                res[key] = merge(ws)
                res[key]["_windows"] = [w["mixed-other"]["tok_per_s"] for w in ws]
        if a.profile_steps > 0 and "mixed" in phases:
            res["profile"] = {}
            idle = [(capture, capture_dir, "b_mixed", False)] if a.idle_mixed else []
            for srv, d, name, capturing in [(plain, None, "a_mixed", False), *idle, (capture, capture_dir, "d_mixed", True),
                                            *((s_, d_, f"d_mixed_v{i}", True) for i, (s_, d_) in enumerate(zip(variant_servers, variant_dirs)))]:
                stream = spec("mixed-capture", capture=capturing)
                res["profile"][name] = profile_window(srv, name, lambda: Load(srv.url, prompts).run(
                    others, a.seconds, procs=a.client_procs, open_spec=stream, rate=rates[0]))
                if d:
                    res["profile"][name]["writer_device_allocator"] = fresh_stats(srv, d).get("device_allocator")
                    _clean(d)
                save(res, a.out)
        if "json" not in phases:
            return finish(res, a.out)
        json_clients = [spec("json", json_hs=True)] * min(C, a.json_requests)
        Load(capture.url, prompts).run(json_clients[:1], 60, max_requests=1)  # warm the JSON path
        t0 = time.monotonic()
        res["c_json"] = Load(capture.url, prompts).run(json_clients, 1e9, max_requests=len(json_clients))
        print(f"c_json: {res['c_json']['json']['tok_per_s']:,.0f} tok/s ({time.monotonic() - t0:.0f} s)",
              file=sys.stderr, flush=True)
        res["_writer_final"] = read_stats(capture_dir)
    finally:
        for srv in [plain, capture, *variant_servers]:
            stop_server(srv)
    return finish(res, a.out)


_VM_KEYS = ("allocstall", "pgscan_direct", "pgscan_kswapd", "pgsteal_direct", "pgsteal_kswapd")


def _vmstat() -> Dict[str, int]:
    """The host's memory-reclaim counters (summed over zones/kinds), where /proc has them."""
    out = dict.fromkeys(_VM_KEYS, 0)
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                key, value = line.split()
                for k in _VM_KEYS:
                    if key == k or key.startswith(k + "_"):
                        out[k] += int(value)
    except OSError:
        pass
    return out


def _vm_window(before: Dict[str, int]) -> Dict[str, float]:
    """Reclaim over a window (direct reclaim stalls whoever allocates, the server included) and
    the page cache at its end, in GB."""
    after = _vmstat()
    out: Dict[str, float] = {k: after[k] - before[k] for k in _VM_KEYS}
    try:
        mem = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        for k in ("MemFree", "Cached", "Dirty"):
            out[k + "_GB"] = round(int(mem[k].split()[0]) / 1e6, 1)
    except (OSError, KeyError, ValueError):
        pass
    return out


def _client_cpu_s() -> float:
    """CPU seconds of this load generator and its finished client processes."""
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def save(res: Dict, out: str, latest: Optional[Dict] = None) -> None:
    """Write OUT/e2e.json: the results so far, plus the measurement just taken (not yet merged)."""
    tmp = os.path.join(out, "e2e.json.tmp")
    with open(tmp, "w") as f:
        json.dump({**res, "_latest": latest} if latest else res, f, indent=1)
    os.replace(tmp, os.path.join(out, "e2e.json"))


def finish(res: Dict, out: str) -> int:
    save(res, out)
    print(report(res))
    return 0


def _clock_delta(before: Dict, after: Dict) -> Dict:
    """The scheduler thread's seam accounts (sglang_capture.seam_clock) over one window."""
    out = {}
    for k, v in after.items():
        calls = v["calls"] - before.get(k, {}).get("calls", 0)
        s = v["s"] - before.get(k, {}).get("s", 0.0)
        if calls > 0:
            out[k] = {"calls": calls, "s": round(s, 4), "us_per_call": round(1e6 * s / calls, 1)}
    return out


def merge(parts: List[Dict]) -> Dict:
    """One result from several windows of the same load: tokens/s over their summed time."""
    out: Dict = {"_peak_rss_bytes": max(p.get("_peak_rss_bytes", 0) for p in parts),
                 "_cpu": [p.get("_cpu") for p in parts], "_gpu": [p.get("_gpu") for p in parts]}
    if "_writer" in parts[-1]:
        out["_writer"] = parts[-1]["_writer"]  # its counters add up over the server's life
    clocks = [p["_scheduler_thread"] for p in parts if "_scheduler_thread" in p]
    if clocks:
        out["_scheduler_thread"] = _clock_delta({}, {k: {"calls": sum(c.get(k, {}).get("calls", 0) for c in clocks),
                                                        "s": sum(c.get(k, {}).get("s", 0.0) for c in clocks)}
                                                    for k in sorted({k for c in clocks for k in c})})
    for kind in parts[0]:
        if kind.startswith("_"):
            continue
        rs = [p[kind] for p in parts]
        m = {k: sum(r[k] for r in rs) for k in ("requests", "failed", "capture_ok", "tokens", "seconds", "bytes_on_disk")}
        m.update(tok_per_s=m["tokens"] / m["seconds"], p50_s=statistics.median(r["p50_s"] for r in rs),
                 p99_s=max(r["p99_s"] for r in rs))
        out[kind] = m
    return out


def _paired_ratios(a_windows: List[float], d_windows: List[float]) -> List[float]:
    """Each (d) window against the mean of the (a) windows just before and after it."""
    if len(a_windows) != len(d_windows) + 1:
        return []
    return [d / ((a_windows[i] + a_windows[i + 1]) / 2) for i, d in enumerate(d_windows)]


def _bracketed(ratios: List[float]) -> str:
    """The report's words for ``_paired_ratios`` (nothing when there are none)."""
    if not ratios:
        return ""
    return (f" (each window against the (a) windows around it: {', '.join(f'{r:.3f}' for r in ratios)}; "
            f"median {statistics.median(ratios):.3f})")


def _clean(capture_dir: str) -> None:
    for f in os.listdir(capture_dir):
        if f.endswith(".capture.msgpack"):
            os.unlink(os.path.join(capture_dir, f))


def _mixed_order(mode: str) -> tuple:
    """Mixed-load modes grouped by rate, each group in run order: a, d, variants, a again."""
    base, _, rate = mode.partition("@")
    rank = {"a_mixed": 0, "b_mixed": 1}.get(base, 2)
    return (-float(rate or "inf"), rank, base)


def report(res: Dict) -> str:
    cfg = res["config"]
    bpt = cfg["bytes_per_token_raw"]
    rows = ["| mode | load | tok/s | raw capture GB/s | p50 s | p99 s | on disk | ratio | peak RSS GB |",
            "|---|---|---|---|---|---|---|---|---|"]
    modes = ["a_plain", "b_launcher_idle", "d_file_capture", "d_open_loop"]
    modes += sorted((m for m in res if m.startswith(("a_mixed", "b_mixed", "d_mixed"))), key=_mixed_order) + ["c_json"]
    for mode in modes:
        for kind, r in (res.get(mode) or {}).items():
            if kind.startswith("_"):
                continue
            cap = r["capture_ok"] * cfg["tokens"]
            gbs = cap * bpt / r["seconds"] / 1e9 if cap else 0
            ratio = f"{cap * bpt / r['bytes_on_disk']:.2f}" if r["bytes_on_disk"] else "—"
            rows.append(f"| {mode} | {kind} ({r['requests']} req, {r['failed']} failed) | {r['tok_per_s']:,.0f} | "
                        f"{gbs:.2f} | {r['p50_s']:.2f} | {r['p99_s']:.2f} | {r['bytes_on_disk'] / 1e9:.2f} GB | {ratio} | "
                        f"{res[mode].get('_peak_rss_bytes', 0) / 1e9:.1f} |")
    checks = []
    tok = lambda m, k: (res.get(m) or {}).get(k, {}).get("tok_per_s")
    d, c, a_, b = tok("d_file_capture", "capture"), tok("c_json", "json"), tok("a_plain", "prefill"), tok("b_launcher_idle", "prefill")
    if d:
        checks.append(f"(d) capacity, closed loop: {d:,.0f} tok/s >= 25,000: {'PASS' if d >= 25000 else 'MISS'}")
    o = (res.get("d_open_loop") or {}).get("capture-open")
    if o:
        offered = cfg["capture_rate"] * cfg["tokens"]
        growth = o["latency_last_quarter_s"] / max(o["latency_first_quarter_s"], 1e-9)
        ok = o["capture_ok"] == o["requests"] and o["completion_tok_per_s"] >= 0.95 * offered and growth <= 1.5
        checks.append(f"(d) sustains {offered:,.0f} tok/s offered (open loop): completed at {o['completion_tok_per_s']:,.0f} tok/s, "
                      f"{o['capture_ok']}/{o['requests']} ok, latency {o['latency_first_quarter_s']:.2f} -> "
                      f"{o['latency_last_quarter_s']:.2f} s (first -> last quarter): {'PASS' if ok else 'MISS'}")
    if d and c:
        checks.append(f"(d)/(c) = {d / c:,.0f}x >= 50x: {'PASS' if d / c >= 50 else 'MISS'}")
    if a_ and b:
        ab = res.get("ab_windows", [])
        per = _bracketed(_paired_ratios([w[0] for w in ab], [w[1] for w in ab[:-1]]))
        checks.append(f"(b)/(a) = {b / a_:.3f} over {len(ab)} alternating window pairs{per} "
                      f"(>= 0.97): {'PASS' if b / a_ >= 0.97 else 'MISS'}")
    for m in [x for x in modes if x.startswith(("b_mixed", "d_mixed"))]:
        base, _, rate_tag = m.partition("@")
        a_key = "a_mixed" + (f"@{rate_tag}" if rate_tag else "")
        am, dm = tok(a_key, "mixed-other"), tok(m, "mixed-other")
        if am and dm:
            label = f" [{cfg['variants'][int(base.split('_v')[1])]}]" if "_v" in base else ""
            rate = float(rate_tag) if rate_tag else cfg["capture_rate"]
            per = _bracketed(_paired_ratios(res[a_key].get("_windows", []), res[m].get("_windows", [])))
            if base.startswith("b_mixed"):
                checks.append(f"mixed load on the capture server, nothing capturing: (b)/(a) = {dm / am:.3f}{per}")
                continue
            checks.append(f"mixed load{label}, capture stream {rate * cfg['tokens']:,.0f} tok/s, requests not capturing, "
                          f"(d)/(a) = {dm / am:.3f}{per} (>= 0.95): {'PASS' if dm / am >= 0.95 else 'MISS'}")
            if dm / am < 0.95:
                checks.append("  " + mixed_bottleneck(res[a_key], res[m], (res.get("pyspy") or {}).get(base)))
    w = (res.get("d_file_capture") or {}).get("_writer") or {}
    if w:
        checks.append(f"writer: peak held {w.get('peak_held_bytes', 0) / 1e9:.2f} GB of cap {w.get('cap_bytes', 0) / 1e9:.2f} GB "
                      f"({'PASS' if w.get('peak_held_bytes', 0) <= w.get('cap_bytes', 1) else 'OVER'}), max queue "
                      f"{w.get('max_queue')}, back-pressure waits {w.get('back_pressure_waits')}")
        n = max(w.get("written", 0), 1)
        checks.append("writer stage ms/file (summed over threads): " + ", ".join(
            f"{k[:-2]} {w.get(k, 0) / n * 1e3:.0f}" for k in ("queue_wait_s", "assemble_s", "encode_write_s", "fsync_publish_s"))
            + f"; raw {w.get('raw_bytes', 0) / n / 1e6:.0f} MB/file, failed {w.get('failed')}")
    return "\n".join(rows + [""] + checks + _clock_rows(res, modes) + _profile_rows(res.get("profile") or {})
                     + pyspy_summary.rows(res.get("pyspy") or {}))


def _window_mean(mode: Dict, section: str, key: str) -> Optional[float]:
    """The mean of one ``_cpu``/``_gpu`` figure over a mode's windows (None where none has it)."""
    values = [w[key] for w in mode.get(section) or [] if w and w.get(key) is not None]
    values = [v[0] if isinstance(v, list) else v for v in values]  # scheduler_top_threads_cores: the busiest
    return statistics.fmean(values) if values else None


def mixed_bottleneck(a: Dict, d: Dict, spy: Optional[Dict] = None) -> str:
    """For a missed mixed-load target: which stage limited the requests that do not capture, from
    the windows' own measurements, and what would lift it.

    The GPU when it was >= 90% busy under plain SGLang; otherwise SGLang's scheduler thread when its
    busiest thread used >= 0.8 of a core (the GPU waited for it); otherwise neither saturated, and
    the load generator or the host is suspect. The capture server's extra load on the host (the
    writer processes) and, when py-spy sampled it, the package's own share of that thread follow.
    """
    gpu_a, gpu_d = _window_mean(a, "_gpu", "util_pct"), _window_mean(d, "_gpu", "util_pct")
    thread_a, thread_d = (_window_mean(x, "_cpu", "scheduler_top_threads_cores") for x in (a, d))
    host_a, host_d = _window_mean(a, "_cpu", "host_busy_pct"), _window_mean(d, "_cpu", "host_busy_pct")
    writers = _window_mean(d, "_cpu", "writer_processes_cores")
    if None in (gpu_a, thread_a, thread_d):
        return "bottleneck: not measured in these windows (no GPU or CPU samples)"
    if gpu_a >= 90:
        stage = "the GPU"
    elif thread_a >= 0.8:
        stage = "SGLang's scheduler thread"
    else:
        stage = "neither the GPU nor the scheduler thread (check the load generator's cores)"
    text = (f"bottleneck: {stage} (GPU {gpu_a:.0f}% busy in (a), {gpu_d or 0:.0f}% in (d); scheduler thread "
            f"{thread_a:.2f} / {thread_d:.2f} cores)")
    if writers is not None and host_a is not None and host_d is not None:
        text += f"; the writer processes used {writers:.1f} cores beside it (host {host_a:.0f}% -> {host_d:.0f}% busy)"
    own = ((spy or {}).get("frames") or {}).get("[sglang_capture]")
    if own:
        text += f"; the package's own code took {own['wall_pct']}% of the scheduler thread's wall time (py-spy)"
    if stage != "the GPU":
        text += (". Busy cores elsewhere slow that thread on a shared host (bench/interference.py measures it); what "
                 "lifts it is fewer of them: a host with cores to spare, or fewer writer cycles per byte (--capture-codec none)")
    return text


def _clock_rows(res: Dict, modes: List[str]) -> List[str]:
    """The capture server's scheduler thread per seam: µs per call, for batches that capture or not."""
    clocked = [m for m in modes if (res.get(m) or {}).get("_scheduler_thread")]
    if not clocked:
        return []
    seams = sorted({k for m in clocked for k in res[m]["_scheduler_thread"]})
    rows = ["", "| scheduler thread, µs per call (calls) | " + " | ".join(seams) + " |", "|---" * (len(seams) + 1) + "|"]
    for m in clocked:
        c = res[m]["_scheduler_thread"]
        rows.append(f"| {m} | " + " | ".join(f"{c[k]['us_per_call']:,.0f} ({c[k]['calls']})" if k in c else "—" for k in seams) + " |")
    return rows


def _profile_rows(profiles: Dict) -> List[str]:
    """One line per profiled server: is the GPU kept busy, and what fills or empties it."""
    if not profiles:
        return []
    rows = ["", "| profiled (mixed load) | GPU busy % | ms/step | kernel ms/step | GPU gaps > 1 ms | top kernels (ms) |",
            "|---|---|---|---|---|---|"]
    for name, p in profiles.items():
        if "span_ms" not in p:
            rows.append(f"| {name} | {p.get('error', 'no GPU events')} | | | | |")
            continue
        gaps = p["gaps_over_1ms"]
        top = "; ".join(f"{k['name'][:40]} {k['total_ms']:.0f}" for k in p["kernels_top"][:4])
        rows.append(f"| {name} | {p['gpu_busy_pct']} | {p.get('span_ms_per_step', '')} | {p.get('kernel_ms_per_step', '')} | "
                    f"{gaps['count']} ({gaps['total_ms']} ms, max {gaps['max_ms']}) | {top} |")
    return rows


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
