"""Capture on a GPU server that speculates with EAGLE-3 (issue 38, items 1-3), one H200.

    python bench/gpu_spec.py PAIR_DIR OUT_DIR [--prompts 24] [--tokens 160] [--windows 6]
                             [--concurrency 64] [--window-tokens 128] [--window-seconds 12] [--warmup-seconds 4]
                             [--settings chain,tree] [--throughput-on chain[,ref]] [--launcher-args "..."]

PAIR_DIR holds the test bed's EAGLE-3 pair (``python -m sglang_capture.testbed.tiny_models PAIR_DIR
--arch llama_eagle3``: a random Llama whose layers add little, ``target/``, and a one-layer draft,
``draft/``, that guesses its next token right often but not always). Three launchers share the GPU,
with SGLang's GPU defaults (overlap scheduling, decode CUDA graphs for verify and draft): chain
drafting (top-k 1, 3 steps, 4 draft tokens), tree drafting (top-k 4, 3 steps, 8 draft tokens) and
the same target without speculation (the reference).

Per speculating server:
- **tokens**: the prompts at temperature 0 with and without capture: output tokens and verify
  passes (``spec_verify_ct``) identical;
- **rows**: each capture (prompt and accepted output rows) against a prefill-only capture of the
  same whole sequence on the reference: per column (each aux layer, final), the 0.1st-percentile
  row cosine, also without each row's 4 largest channels; bar 0.999;
- **throughput** (``--throughput-on``, default chain; ``ref`` for the same load without speculation):
  ``--concurrency`` closed-loop clients sending requests of ``--window-tokens`` output tokens, in
  windows of ``--window-seconds`` rotating three kinds of traffic: every request captured by the
  operator (the servers run ``--capture-fraction 1``: production traffic, answered without waiting
  for its file), every request asking for its file (``custom_params.capture``: each client waits
  for the file before its next request), and none (``capture: false``), after an uncounted window of
  each (``--warmup-seconds``), each request with a prompt of its own; output tok/s per window,
  ratio of the medians to none; bar 0.95 for the operator's. Per capture window (``clock``), the
  scheduler thread's calls and microseconds a call per seam and per garbage-collector generation
  since the last capture window (a none window before it included: its ``*/plain`` accounts); the
  writer's stats (writer queue and times) after the windows go into the record.
Prints a PASS/FAIL line per check and writes OUT_DIR/gpu_spec.json.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shlex
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Sequence

import requests
import torch
from e2e_probes import clock_deltas, py_spy_window, scheduler_clock  # bench/ is on sys.path: this script lives there

import sglang_capture
from sglang_capture.core.capture_dir import read_stats, writer_stats
from sglang_capture.core.layers import draft_capture_layers, read_draft_eagle3_ids
from sglang_capture.core.names import FILE_SUFFIX
from sglang_capture.testbed.cpu import has_nvidia_driver, server_env
from sglang_capture.testbed.server import Server, start_server, stop_server

GPU_ARGS = ("--attention-backend triton --grammar-backend none --cuda-graph-max-bs 64 --mem-fraction-static 0.88 "
            "--max-total-tokens 120000 --max-running-requests 64").split()
SETTINGS = {"chain": ["--speculative-eagle-topk", "1", "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4"],
            "tree": ["--speculative-eagle-topk", "4", "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "8"],
            # chain drafting with Python's own GIL switch interval in the scheduler process (5 ms, not
            # the package's 1 ms): whether the hand-off threads' GIL turns cost the scheduler thread
            "chain-si5": ["--speculative-eagle-topk", "1", "--speculative-num-steps", "3", "--speculative-num-draft-tokens",
                          "4", "--capture-switch-interval-ms", "0"]}
MIN_COS = 0.999
MIN_RATIO = 0.95
FRESH_TOKENS = 256  # prompt tokens of each throughput request


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def start(name: str, target: str, work: str, captures: str, extra: List[str], launcher: Sequence[str] = ()) -> Server:
    capture_dir = os.path.join(captures, name)
    shutil.rmtree(capture_dir, ignore_errors=True)  # an earlier run's files: names would collide
    os.makedirs(capture_dir)
    if has_nvidia_driver():
        cmd = [sys.executable, "-m", "sglang_capture.launch", "--capture-dir", capture_dir, "--capture-fraction", "1",
               "--model-path", target, *GPU_ARGS, *extra, *launcher]
        env = dict(os.environ)
    else:  # a dry run of this script on the CPU test bed (its EAGLE-3 flags; float32)
        from sglang_capture.testbed.once import cache_dir
        from sglang_capture.testbed.server import capture_cmd
        from sglang_capture.testbed.spec_kernels import eagle3_server_args

        spec = extra[0] == "--speculative-algorithm"
        cmd = capture_cmd(target, capture_dir, "--capture-fraction", "1")
        cmd += eagle3_server_args(extra[3], 1, 3, 4) if spec else ["--dtype", "float32", *extra]
        cmd += list(launcher)
        env = server_env(cache_dir())
    return start_server(cmd, env, os.path.join(work, f"{name}.log"), capture_dir)


def vocab_of(target: str) -> List[int]:
    """The target's token ids, the first 8 (special tokens) left out."""
    from transformers import AutoTokenizer

    return sorted(AutoTokenizer.from_pretrained(target).get_vocab().values())[8:]


