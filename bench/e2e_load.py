"""Load generation for bench/e2e.py: random-token prompts that never hit the radix cache (unless
asked to share a prefix), closed-loop clients spread over processes, an open-loop stream, and
per-kind summaries."""
from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import numpy
import requests

# Prompt and capture numbers, one sequence over the whole run and every forked client process
# (shared memory, inherited through fork): consecutive prompts differ in their first token.
_SEQUENCE = multiprocessing.get_context("fork").Value("q", 0)
_RUN = os.getpid()  # the load generator's pid, in every capture name: a rerun into the same dir never reuses one


def _next_number() -> int:
    with _SEQUENCE.get_lock():
        _SEQUENCE.value += 1
        return _SEQUENCE.value


class Prompts:
    """Request bodies built without per-request Python loops, so that the load generator (64
    threads in one interpreter) does not become the bottleneck at 600 K tok/s.

    Every prompt starts with 4 tokens numbering it in the run's one sequence, first token
    fastest: any ``vocab - 4`` consecutive prompts differ in their first token, so the radix cache
    never matches one (a server caches far fewer prompts than the test bed's 1,020). A prompt
    matching one cached token would not be a harmless detail: on SGLang's MLA models it moves its
    whole prefill batch to another attention path (bench/results/e2e-kimi-radix-on-h200-2026-12-02-r51.md:
    why shared prefixes moved the windows). ``shared_prefix`` puts that many fixed tokens first
    instead, to measure exactly that.
    The rest of a prompt is one of 64 random tails.
    """

    SHARED_TOKEN = 3  # the shared prefix's token, never a prompt's first token otherwise (heads start at 4)

    def __init__(self, tokens: int, vocab: int, seed: int = 0) -> None:
        rng = numpy.random.default_rng(seed)
        self.base = vocab - 4
        self.tokens = tokens
        self.tails = [rng.integers(3, vocab, tokens - 4).tolist() for _ in range(64)]
        self.texts: Dict[int, Tuple[str, List[str]]] = {}  # per shared-prefix length: prefix and tails as JSON text

    @staticmethod
    def most_shared(tokens: int) -> int:
        """The longest shared prefix a prompt of ``tokens`` can have: its own 4-token head must fit after it."""
        return tokens - 5

    def _text(self, shared: int) -> Tuple[str, List[str]]:
        if shared not in self.texts:
            if not 0 <= shared <= self.most_shared(self.tokens):
                raise ValueError(f"a shared prefix of {shared} tokens leaves no room for a prompt's own head in {self.tokens}")
            self.texts[shared] = ("".join(f"{self.SHARED_TOKEN}," for _ in range(shared)),
                                  [",".join(map(str, t[:len(t) - shared])) for t in self.tails])
        return self.texts[shared]

    def body(self, max_new: int, capture: bool, json_hs: bool, capture_params: Optional[dict] = None,
             shared_prefix: int = 0) -> bytes:
        n = _next_number()
        head = ",".join(str(4 + (n // self.base ** k) % self.base) for k in range(4))
        params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
        if capture:
            params["custom_params"] = {"capture": True, "capture_name": f"bench-{_RUN}-{n}", **(capture_params or {})}
        prefix, tails = self._text(shared_prefix)
        return ('{"input_ids":[%s%s,%s],"sampling_params":%s%s}' % (
            prefix, head, tails[n % len(tails)], json.dumps(params),
            ',"return_hidden_states":true' if json_hs else "")).encode()


PROMPTS: Dict[str, Prompts] = {}  # the run's prompts, inherited by forked client processes


def _client_process(url: str, clients: List[dict], stop_at: float) -> List[dict]:
    """Closed-loop clients in a process of their own, until ``stop_at`` (CLOCK_MONOTONIC is shared)."""
    load = Load(url, PROMPTS["run"])
    load.closed_loop(clients, stop_at)
    return load.results


class Load:
    """Closed-loop clients (each sends its next request when the last one returns) plus an
    optional open-loop stream (requests at a fixed rate, whatever the server's state), for
    ``seconds``; per-kind tokens/s, latency percentiles and capture outcomes.

    The closed-loop clients run in ``procs`` processes: at 900 K tok/s plain SGLang answers ~440
    requests/s, which leaves one interpreter little headroom. Spread over 4 processes the client
    used 0.3 cores on the H200 (r17) while windows of the same server still differed by up to
    20%, so that spread does not come from the client (bench/results/e2e-h200-2026-11-30-r14-headline.md)."""

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
        data = self.prompts.body(spec["max_new"], spec["capture"], spec["json"], spec.get("params"),
                                 spec.get("shared_prefix", 0))
        t0 = time.monotonic()
        r = session.post(self.url + "/generate", data=data, headers={"Content-Type": "application/json"}, timeout=900)
        end = time.monotonic()
        ok = r.status_code == 200
        # only capture responses are parsed: a JSON-path response is hundreds of MB of floats
        ref = r.json().get("meta_info", {}).get("capture") if ok and spec["capture"] else None
        with self.lock:
            self.results.append({"kind": spec["kind"], "tokens": spec["tokens"], "start": t0, "latency": end - t0,
                                 "ok": ok, "capture_ok": bool(ref and ref.get("status") == "ok"),
                                 "bytes": (ref or {}).get("bytes", 0) + (ref or {}).get("block_bytes", 0), "end": end})

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
                futures = [children.submit(_client_process, self.url, g, stop_at) for g in groups]
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
