"""End-to-end capture throughput on a GPU: plain SGLang against the capture server, per mode.

    python bench/e2e.py MODEL_DIR OUT_DIR [--tokens 2048] [--concurrency 64] [--seconds 20]
                        [--ab-rounds 3] [--capture-rate 12.5] [--json-requests 8]
                        [--capture-args "..."] [--sglang-args "..."]

Two servers are started on MODEL_DIR (e.g. a Kimi-width tiny DeepSeek-V3: 4 layers, hidden
7168) and loaded with random-token prompts (never a radix-cache hit: each window counts the cached
tokens and the batches that were not whole prompts from the server's log, ``_prefill_batches``),
closed loop (``--concurrency`` clients sending back to back for ``--seconds``) or open loop (a fixed rate):

- (a) ``plain``: ``python -m sglang.launch_server``, prefill-heavy (max_new_tokens 1)
- (b) ``launcher-idle``: ``python -m sglang_capture.launch``, no request captures; (a) and (b)
  run together (half the GPU memory each) and are measured in alternating windows
- (d) ``file-capture``: every request captures 3 aux layers + final hidden state (capacity)
- ``capture_ab``: on the capture server, every request capturing (d_prefill) against the same
  load capturing nothing (b_prefill), in alternating windows: what capture costs that server
- ``prefix_ab``: on the capture server, prompts that share their first ``--shared-prefix`` tokens
  (a radix-cache hit for every request but the first) against the usual prompts, nothing capturing
  and capturing (a capture request never reads the cache for a prefix this short: prefix sharing reuses
  stored rows from 32 positions on, server/shared_rows.MIN_REUSE_ROWS): what one cached token costs a batch
- ``--request-variants``: per-request capture settings (e.g. ``{"capture_dtype": "fp8"}``), one
  more window each in ``capture_ab`` (d_prefill_r0, ...) and in each mixed round (d_mixed_r0, ...)
  on the same capture server: an A/B of a per-request setting without a third server on the GPU
- (d-open-loop): capture requests arriving at ``--capture-rate`` whatever happens (sustained?)
- (a-mixed) / (d-mixed): the same open-loop stream beside ``--concurrency``/2 closed-loop clients
  with max_new_tokens 16, on each server; only on (d) does the stream capture
- (c) ``json``: SGLang's built-in ``return_hidden_states`` (final hidden state only) on the
  capture server's non-capture path (identical to plain SGLang's), ``--json-requests`` requests
- (b-mixed, ``--idle-mixed``): the mixed load on the capture server with nothing capturing, each
  round after (a): the capture server's own baseline on that load

On capture servers each window also records the scheduler thread's time per patched seam, for
batches that capture and batches that do not (the writer stats' ``scheduler_thread``).

Reports tokens/s, raw capture GB/s, p50/p99 latency, bytes on disk, compression ratio, peak RSS
of the server's process tree, and the writer's queue depth and peak held host memory (from its
stats file), then checks the targets of issue 4 and names the bottleneck stage if one is missed.
Writes OUT_DIR/e2e.json and prints a markdown table. The load (e2e_load.py), the probes sampled
in each window (e2e_probes.py) and the report (e2e_report.py) live beside this file.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import e2e_load
import e2e_probes
from e2e_load import Load, Prompts
from e2e_report import _clock_delta, finish, load_tok_per_s, merge, save

from sglang_capture.core.capture_dir import read_stats
from sglang_capture.testbed.cpu import server_env
from sglang_capture.testbed.once import cache_dir
from sglang_capture.testbed.server import Server, start_server, stop_server

BASE_ARGS = ["--attention-backend", "triton", "--grammar-backend", "none", "--sleep-on-idle", "--mem-fraction-static", "0.3",
             "--cuda-graph-max-bs", "64", "--chunked-prefill-size", "16384", "--max-running-requests", "128"]


def run_server(cmd: List[str], out: str, name: str, capture_dir: str = "") -> Server:
    t0 = time.time()
    env = server_env(cache_dir())  # unchanged on a GPU machine
    s = start_server(cmd, env, os.path.join(out, f"{name}.log"), capture_dir)
    print(f"{name} server up in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return s


def _at_least(low: int):
    """An argparse type: an int no smaller than ``low`` (a zero count would measure nothing, quietly)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    parse.__name__ = "integer"  # argparse names the type in its message for a non-number
    return parse