def prompts(vocab: List[int], n: int, seed: int = 0) -> List[List[int]]:
    """Token-id prompts of 16 to 1,500 tokens (long ones are prefilled in several chunks)."""
    rng = random.Random(seed)
    lengths = [16, 64, 300, 1500] + [rng.randint(16, 800) for _ in range(n - 4)]
    return [[rng.choice(vocab) for _ in range(k)] for k in lengths[:n]]


def fresh_prompt(vocab: List[int], key: str, length: int = FRESH_TOKENS) -> List[int]:
    """A prompt of its own for each throughput request (``key`` names it). Reused prompts made the
    comparison unfair: requests that do not capture read their prompt from the radix cache after its
    first use, while a capture request never does (its private namespace), so the windows without
    capture prefilled a fraction of the tokens the capturing ones did (on the H200: 49-56k tokens per 10 s
    read from the cache, against about 45k prefilled anew)."""
    rng = random.Random(key)
    return [rng.choice(vocab) for _ in range(length)]


def generate(server: Server, ids: List[int], tokens: int, name: str = "", operator: bool = False) -> Dict:
    """A request that asks for its file (``name``), one the operator captures (``operator``: the
    servers capture every request that says nothing), or one that opts out."""
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    if name:
        params["custom_params"] = {"capture": True, "capture_name": name}
    elif not operator:
        params["custom_params"] = {"capture": False}
    r = server.generate({"input_ids": ids, "sampling_params": params}, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def cosines(x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, y = x.to(dev, torch.float32), y.to(dev, torch.float32)
    top = torch.maximum(x.abs(), y.abs()).topk(4, dim=-1).indices
    keep = torch.ones_like(x).scatter_(-1, top, 0.0)
    return {"cos": torch.nn.functional.cosine_similarity(x, y, dim=-1).cpu(),
            "cos_top4_out": torch.nn.functional.cosine_similarity(x * keep, y * keep, dim=-1).cpu()}


class ColumnCosines:
    """Row cosines of captures against references of the same sequences, per column (each aux
    layer, final), with and without each row's 4 largest channels (also bench/drafter_run.py)."""

    def __init__(self) -> None:
        self.per_col: Dict[str, List[torch.Tensor]] = {}
        self.files = self.rows = 0

    def add(self, mine: Dict, theirs: Dict, n: int) -> None:
        """The first ``n`` rows of two loaded captures of one sequence."""
        h = mine["hidden_size"]
        cols = {f"aux{k}": (mine["aux_hidden_states"][:n, k * h:(k + 1) * h], theirs["aux_hidden_states"][:n, k * h:(k + 1) * h])
                for k in range(mine["aux_hidden_states"].shape[1] // h)}
        cols["final"] = (mine["last_hidden_states"][:n], theirs["last_hidden_states"][:n])
        for col, (x, y) in cols.items():
            for kind, v in cosines(x, y).items():
                self.per_col.setdefault(f"{col}/{kind}", []).append(v)
        self.files += 1
        self.rows += n

    def result(self) -> Dict:
        """0.1st-percentile and lowest cosine per column; pass when every 0.1st percentile reaches MIN_COS."""
        stats = {}
        for key, vs in self.per_col.items():
            v = torch.cat(vs)
            stats[key] = {"p0.1": round(float(torch.quantile(v, 0.001)), 6), "min": round(float(v.min()), 6)}
        return {"files": self.files, "rows": self.rows, "columns": stats, "bar": MIN_COS,
                "pass": all(s["p0.1"] >= MIN_COS for s in stats.values())}


def check_rows(spec: Server, ref: Server, outs: List[Dict], setting: str) -> Dict:
    """Every speculative capture against a prefill-only capture of its whole sequence on ``ref``."""
    compared = ColumnCosines()
    for i, out in enumerate(outs):
        cap = out["meta_info"]["capture"]
        if cap["status"] != "ok":
            raise RuntimeError(f"{setting} capture {i}: {cap}")
        mine = sglang_capture.load(cap["path"])
        ids = mine["input_ids"].tolist() + mine["output_ids"].tolist()
        theirs = sglang_capture.load(generate(ref, ids, 1, f"ref-{setting}-{i}")["meta_info"]["capture"]["path"])
        n = mine["aux_hidden_states"].shape[0]
        if n != len(ids) - 1 or theirs["input_ids"].tolist() != ids:
            raise RuntimeError(f"{setting} capture {i}: {n} rows for {len(ids)} tokens")
        compared.add(mine, theirs, n)
    return compared.result()


def flush_radix(server: Server) -> None:
    """Empty the server's radix cache, waiting up to 30 s for it to be idle (under overlap scheduling a
    request just answered still holds its batch for about a step: without the wait SGLang answers 400)."""
    r = requests.post(server.url + "/flush_cache", params={"timeout": 30}, timeout=60)
    if r.status_code != 200:
        raise RuntimeError(f"/flush_cache: HTTP {r.status_code}: {r.text[:200]}")


def check_tokens(server: Server, ps: List[List[int]], tokens: int, setting: str, alone: int = 8) -> tuple:
    """Capture on and off, one request at a time (the same batches both ways) for the first ``alone``
    prompts: identical tokens and verify passes; then every prompt captured at once, for the rows.
    The radix cache is emptied before each of the two: under prefix sharing the plain request would
    otherwise reuse the capture's cached sequence (a one-token prefill after a cached prefix, not the
    whole prompt's), whose numerics differ at the last bits and tip near-tied greedy tokens (r76: 1 and
    4 of 8 the same on an H100)."""
    same_tokens = same_verify = tok = verify = 0
    for i in range(min(alone, len(ps))):
        flush_radix(server)
        captured = generate(server, ps[i], tokens, f"{setting}-alone-{i}")
        flush_radix(server)
        plain = generate(server, ps[i], tokens)
        same_tokens += captured["output_ids"] == plain["output_ids"]
        same_verify += captured["meta_info"]["spec_verify_ct"] == plain["meta_info"]["spec_verify_ct"]
        tok += plain["meta_info"]["completion_tokens"]
        verify += plain["meta_info"]["spec_verify_ct"]
    n = min(alone, len(ps))
    res = {"requests": n, "same_tokens": same_tokens, "same_verify_ct": same_verify,
           "tokens_per_verify": round(tok / max(verify, 1), 3)}
    res["pass"] = same_tokens == same_verify == n
    with ThreadPoolExecutor(len(ps)) as pool:  # verify passes of many requests at once, in CUDA graphs
        batched = list(pool.map(lambda i: generate(server, ps[i], tokens, f"{setting}-{i}"), range(len(ps))))
    return res, batched


KINDS = ("operator", "client", "plain")


def window(server: Server, vocab: List[int], kind: str, name: str, concurrency: int, tokens: int, seconds: float) -> tuple:
    """One window of ``kind`` traffic (``KINDS``): ``concurrency`` closed-loop clients, each sending its
    next request as soon as one is answered (a client capture's after its file is written) until
    ``seconds`` have passed. Returns the output tokens of every request it started and the time until
    the last one was answered. (Counting only the requests answered within ``seconds`` read whole rounds
    of the 64 clients: with rounds of 1-2 s, 4 against 5 of them in 10 s, a 0.8 that was not there.)
    Every request has a prompt of its own (``fresh_prompt``), so no kind of window reads the radix cache.
    The writers then finish the window's files, which are removed (the disk would not hold them all);
    last, their stats files by name."""
    t0 = time.perf_counter()
    stop = t0 + seconds

    def client(i: int) -> tuple:
        done, n = 0, 0
        while time.perf_counter() < stop:
            key = f"{name}-{i}-{n}"
            out = generate(server, fresh_prompt(vocab, key), tokens, f"tp-{key}" if kind == "client" else "",
                           operator=kind == "operator")
            n += 1
            if kind == "client" and out["meta_info"]["capture"]["status"] != "ok":
                raise RuntimeError(f"throughput window {name}: {out['meta_info']['capture']}")
            done += out["meta_info"]["completion_tokens"]
        return done, time.perf_counter()

    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(client, range(concurrency)))
    stats = drain(server)  # an operator window's files are still being written when its responses are in
    for f in glob.glob(os.path.join(server.capture_dir, "*" + FILE_SUFFIX)):
        os.remove(f)
    return sum(n for n, _ in done), max(end for _, end in done) - t0, stats


def throughput(server: Server, vocab: List[int], windows: int, concurrency: int, tokens: int, seconds: float,
               setting: str, spy_seconds: float = 0.0, spy_dir: str = "", warmup_seconds: float = 0.0,
               freeze_gc: bool = False) -> Dict:
    """``windows`` rounds of one ``window`` of each kind of traffic, rotating their order; a window's
    rate is its tokens over its time. ``warmup_seconds``: first a window of each kind that is not
    counted (r72's first window, the server's first batches of 64 new prompts, read a quarter of the
    rate of the others). ``spy_seconds``: py-spy samples the scheduler in the first window of each
    kind (bench/e2e_probes.py), summaries under ``pyspy``. ``freeze_gc``: after the warm-up, SGLang's
    ``/freeze_gc`` (``gc.freeze()`` in the scheduler and detokenizer: the objects alive then are never
    walked again), as an operator would run it once a server is warm (r80: one full collection of 0.73 s
    inside an 8 s window)."""
    if warmup_seconds > 0:
        for kind in KINDS:
            window(server, vocab, kind, f"{setting}-{kind}-warmup", concurrency, tokens, warmup_seconds)
    if freeze_gc:
        r = requests.post(server.url + "/freeze_gc", timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"/freeze_gc: HTTP {r.status_code}: {r.text[:200]}")
    rates: Dict[str, List[float]] = {k: [] for k in KINDS}
    durations: Dict[str, List[float]] = {k: [] for k in KINDS}
    clocks: Dict[str, List[Dict]] = {k: [] for k in KINDS}
    clock = scheduler_clock(drain(server))
    spied: Dict = {}
    for w in range(windows):
        for kind in KINDS[w % 3:] + KINDS[:w % 3]:
            spy = (py_spy_window(server, f"{setting}-{kind}", spy_seconds, spy_dir, spied)
                   if spy_seconds > 0 and w < len(KINDS) and kind == KINDS[w] else None)
            total, lasted, stats = window(server, vocab, kind, f"{setting}-{kind}-{w}", concurrency, tokens, seconds)
            if spy is not None:
                spy.join()
            rates[kind].append(total / lasted)
            durations[kind].append(round(lasted, 2))
            # a stats file is rewritten only as capture jobs finish: a none window's batches and
            # collections land in the next capture window's deltas (its */plain accounts), none of its own
            clocks[kind].append(clock_deltas(clock, clock := scheduler_clock(stats)) if kind != "plain" else None)
        log(f"{setting} window {w}: " + ", ".join(f"{k} {rates[k][-1]:.0f}" for k in KINDS) + " tok/s")
    plain = statistics.median(rates["plain"])
    ratios = {k: round(statistics.median(rates[k]) / plain, 4) for k in KINDS[:2]}
    return {"windows": windows, "seconds": seconds, "warmup_seconds": warmup_seconds, "freeze_gc": freeze_gc,
            "concurrency": concurrency,
            "tokens": tokens, "tok_s": {k: [round(x) for x in v] for k, v in rates.items()}, "window_s": durations,
            "ratio_of_medians": ratios, "pass": ratios["operator"] >= MIN_RATIO, "clock": clocks, "stats": drain(server),
            **spied}


def drain(server: Server, timeout_s: float = 120.0) -> Dict:
    """Wait until the server's writers have nothing queued or in hand (so that one window's
    writing does not run into the next), and return its stats files by name."""
    deadline = time.monotonic() + timeout_s
    while True:
        read_stats(server.capture_dir, settled=True)
        stats = {os.path.basename(p): s for p, s in writer_stats(server.capture_dir).items()}
        if all(s.get("queue", 0) == 0 and s.get("busy", 0) == 0 for s in stats.values()) or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


def main(a: argparse.Namespace) -> int:
    os.makedirs(a.out, exist_ok=True)
    target, draft = os.path.join(a.pair, "target"), os.path.join(a.pair, "draft")
    settings = a.settings.split(",")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"gpu_spec.py: --settings {','.join(unknown)}: not a setting ({', '.join(SETTINGS)})")
    unserved = sorted({s for s in a.throughput_on.split(",") if s} - {*settings, "ref"})
    if unserved:
        raise SystemExit(f"gpu_spec.py: --throughput-on {','.join(unserved)}: not served (--settings {a.settings}, and ref); "
                         "name those, or nothing")
    work = os.path.join(a.out, "work")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(target, "config.json")) as f:
        num_layers = json.load(f)["num_hidden_layers"]
    # the reference captures the layers the served draft makes the speculating servers capture
    layers = draft_capture_layers(read_draft_eagle3_ids(draft), num_layers, "LlamaForCausalLM")
    t0 = time.time()
    with ThreadPoolExecutor(len(settings) + 1) as pool:
        futures = {s: pool.submit(start, s, target, work, a.captures, ["--speculative-algorithm", "EAGLE3",
                                                           "--speculative-draft-model-path", draft, *SETTINGS[s]],
                                  shlex.split(a.launcher_args))
                   for s in settings}
        futures["ref"] = pool.submit(start, "ref", target, work, a.captures, ["--capture-layers", ",".join(map(str, layers))])
        servers = {k: f.result() for k, f in futures.items()}
    log(f"{len(servers)} servers up in {time.time() - t0:.0f} s")
    res: Dict = {"pair": a.pair, "server_args": " ".join(GPU_ARGS), "settings": {s: " ".join(SETTINGS[s]) for s in settings}}
    ok = True
    try:
        vocab = vocab_of(target)
        ps = prompts(vocab, a.prompts)
        for s in settings:
            tokens, captured = check_tokens(servers[s], ps, a.tokens, s)
            rows = check_rows(servers[s], servers["ref"], captured, s)
            res[s] = {"tokens": tokens, "rows": rows}
            ok &= tokens["pass"] and rows["pass"]
            log(f"{'PASS' if tokens['pass'] else 'FAIL'} {s} tokens: {tokens}")
            log(f"{'PASS' if rows['pass'] else 'FAIL'} {s} rows: {rows['files']} files, {rows['rows']} rows, "
                + ", ".join(f"{k} {v['p0.1']}" for k, v in rows["columns"].items()))
        for s in [s for s in a.throughput_on.split(",") if s]:
            tp = throughput(servers[s], vocab, a.windows, a.concurrency, a.window_tokens, a.window_seconds, s,
                            a.py_spy_seconds, os.path.join(a.out, "pyspy"), a.warmup_seconds, a.freeze_gc)
            res.setdefault(s, {})["throughput"] = tp
            ok &= tp["pass"] or s == "ref"  # the reference (no speculation) is context, not a bar
            log(f"{'PASS' if tp['pass'] else 'FAIL'} {s} throughput over none: {tp['ratio_of_medians']} ({tp['tok_s']})")
    finally:
        res["pass"] = bool(ok)
        try:  # before the servers stop: SGLang's shutdown can outlast the call's time limit (a record was lost so)
            with open(os.path.join(a.out, "gpu_spec.json"), "w") as f:
                json.dump(res, f, indent=1)
        finally:
            for s in servers.values():
                stop_server(s)
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pair")
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--window-tokens", type=int, default=128)
    ap.add_argument("--window-seconds", type=float, default=12.0)
    ap.add_argument("--warmup-seconds", type=float, default=4.0, help="an uncounted window of each kind first")
    ap.add_argument("--settings", default="chain,tree")
    ap.add_argument("--throughput-on", default="chain", help="servers measured for throughput: settings, and ref (the "
                    "same target without speculation, for context)")
    ap.add_argument("--py-spy-seconds", type=float, default=0.0, help="sample the scheduler in the first window of "
                    "each kind for this long (py-spy on PATH or beside the package)")
    ap.add_argument("--freeze-gc", action="store_true", help="POST /freeze_gc to each measured server after its "
                    "warm-up windows")
    ap.add_argument("--captures", default="/tmp/gpu-spec-captures", help="capture dirs, one per server (outside OUT)")
    ap.add_argument("--launcher-args", default="", help="more options for the speculating servers' launchers, one string "
                    "(e.g. \"--capture-writer-cpus 8-15 --capture-writers 4\": what the host's other work costs the step)")
    sys.exit(main(ap.parse_args()))