def _json_objects(text: str) -> List[dict]:
    """An argparse type: ';'-separated JSON objects (``--request-variants``)."""
    try:
        objs = [json.loads(part) for part in text.split(";") if part.strip()]
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not all(isinstance(o, dict) for o in objs):
        raise argparse.ArgumentTypeError("each variant must be a JSON object")
    return objs


def _clean(capture_dir: str) -> None:
    for f in os.listdir(capture_dir):
        if f.endswith(".capture.msgpack"):
            os.unlink(os.path.join(capture_dir, f))



def parse_args(argv: List[str]) -> argparse.Namespace:
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
    p.add_argument("--phases", default="ab,capacity,open,mixed,json", help="which measurements to run "
                   "(also capture_ab: capture-all against nothing capturing on the capture server; prefix_ab: "
                   "prompts sharing a prefix against the usual ones)")
    p.add_argument("--shared-prefix", type=_at_least(1), default=1, help="prefix_ab: how many first tokens its "
                   "shared-prefix prompts have in common")
    p.add_argument("--idle-mixed", action="store_true", help="also run the mixed load on the capture server with "
                   "nothing capturing (b_mixed), each round after (a)")
    p.add_argument("--py-spy-seconds", type=float, default=0.0, help="sample each server's scheduler process with "
                   "py-spy for this long in its first mixed window (py-spy on PATH or beside the package; summaries in "
                   "the results): where its main thread's wall time goes, on CPU or waiting")
    p.add_argument("--variants", default="", help="';'-separated extra capture-args: one more capture server each, "
                   "measured on the mixed load beside the others (A/B of capture settings in one run)")
    p.add_argument("--request-variants", type=_json_objects, default=[], help="';'-separated JSON objects merged into "
                   "the capture requests' custom_params, e.g. '{\"capture_dtype\": \"fp8\"}': one more window each, "
                   "on the capture server, in capture_ab and in each mixed round")
    a = p.parse_args(argv)
    if a.shared_prefix > Prompts.most_shared(a.tokens):
        p.error(f"--shared-prefix {a.shared_prefix} leaves no room for a prompt's own 4-token head in --tokens {a.tokens}")
    return a


class Run:
    """One benchmark run: its options, servers, prompts and results; one method per phase."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.phases = set(a.phases.split(","))
        self.variants = [v.strip() for v in a.variants.split(";") if v.strip()]
        os.makedirs(a.out, exist_ok=True)
        self.capture_dir = a.capture_dir or os.path.join(a.out, "captures")
        os.makedirs(self.capture_dir, exist_ok=True)
        self.variant_dirs = [f"{self.capture_dir}-v{i}" for i in range(len(self.variants))]
        cfg = json.load(open(os.path.join(a.model, "config.json")))
        cfg = cfg.get("text_config", cfg)  # Kimi-K2.5 keeps its language model's config there
        self.sg = shlex.split(a.sglang_args) + ["--model-path", a.model]
        self.prompts = e2e_load.PROMPTS["run"] = Prompts(a.tokens, cfg["vocab_size"])
        self.others = [self.spec("mixed-other", max_new=16)] * (a.concurrency // 2)
        self.rates = [float(r) for r in a.mixed_rates.split(",") if r.strip()] or [a.capture_rate]
        self.res: Dict[str, Dict] = {"config": {
            "tokens": a.tokens, "concurrency": a.concurrency, "seconds": a.seconds, "hidden": cfg["hidden_size"],
            "bytes_per_token_raw": (3 + 1) * cfg["hidden_size"] * 2, "sglang_args": self.sg,
            "capture_args": a.capture_args, "capture_rate": a.capture_rate, "variants": self.variants,
            "request_variants": a.request_variants,
            "mixed_rates": self.rates}}
        self.plain: Optional[Server] = None
        self.capture: Optional[Server] = None
        self.variant_servers: List[Server] = []

    def spec(self, kind: str, max_new: int = 1, capture: bool = False, json_hs: bool = False,
             params: Optional[dict] = None, shared_prefix: int = 0) -> dict:
        return {"kind": kind, "tokens": self.a.tokens, "max_new": max_new, "capture": capture, "json": json_hs,
                "params": params or {}, "shared_prefix": shared_prefix}

    def capture_cmd(self, cdir: str, extra: str = "") -> List[str]:
        os.makedirs(cdir, exist_ok=True)
        return [sys.executable, "-m", "sglang_capture.launch", "--capture-dir", cdir,
                *shlex.split(self.a.capture_args), *shlex.split(extra), *self.sg]

    def start_servers(self) -> None:
        """All servers up together, so that (a) and (b) can alternate: the closed-loop rate drifts
        by several percent between windows minutes apart."""
        out = self.a.out
        with ThreadPoolExecutor(2 + len(self.variants)) as starter:
            plain_f = starter.submit(run_server, [sys.executable, "-m", "sglang.launch_server", *self.sg], out, "plain")
            capture_f = starter.submit(run_server, self.capture_cmd(self.capture_dir), out, "capture", self.capture_dir)
            variant_fs = [starter.submit(run_server, self.capture_cmd(d, v), out, f"variant{i}", d)
                          for i, (d, v) in enumerate(zip(self.variant_dirs, self.variants, strict=False))]
            self.plain, self.capture = plain_f.result(), capture_f.result()
            self.variant_servers = [f.result() for f in variant_fs]

    def stop_servers(self) -> None:
        for srv in [self.plain, self.capture, *self.variant_servers]:
            if srv is not None:
                stop_server(srv)

    def measure(self, server: Server, name: str, clients: List[dict], seconds: float, spy: bool = False, **kw) -> Dict:
        """One window of ``clients`` (plus an open-loop stream in ``kw``) with the probes around it."""
        a = self.a
        Load(server.url, self.prompts).run(clients[:4], 3, max_requests=8)  # warm-up
        spy_dir = os.path.join(a.out, "pyspy")
        spying = ([e2e_probes.py_spy_window(server, name.split(" ")[0], a.py_spy_seconds, spy_dir, self.res),
                   e2e_probes.py_spy_window(server, name.split(" ")[0] + "-http", a.py_spy_seconds, spy_dir, self.res, http=True)]
                  if spy and a.py_spy_seconds > 0 else [])
        sampler = e2e_probes.RssSampler(server.proc.pid)
        sampler.start()
        client_cpu, vm, gpu = e2e_probes.client_cpu_s(), e2e_probes.vmstat(), e2e_probes.GpuSampler()
        log_at = e2e_probes.log_offset(server)
        t0 = time.monotonic()
        r = Load(server.url, self.prompts).run(clients, seconds, procs=a.client_procs, **kw)
        client_cores = round((e2e_probes.client_cpu_s() - client_cpu) / (time.monotonic() - t0), 2)  # before nvidia-smi is reaped
        r["_gpu"] = gpu.stop()
        r["_prefill_batches"] = e2e_probes.prefill_batches(server, log_at, a.tokens)
        sampler.stop_event.set()
        r["_peak_rss_bytes"] = sampler.peak
        for t in spying:
            t.join()
        r["_cpu"] = {**sampler.cpu(), "client_cores": client_cores, "vm": e2e_probes.vm_window(vm)}
        print(f"{name}: " + ", ".join(f"{k} {v['tok_per_s']:,.0f} tok/s" for k, v in r.items()
                                      if isinstance(v, dict) and "tok_per_s" in v)
              + f"; prefill batches {r['_prefill_batches']}; cpu {r['_cpu']}; gpu {r['_gpu']}", file=sys.stderr, flush=True)
        save(self.res, a.out, {name: r})  # so that a run cut short (device time limit) keeps what it measured
        return r

    def fresh_stats(self, server: Server, cdir: str) -> Dict:
        """The writer's stats after one small capture (the stats file is written after each outcome)."""
        Load(server.url, self.prompts).run([self.spec("stats", capture=True)], 60, max_requests=1)
        return read_stats(cdir)

    def measure_capture(self, server: Server, cdir: str, name: str, clients: List[dict], spy: bool = False, **kw) -> Dict:
        """``measure`` on a capture server, plus its writer's stats and the scheduler thread's time
        per seam in this window; its files are removed after."""
        before = self.fresh_stats(server, cdir).get("scheduler_thread") or {}
        r = self.measure(server, name, clients, self.a.seconds, spy=spy, **kw)
        r["_writer"] = self.fresh_stats(server, cdir)
        r["_scheduler_thread"] = _clock_delta(before, r["_writer"].get("scheduler_thread") or {})
        _clean(cdir)
        return r

    def phase_ab(self) -> None:
        """(a) plain against (b) the idle launcher, in alternating windows."""
        prefill = [self.spec("prefill")] * self.a.concurrency
        half = self.a.seconds / 2
        windows = [(self.measure(self.plain, "a_plain", prefill, half), self.measure(self.capture, "b_launcher_idle", prefill, half))
                   for _ in range(self.a.ab_rounds)]
        if windows:
            self.res["a_plain"], self.res["b_launcher_idle"] = (merge([w[i] for w in windows]) for i in (0, 1))
            self.res["ab_windows"] = [[w[0]["prefill"]["tok_per_s"], w[1]["prefill"]["tok_per_s"]] for w in windows]

    def phase_capture_ab(self) -> None:
        """Capture-all against nothing capturing on the capture server, in alternating windows."""
        n = self.a.concurrency
        plain = [self.spec("prefill")] * n
        capturing = [[self.spec("capture", capture=True, params=p)] * n for p in [{}, *self.a.request_variants]]
        names = ["d_prefill"] + [f"d_prefill_r{i}" for i in range(len(self.a.request_variants))]
        windows = [[self.measure(self.capture, "b_prefill", plain, self.a.seconds)]
                   + [self.measure_capture(self.capture, self.capture_dir, name, c) for name, c in zip(names, capturing, strict=True)]
                   for _ in range(max(self.a.ab_rounds, 1))]
        for i, key in enumerate(["b_prefill", *names]):
            self.res[key] = merge([w[i] for w in windows])
        self.res["capture_ab_windows"] = [[w[0]["prefill"]["tok_per_s"], *(x["capture"]["tok_per_s"] for x in w[1:])]
                                          for w in windows]

    def phase_prefix_ab(self) -> None:
        """Prompts sharing their first ``--shared-prefix`` tokens against the usual ones on the capture
        server, nothing capturing and capturing, in alternating windows: with the radix cache on, every
        shared-prefix request but the first reads cached tokens, unless it captures (a private
        namespace, scheduler_capture.py), so the not-capturing shared windows show what a cache hit
        does to a batch; with ``--disable-radix-cache`` all four should match their pairs."""
        n, k = self.a.concurrency, self.a.shared_prefix
        loads = [("b_prefill", self.spec("prefill")), ("b_prefill_shared", self.spec("prefill", shared_prefix=k)),
                 ("d_prefill", self.spec("capture", capture=True)),
                 ("d_prefill_shared", self.spec("capture", capture=True, shared_prefix=k))]
        windows = [[self.measure_capture(self.capture, self.capture_dir, f"prefix_ab {name}", [spec] * n) if spec["capture"]
                    else self.measure(self.capture, f"prefix_ab {name}", [spec] * n, self.a.seconds) for name, spec in loads]
                   for _ in range(max(self.a.ab_rounds, 1))]
        self.res["prefix_ab"] = {name: merge([w[i] for w in windows]) for i, (name, _) in enumerate(loads)}
        self.res["prefix_ab_windows"] = [[load_tok_per_s(x) for x in w] for w in windows]

    def phase_capacity(self) -> None:
        clients = [self.spec("capture", capture=True)] * self.a.concurrency
        self.res["d_file_capture"] = self.measure_capture(self.capture, self.capture_dir, "d_file_capture", clients)

    def phase_open(self) -> None:
        self.res["d_open_loop"] = self.measure_capture(self.capture, self.capture_dir, "d_open_loop", [],
                                                       open_spec=self.spec("capture-open", capture=True),
                                                       rate=self.a.capture_rate)

    def _capture_servers(self):
        return [(self.capture, self.capture_dir), *zip(self.variant_servers, self.variant_dirs, strict=False)]

    def warm_mixed(self) -> None:
        """Each server's first mixed window ran slow (new batch shapes): one unmeasured one first."""
        for srv, d in [(self.plain, None), *self._capture_servers()]:
            stream = self.spec("mixed-capture", capture=d is not None)
            Load(srv.url, self.prompts).run(self.others, 5, procs=self.a.client_procs, open_spec=stream, rate=self.rates[0])
            if d:
                _clean(d)

    def phase_mixed(self, rate: float) -> None:
        """The same open-loop stream of capture-sized requests beside closed-loop decode clients, on
        each server; only on capture servers does the stream capture. (a) first and last, capture
        servers in between: each (d) window has (a) windows on both sides."""
        a = self.a
        tag = "" if rate == a.capture_rate else f"@{rate:g}"
        plain_stream, capturing = self.spec("mixed-capture"), self.spec("mixed-capture", capture=True)
        labels = [("d_mixed" + tag, "d_mixed" + tag)] + [(f"d_mixed_v{i}{tag}", f"d_mixed_v{i}{tag} ({v})")
                                                         for i, v in enumerate(self.variants)]
        per_request = [(f"d_mixed_r{i}{tag}", f"d_mixed_r{i}{tag} ({json.dumps(p)})", self.spec("mixed-capture", capture=True, params=p))
                       for i, p in enumerate(a.request_variants)]
        windows: Dict[str, List[Dict]] = {}

        def keep(key: str, window: Dict) -> None:  # merged and saved per window: a run cut short keeps each
            ws = windows.setdefault(key, [])
            ws.append(window)
            self.res[key] = {**merge(ws), "_windows": [w["mixed-other"]["tok_per_s"] for w in ws]}
            save(self.res, a.out)

        for round_ in range(a.mixed_rounds):
            spy = round_ == 0 and rate == self.rates[0]
            keep("a_mixed" + tag, self.measure(self.plain, "a_mixed" + tag, self.others, a.seconds, spy=spy,
                                               open_spec=plain_stream, rate=rate))
            if a.idle_mixed:  # the capture server, nothing capturing: its scheduler thread's baseline
                keep("b_mixed" + tag, self.measure_capture(self.capture, self.capture_dir, "b_mixed" + tag, self.others,
                                                           spy=spy, open_spec=plain_stream, rate=rate))
            for (srv, d), (key, label) in zip(self._capture_servers(), labels, strict=True):
                keep(key, self.measure_capture(srv, d, label, self.others, spy=spy, open_spec=capturing, rate=rate))
            for key, label, stream in per_request:
                keep(key, self.measure_capture(self.capture, self.capture_dir, label, self.others, open_spec=stream, rate=rate))
        keep("a_mixed" + tag, self.measure(self.plain, "a_mixed" + tag, self.others, a.seconds,
                                           open_spec=plain_stream, rate=rate))

    def phase_json(self) -> None:
        """(c) SGLang's own return_hidden_states path, a few requests (they are slow)."""
        json_clients = [self.spec("json", json_hs=True)] * min(self.a.concurrency, self.a.json_requests)
        Load(self.capture.url, self.prompts).run(json_clients[:1], 60, max_requests=1)  # warm the JSON path
        t0 = time.monotonic()
        self.res["c_json"] = Load(self.capture.url, self.prompts).run(json_clients, 1e9, max_requests=len(json_clients))
        print(f"c_json: {self.res['c_json']['json']['tok_per_s']:,.0f} tok/s ({time.monotonic() - t0:.0f} s)",
              file=sys.stderr, flush=True)
        self.res["_writer_final"] = read_stats(self.capture_dir)

    def run(self) -> int:
        self.start_servers()
        try:
            if "ab" in self.phases:
                self.phase_ab()
            if "capture_ab" in self.phases:
                self.phase_capture_ab()
            if "prefix_ab" in self.phases:
                self.phase_prefix_ab()
            if "capacity" in self.phases:
                self.phase_capacity()
            if "open" in self.phases:
                self.phase_open()
            if "mixed" in self.phases:
                self.warm_mixed()
                for rate in self.rates:
                    self.phase_mixed(rate)
            if "json" in self.phases:
                self.phase_json()
        finally:
            self.stop_servers()
        return finish(self.res, self.a.out)


def main(argv: List[str]) -> int:
    # a device script's `timeout` sends SIGTERM: stop the servers (they run in their own sessions)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return Run(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
