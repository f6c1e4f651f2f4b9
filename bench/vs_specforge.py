"""Side by side with SpecForge's offline capture (issue 35): same H200, same conversations.

    python bench/vs_specforge.py STAGE|run [--deadline-s S] [options]

Both tools get the same 2,000 conversations (ShareGPT first turns, answers regenerated greedily
by SmolLM2, as in the drafter chain; each with the system turn SpecForge's ``qwen`` template
would add, so that both render the same ChatML), the same draft config (its
``eagle_aux_hidden_state_layer_ids`` decide the layers for both: our launcher through
``--capture-layers-from-draft``) and the same maximum length (2,048). Two targets:
``smol`` (SmolLM2-135M-Instruct, real weights) and ``l8b`` (Llama-3.1-8B shapes, random bf16
weights written as safetensors here, so that both tools load the same files).

For each target:
``servers``   plain SGLang 0.5.17 (the ceiling: prefill-only, ``max_new_tokens`` 1, our ids) and
              the package's launcher, side by side (the 8B's started in the background by an
              earlier call, ``l8b-prestart``); at each ``--sweep`` count of requests in flight the
              ceiling, then ``sglang-capture extract`` in bf16 and fp8 (each tool's best goes in
              the table, with the writers' counters and extract's first file apart); then a pass
              sampled by py-spy in the scheduler, a writer and the client.
``sf-B``      SpecForge's ``scripts/prepare_hidden_states.py`` (the checkout at ``--specforge``,
              SGLang 0.5.14 from the second kit) at ``--batch-size B`` for B in 8, 32, 64 (on the
              8B the first ``--sf-samples`` conversations); then ``sf-gz`` with ``--compress`` at
              the fastest B.
``rows``      (smol) every sample of SpecForge's files against our export of the same
              conversation: input ids, loss masks, per-row cosine per column, plain and without
              each row's 4 largest channels.

Every measurement: whole-stage real-token tok/s (SpecForge's padding excluded; its stage ends at
its last file), start-up apart (SpecForge's first batch, which compiles kernels, also apart),
samples written against given, bytes on disk, peak host RSS of the tool's process tree, GPU busy
share (``nvidia-smi`` utilization sampled every 200 ms). ``run`` does the pending stages in
order and stops before one that would not finish by ``--deadline-s`` (a device call's limit):
call it again to go on. Results: WORK/results/*.json; ``report`` (also at the end of ``run``) prints the
table and writes the run's merged record beside them (``vs_specforge_report.py``, which also reads
that record back anywhere).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import psutil
import requests
import vs_specforge_report  # bench/ is on sys.path: this script lives there
from drafter_run import _cli, regen

from sglang_capture.testbed.cpu import server_env
from sglang_capture.testbed.once import cache_dir
from sglang_capture.testbed.server import Server, start_server, stop_server

SYSTEM = "You are a helpful assistant."  # SpecForge's qwen template adds it when a sample has none
SF_ORDER = (32, 64, 8)  # SpecForge's default first
TARGETS = ("smol", "l8b")
# Same flags for the ceiling and for our launcher. No decode step runs (max_new_tokens 1), so CUDA
# graphs only cost start-up; SpecForge's runner has them off too. Two servers share the GPU while
# they start: a high static fraction with --max-total-tokens capping each pool (drafter_run.py).
SERVER_ARGS = ("--attention-backend triton --grammar-backend none --disable-cuda-graph --sleep-on-idle "
               "--chunked-prefill-size 16384 --max-running-requests 128 --mem-fraction-static 0.88")
KV_TOKENS = {"smol": 131072, "l8b": 60000}
L8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
       "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
       "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
       "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
       "eos_token_id": 2, "attention_bias": False, "mlp_bias": False}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- probes


class GpuBusy:
    """``nvidia-smi`` utilization every 200 ms, timestamped here; ``share(t0, t1)`` is the mean."""

    def __init__(self) -> None:
        self.samples: List[Tuple[float, float]] = []
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                          "-lms", "200"], stdout=subprocess.PIPE, text=True)
        except FileNotFoundError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.samples.append((time.monotonic(), float(line.strip().split(",")[0])))
            except ValueError:
                pass

    def share(self, t0: float, t1: float) -> Optional[float]:
        xs = [u for t, u in self.samples if t0 <= t <= t1]
        return round(sum(xs) / len(xs) / 100, 3) if xs else None


class PeakRss:
    """Peak of the summed RSS of the process trees under ``roots`` (sampled every 200 ms)."""

    def __init__(self, roots: List[int]) -> None:
        self.roots, self.peak, self._stop = list(roots), 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def add(self, pid: int) -> None:
        self.roots.append(pid)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            total, seen = 0, set()
            for root in list(self.roots):
                try:
                    p = psutil.Process(root)
                    procs = [p] + p.children(recursive=True)
                except psutil.Error:
                    continue
                for q in procs:
                    if q.pid in seen:
                        continue
                    seen.add(q.pid)
                    try:
                        total += q.memory_info().rss
                    except psutil.Error:
                        pass
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


# ---------------------------------------------------------------- inputs


def conversations(a: argparse.Namespace) -> None:
    """The drafter chain's regenerated conversations, each with SpecForge's default system turn."""
    src = os.path.join(a.work, "regen", "conversations.jsonl")
    if not os.path.exists(src):
        os.makedirs(os.path.dirname(src), exist_ok=True)
        regen(argparse.Namespace(model=model_dir(a, "smol"), train_prompts=a.prompts, samples=a.samples,
                                 answer_tokens=a.answer_tokens, concurrency=64, work=os.path.dirname(src),
                                 server_args="--attention-backend triton --grammar-backend none --cuda-graph-max-bs 128 "
                                             "--mem-fraction-static 0.5"))
    n = 0
    with open(src) as f, open(conv_path(a), "w") as out:
        for line in f:
            doc = json.loads(line)
            if doc["conversations"][0]["from"] != "system":  # a carried file from an earlier chain has it
                doc["conversations"] = [{"from": "system", "value": SYSTEM}] + doc["conversations"]
            out.write(json.dumps(doc) + "\n")
            n += 1
    save(a, "conversations", {"samples": n, "source": src, "system": SYSTEM})


def conv_path(a: argparse.Namespace) -> str:
    return os.path.join(a.work, "conversations.jsonl")


def model_dir(a: argparse.Namespace, target: str) -> str:
    return os.path.join(a.work, target, "model")


def draft_config(a: argparse.Namespace, target: str) -> str:
    """One EAGLE-3 draft config per target, given to both tools: its ids are SGLang's default
    capture for the target (``[2, L//2, L-3]`` entering layers, so ids one less)."""
    path = os.path.join(a.work, target, "draft_config.json")
    t = json.load(open(os.path.join(model_dir(a, target), "config.json")))
    n = t["num_hidden_layers"]
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": t["hidden_size"],
           "target_hidden_size": t["hidden_size"], "num_hidden_layers": 1,
           "num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"],
           "intermediate_size": t["intermediate_size"], "hidden_act": "silu", "rms_norm_eps": t["rms_norm_eps"],
           "max_position_embeddings": t["max_position_embeddings"], "vocab_size": t["vocab_size"],
           "draft_vocab_size": 32000, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, n // 2 - 1, n - 4], "use_aux_hidden_state": True}}
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def l8b_weights(a: argparse.Namespace) -> None:
    """Random bf16 weights of Llama-3.1-8B's shapes as safetensors shards (std 0.02, norms 1),
    and SmolLM2's tokenizer (ChatML; its ids fit the 128,256 vocab)."""
    import torch
    from safetensors.torch import save_file

    out = model_dir(a, "l8b")
    os.makedirs(out, exist_ok=True)
    c, t0 = L8B, time.monotonic()
    h, kv, inter = c["hidden_size"], c["num_key_value_heads"] * c["head_dim"], c["intermediate_size"]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()

    shards: List[Dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": rnd(c["vocab_size"], h),
                                              "lm_head.weight": rnd(c["vocab_size"], h),
                                              "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}]
    weight_map = {}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if i % 4 == 0:
            shards.append({})
        shards[-1].update({p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                           p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
                           p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                           p + "mlp.down_proj.weight": rnd(h, inter),
                           p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                           p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out, name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(out, "*.safetensors")))
    log(f"l8b weights: {size / 1e9:.1f} GB in {time.monotonic() - t0:.0f} s")
    open(os.path.join(out, ".weights-done"), "w").close()


def l8b_model(a: argparse.Namespace) -> None:
    """Waits for the weights (written in the background since the first call) and adds the tokenizer."""
    out = model_dir(a, "l8b")
    for _ in range(600):
        if os.path.exists(os.path.join(out, ".weights-done")):
            break
        time.sleep(1)
    else:
        raise SystemExit("the l8b weights are not written yet (see /tmp/vs/l8b-weights.log)")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        src = os.path.join(model_dir(a, "smol"), name)
        if os.path.exists(src):
            shutil.copy(src, out)
    save(a, "l8b-model", {"bytes": du(out, "*.safetensors")})


# ---------------------------------------------------------------- our side and the ceiling


def encoded(a: argparse.Namespace, target: str):
    """(id, input_ids, loss_mask) of every conversation, by the package's own templating."""
    from sglang_capture.tools.conversations import read_samples
    from sglang_capture.tools.templating import ChatEncoder, load_tokenizer

    enc = ChatEncoder(load_tokenizer(model_dir(a, target)), model_dir(a, target))
    out = []
    for s in read_samples(conv_path(a)).samples:
        e = enc.encode(s)
        out.append((s.id, e.input_ids, e.loss_mask))
    return out


def _ceiling(server: Server, samples, concurrency: int) -> Dict:
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=concurrency)
    session.mount("http://", adapter)

    def one(ids: List[int]) -> int:
        r = session.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 1, "temperature": 0}}, timeout=600)
        r.raise_for_status()
        return r.json()["meta_info"]["prompt_tokens"]

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, [ids for _, ids, _ in samples]))
    return {"tokens": tokens, "seconds": time.monotonic() - t0}


def _first_file(out: str, proc: subprocess.Popen, t0: float, seen: Dict[str, float]) -> None:
    """Note when the pass's first sample file appears: what comes before is extract's own start-up."""
    while proc.poll() is None:
        try:
            if any(n.endswith(".capture.msgpack") for n in os.listdir(out)):
                seen["first_file_s"] = round(time.monotonic() - t0, 2)
                return
        except FileNotFoundError:
            pass
        time.sleep(0.05)


def _extract(a: argparse.Namespace, server: Server, out: str, dtype: str, rss: PeakRss, concurrency: int,
             on_first_file: Optional[Callable[[subprocess.Popen], None]] = None) -> Dict:
    cmd = ["sglang-capture", "extract", conv_path(a), "--server", server.url, "--out", out, "--concurrency",
           str(concurrency), "--no-progress"] + (["--capture-dtype", "fp8"] if dtype == "fp8" else [])
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rss.add(proc.pid)
    seen: Dict[str, float] = {}

    def watch() -> None:
        _first_file(out, proc, t0, seen)
        if on_first_file is not None and "first_file_s" in seen:
            on_first_file(proc)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    stdout, stderr = proc.communicate()
    seconds = time.monotonic() - t0
    watcher.join(timeout=5)
    if proc.returncode != 0:
        raise SystemExit(f"extract {dtype} failed ({proc.returncode}):\n{stdout[-2000:]}\n{stderr[-3000:]}")
    summary = stdout.strip().splitlines()[-1]
    m = re.search(r"(\d+) samples: (\d+) written.*?([\d,]+) tokens", summary)
    tokens = int(m.group(3).replace(",", ""))
    first = seen.get("first_file_s")
    return {"summary": summary, "given": int(m.group(1)), "written": int(m.group(2)), "tokens": tokens,
            "seconds": seconds, "first_file_s": first,
            # the rate once extract's first file is out (its start-up, imports and tokenizer, left out;
            # the first file's own prefill and write too, so a little high)
            "tok_per_s_from_first_file": round(tokens / (seconds - first)) if first and seconds > first else None}


class Adopted:
    """The ``Popen`` face (pid, poll, wait) of a server another process of this chain started."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        try:
            alive = psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            alive = False
        if not alive:
            self.returncode = self.returncode if self.returncode is not None else -1
        return None if alive else self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        try:
            psutil.Process(self.pid).wait(timeout)
        except psutil.NoSuchProcess:
            pass
        except psutil.TimeoutExpired:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout) from None
        self.returncode = -1
        return self.returncode


def server_cmds(a: argparse.Namespace, target: str) -> Dict[str, Tuple[List[str], str]]:
    work = os.path.join(a.work, target)
    model, draft = model_dir(a, target), draft_config(a, target)
    args = shlex.split(a.server_args or SERVER_ARGS + f" --max-total-tokens {KV_TOKENS[target]}")
    capture_dir = os.path.join(work, "capture-server")
    os.makedirs(capture_dir, exist_ok=True)
    return {"plain": ([sys.executable, "-m", "sglang.launch_server", "--model-path", model, *args], ""),
            "ours": ([sys.executable, "-m", "sglang_capture.launch", "--capture-dir", capture_dir,
                      "--capture-layers-from-draft", draft, *shlex.split(a.ours_args), "--model-path", model, *args],
                     capture_dir)}


def start_both(a: argparse.Namespace, target: str) -> Dict[str, Tuple[Server, float]]:
    """The ceiling's server and ours, started side by side: (server, start-up seconds) by name."""
    cmds = server_cmds(a, target)
    started: Dict[str, Tuple[Server, float]] = {}

    def start(name: str) -> None:
        t0 = time.monotonic()
        cmd, cdir = cmds[name]
        log_path = os.path.join(a.work, target, f"server-{name}.log")
        started[name] = (start_server(cmd, server_env(cache_dir()), log_path, cdir), time.monotonic() - t0)

    try:
        with cf.ThreadPoolExecutor(2) as pool:
            list(pool.map(start, cmds))
    except BaseException:
        for server, _ in started.values():
            stop_server(server)
        raise
    return started


def prestart(a: argparse.Namespace, target: str) -> None:
    """In the background, from an early call of the chain: the model's files, then both servers,
    so that their start-up overlaps the calls before ``run``. WORK/TARGET/servers.json says where
    they are (or servers.failed why not); ``servers`` adopts them."""
    state = os.path.join(a.work, target, "servers")
    for suffix in (".json", ".failed"):
        if os.path.exists(state + suffix):
            os.unlink(state + suffix)
    try:
        if target == "l8b":
            l8b_model(a)
        started = start_both(a, target)
    except BaseException as e:
        with open(state + ".failed", "w") as f:
            f.write(f"{type(e).__name__}: {e}"[-3000:])
        raise
    with open(state + ".json", "w") as f:
        json.dump({name: {"url": srv.url, "pid": srv.proc.pid, "log": srv.log_path, "capture_dir": srv.capture_dir,
                          "startup_s": secs} for name, (srv, secs) in started.items()}, f)


def _stop_pids(pids: List[int]) -> None:
    """Stop processes and what they started (servers run in process groups of their own)."""
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p] + p.children(recursive=True)
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=30)


def adopt(a: argparse.Namespace, target: str, wait_s: float = 420) -> Dict[str, Tuple[Server, float]]:
    """Servers ``prestart`` started (waiting for it while it runs), or none; on any failure,
    nothing it started is left running."""
    state = os.path.join(a.work, target, "servers")
    marker = os.path.join(a.work, f"{target}-prestart.running")
    if not os.path.exists(marker):
        return {}
    prestart_pid = int(open(marker).read().strip() or 0)
    deadline = time.monotonic() + wait_s
    while not (os.path.exists(state + ".json") or os.path.exists(state + ".failed")):
        if time.monotonic() > deadline:
            log(f"{target}: the servers started in the background are not up after {wait_s:.0f} s; starting anew")
            _stop_pids([prestart_pid])
            os.unlink(marker)
            return {}
        time.sleep(1)
    os.unlink(marker)
    if os.path.exists(state + ".failed"):
        log(f"{target}: the background start failed ({open(state + '.failed').read()[-300:]}); starting anew")
        return {}
    listed = json.load(open(state + ".json"))
    out = {}
    for name, d in listed.items():
        srv = Server(d["url"], Adopted(d["pid"]), d["log"], d["capture_dir"])  # type: ignore[arg-type]
        try:
            healthy = requests.get(srv.url + "/health", timeout=10).status_code == 200
        except requests.RequestException:
            healthy = False
        if not healthy:
            log(f"{target}: the background {name} server does not answer; starting anew")
            _stop_pids([int(x["pid"]) for x in listed.values()])
            return {}
        out[name] = (srv, float(d["startup_s"]))
    log(f"{target}: adopted the servers started in the background")
    return out


def writer_stats(capture_dir: str) -> Dict[str, float]:
    """The running server's writer counters (its stats file in CAPTURE_DIR/.index/), summed."""
    out: Dict[str, float] = {}
    for path in glob.glob(os.path.join(capture_dir, ".index", "_writer-*.json")):
        try:
            doc = json.load(open(path))
        except (OSError, ValueError):
            continue
        for k, v in doc.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return out


def stats_delta(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    keys = ("written", "bytes", "raw_bytes", "queue_wait_s", "assemble_s", "encode_write_s", "fsync_publish_s",
            "max_queue", "back_pressure_waits", "peak_held_bytes")
    return {k: round(after[k] - before.get(k, 0), 2) if k not in ("max_queue", "peak_held_bytes") else after[k]
            for k in keys if k in after}


def spy_pass(a: argparse.Namespace, target: str, ours: Server, concurrency: int, res: Dict) -> Dict:
    """An extract pass sampled by py-spy (raw stacks, every sample: wall time) in the scheduler,
    one writer process and the client, from its first file on (before it, extract is starting up);
    the raw files go to WORK/pyspy."""
    import e2e_probes

    spydir = os.path.join(a.work, "pyspy")
    os.makedirs(spydir, exist_ok=True)
    out = os.path.join(a.work, target, "ours-spy")
    shutil.rmtree(out, ignore_errors=True)
    writers = [p.pid for p in psutil.Process(ours.proc.pid).children(recursive=True)
               if "sglang_capture.writer.process" in " ".join(p.cmdline())]
    threads: List[threading.Thread] = []

    def record(client: subprocess.Popen) -> None:
        threads.append(e2e_probes.py_spy_window(ours, f"{target}-scheduler", a.spy_s, spydir, res))
        threads.append(e2e_probes.py_spy_window(ours, f"{target}-http", a.spy_s, spydir, res, http=True))
        if not shutil.which("py-spy"):
            return
        for name, pid in (("writer", writers[0] if writers else None), ("client", client.pid)):
            if pid is not None:
                subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(int(a.spy_s)), "--rate", "100",
                                  "--nonblocking", "--threads", "--idle", "--format", "raw", "-o",
                                  os.path.join(spydir, f"{target}-{name}.all.txt")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    rss = PeakRss([])
    e = _extract(a, ours, out, "bf16", rss, concurrency=concurrency, on_first_file=record)
    rss.stop()
    for t in threads:
        t.join(timeout=a.spy_s + 60)
    shutil.rmtree(out, ignore_errors=True)
    return {**e, "writer_processes": len(writers)}


def servers(a: argparse.Namespace, target: str, gpu: GpuBusy) -> None:
    """The ceiling and our extract (bf16, fp8) on two servers started side by side."""
    work = os.path.join(a.work, target)
    draft = draft_config(a, target)
    capture_dir = os.path.join(work, "capture-server")
    started: Dict[str, Tuple[Server, float]] = {}
    samples = encoded(a, target)
    res: Dict = {"draft_config": json.load(open(draft))["eagle_config"]}
    try:
        started.update(adopt(a, target) or start_both(a, target))
        for name, (server, secs) in started.items():
            res[f"{name}_startup_s"] = round(secs, 1)
        time.sleep(3)
        plain, ours = started["plain"][0], started["ours"][0]
        for conc in a.sweep:
            rss = PeakRss([plain.proc.pid])
            t0 = time.monotonic()
            c = _ceiling(plain, samples, conc)
            t1 = time.monotonic()
            res[f"ceiling@{conc}"] = {**c, "tok_per_s": round(c["tokens"] / c["seconds"]), "samples": len(samples),
                                      "peak_rss_gb": round(rss.stop() / 1e9, 2), "gpu_busy": gpu.share(t0, t1)}
            log(f"{target} ceiling at concurrency {conc}: {res[f'ceiling@{conc}']['tok_per_s']:,} tok/s")
        # the table's ceiling: the best the plain server did at any concurrency
        res["ceiling"] = max((res[f"ceiling@{c}"] for c in a.sweep), key=lambda r: r["tok_per_s"])
        save(a, f"{target}-servers", res)
        for conc in a.sweep:
            for dtype in ("bf16", "fp8"):
                time.sleep(2)
                out = os.path.join(work, f"ours-{dtype}-c{conc}")
                shutil.rmtree(out, ignore_errors=True)
                rss = PeakRss([ours.proc.pid])
                stats0 = writer_stats(capture_dir)
                t0 = time.monotonic()
                e = _extract(a, ours, out, dtype, rss, concurrency=conc)
                t1 = time.monotonic()
                r = {**e, "concurrency": conc, "tok_per_s": round(e["tokens"] / e["seconds"]),
                     "bytes": du(out, "*.capture.msgpack") + du(out, ".blocks/*/*.block.msgpack"),
                     "peak_rss_gb": round(rss.stop() / 1e9, 2),
                     "gpu_busy": gpu.share(t0, t1), "writers": stats_delta(stats0, writer_stats(capture_dir)),
                     "of_ceiling": round(e["tokens"] / e["seconds"] / res["ceiling"]["tok_per_s"], 3)}
                res[f"{dtype}@{conc}"] = r
                best = res.get(dtype)
                if best is None or r["tok_per_s"] > best["tok_per_s"]:
                    res[dtype] = r  # the table's row: our best setting, as a user would pick it
                # SmolLM2's best files are verified and exported for the rows; the 8B's would fill the disk
                drop = out if target != "smol" or res[dtype] is not r else (best or {}).get("dir")
                r["dir"] = out
                if drop:
                    shutil.rmtree(drop, ignore_errors=True)
                log(f"{target} ours {dtype} at concurrency {conc}: {e['summary']} (GPU busy {r['gpu_busy']}, "
                    f"writers {json.dumps(r['writers'])})")
                save(a, f"{target}-servers", res)
        if a.spy_s > 0:  # a pass not in the table: py-spy on the scheduler, one writer and extract's client
            res["spy_pass"] = spy_pass(a, target, ours, max(a.sweep), res)
            save(a, f"{target}-servers", res)
    finally:
        for server, _ in started.values():
            stop_server(server)
    for dtype in ("bf16", "fp8"):
        if target == "smol" and dtype in res:
            out = res[dtype]["dir"]
            res[dtype]["verify"] = _cli("verify", out, "--no-progress").strip().splitlines()[-1]
            _cli("export", "--format", "specforge", out, os.path.join(work, f"ckpt-{dtype}"), "--no-progress")
        if dtype in res:
            shutil.rmtree(res[dtype]["dir"], ignore_errors=True)
    shutil.rmtree(capture_dir, ignore_errors=True)
    save(a, f"{target}-servers", res)


# ---------------------------------------------------------------- SpecForge's script


def specforge_commit(a: argparse.Namespace) -> str:
    path = os.path.join(a.specforge, "COMMIT")
    return open(path).read().strip() if os.path.exists(path) else "unknown (no COMMIT file in the checkout)"


def sf_files(out: str) -> List[str]:
    return sorted(glob.glob(os.path.join(out, "rows_*", "data_*.ckpt*")), key=lambda p: int(re.search(r"data_(\d+)", p).group(1)))


def _sf_index(path: str) -> int:
    return int(re.search(r"data_(\d+)", path).group(1))


def specforge(a: argparse.Namespace, target: str, batch: int, compress: bool, gpu: GpuBusy) -> None:
    work = os.path.join(a.work, target)
    name = f"sf-{batch}" + ("-gz" if compress else "")
    out, cache = os.path.join(work, name), os.path.join(work, "sf-cache")
    for d in (out, cache, os.path.join(a.specforge, "cache")):  # cold: no dataset cache from a run before
        shutil.rmtree(d, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           os.path.join(a.specforge, "scripts", "prepare_hidden_states.py"), "--strategy", "eagle3",
           "--target-model-path", model_dir(a, target), "--draft-model-config", draft_config(a, target),
           "--data-path", conv_path(a), "--output-path", out, "--cache-dir", cache, "--chat-template", "qwen",
           "--max-length", "2048", "--tp-size", "1", "--batch-size", str(batch),
           "--sglang-attention-backend", "triton"] + (["--compress"] if compress else []) \
        + (["--num-samples", str(a.sf_samples[target])] if target in a.sf_samples else [])
    env = dict(os.environ, PYTHONPATH=a.specforge_site, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")  # unbuffered: the marks below are timed as lines arrive
    logf = open(os.path.join(work, f"{name}.log"), "w", buffering=1)  # whole lines, also when the watchdog ends us
    marks: Dict[str, float] = {}
    batches = 0

    def mark(text: str, now: float) -> None:
        nonlocal batches
        # The model is built (weights loaded, KV pool made) before the dataset is read: the first
        # dataset line ends the start-up. Then the loop's bar appears, and its first update ends
        # the first batch, which carries the triton kernels' compilation.
        if "model" not in marks and re.search(r"Generating train split|Loading/building dataset|dataset is cached"
                                              r"|Map \(num_proc", text):
            marks["model"] = now
        if "Generating Hidden States" in text:
            marks.setdefault("loop", now)
            m = re.search(r"\|\s*\d+/(\d+) \[", text)
            batches = int(m.group(1)) if m else batches
            if "processed=" in text:
                marks.setdefault("first_batch", now)

    t0, wall0 = time.monotonic(), time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=work,
                            start_new_session=True)
    rss = PeakRss([proc.pid])
    buf = b""
    for chunk in iter(lambda: proc.stdout.read1(65536), b""):
        buf += chunk
        *lines, buf = re.split(rb"[\r\n]", buf)
        for raw in lines:
            line = raw.decode(errors="replace")
            if not line.strip():
                continue
            now = time.monotonic() - t0
            logf.write(f"{now:8.2f} {line}\n")
            mark(line, now)
        # tqdm ends a status with no line break: the next one completes it, so the tail is read now
        mark(buf.decode(errors="replace"), time.monotonic() - t0)
    rc = proc.wait()
    seconds = time.monotonic() - t0
    peak = rss.stop()
    logf.close()
    files = sf_files(out)
    # the stage ends when the last file is on disk, not when the process has torn down
    end = max((os.path.getmtime(p) for p in files), default=wall0 + seconds) - wall0
    start = marks.get("model", 0.0)
    res = {"commit": specforge_commit(a), "batch": batch, "compress": compress, "rc": rc, "seconds": round(seconds, 1),
           "last_file_s": round(end, 1), "startup_s": round(marks.get("model", float("nan")), 1),
           "loop_start_s": round(marks.get("loop", float("nan")), 1),
           "first_batch_s": round(marks.get("first_batch", float("nan")) - marks.get("loop", float("nan")), 1),
           "batches": batches, "given": a.sf_samples.get(target) or sum(1 for _ in open(conv_path(a))), "written": len(files),
           "bytes": sum(os.path.getsize(p) for p in files), "peak_rss_gb": round(peak / 1e9, 2),
           "gpu_busy_stage": gpu.share(t0 + start, t0 + end),
           "gpu_busy_after_first_batch": gpu.share(t0 + marks.get("first_batch", start), t0 + end)}
    if rc != 0:
        save(a, f"{target}-{name}", res)
        raise SystemExit(f"SpecForge {name} exited with {rc}: see {logf.name}")
    lengths = _sf_lengths(a, target, out, batch, compress)
    real = sum(lengths[_sf_index(p)][0] for p in files)
    padded = sum(lengths[_sf_index(p)][1] for p in files)
    stage_s = end - start
    after_first = end - marks.get("first_batch", start)
    res.update(real_tokens=real, padded_tokens=padded, padding_share=round(1 - real / padded, 3),
               stage_s=round(stage_s, 1), tok_per_s=round(real / stage_s), tok_per_s_with_startup=round(real / end),
               # the batches after the first (their share of the real tokens, by count): kernels compiled
               tok_per_s_after_first_batch=round(real * (1 - 1 / max(batches, 1)) / after_first) if after_first > 0 else None)
    if not compress:
        res["check"] = _sf_check(a, target, out, files)
    log(f"{target} SpecForge {name}: {res['written']}/{res['given']} samples, {real:,} real tokens "
        f"({res['padding_share']:.0%} padding), {res['tok_per_s']:,} tok/s after a {res['startup_s']} s start-up "
        f"(first batch {res['first_batch_s']} s; {res['tok_per_s_after_first_batch']} tok/s after it)")
    if not (target == "smol" and name == f"sf-{a.rows_batch}"):  # those are kept for the rows
        shutil.rmtree(out, ignore_errors=True)
    save(a, f"{target}-{name}", res)


def _sf_lengths(a: argparse.Namespace, target: str, out: str, batch: int, compress: bool) -> Dict[int, Tuple[int, int]]:
    """Per file index: (real tokens, stored tokens). A ``--compress`` run's come from the run at the
    same batch size (same shuffle seed, same order), kept in WORK/TARGET/sf-B.lengths.json."""
    import torch

    path = os.path.join(a.work, target, f"sf-{batch}.lengths.json")
    if compress:
        return {int(k): tuple(v) for k, v in json.load(open(path)).items()}
    lengths = {}
    for p in sf_files(out):
        ids = torch.load(p, weights_only=True, mmap=True)["input_ids"].view(-1)
        nz = torch.nonzero(ids).view(-1)
        lengths[_sf_index(p)] = (int(nz[-1]) + 1 if nz.numel() else 0, ids.numel())
    json.dump(lengths, open(path, "w"))
    return lengths


def _sf_check(a: argparse.Namespace, target: str, out: str, files: List[str]) -> Dict:
    """Their ids and masks against the package's templating of the same conversations."""
    import torch

    ours = {tuple(ids): (sid, mask) for sid, ids, mask in encoded(a, target)}
    ids_equal, mask_equal, unmatched, diff_examples = 0, 0, 0, []
    only_theirs = only_ours = 0
    for p in files:
        s = torch.load(p, weights_only=True, mmap=True)
        ids = s["input_ids"].view(-1)
        nz = torch.nonzero(ids).view(-1)
        real = ids[:int(nz[-1]) + 1].tolist() if nz.numel() else []
        hit = ours.get(tuple(real))
        if hit is None:
            unmatched += 1
            continue
        ids_equal += 1
        theirs = s["loss_mask"].view(-1)[:len(real)].tolist()
        if theirs == list(hit[1]):
            mask_equal += 1
            continue
        d_theirs = [i for i, (x, y) in enumerate(zip(theirs, hit[1])) if x and not y]
        d_ours = [i for i, (x, y) in enumerate(zip(theirs, hit[1])) if y and not x]
        only_theirs += len(d_theirs)
        only_ours += len(d_ours)
        if len(diff_examples) < 5:
            diff_examples.append({"id": hit[0], "only_theirs": [(i, real[i]) for i in d_theirs[:6]],
                                  "only_ours": [(i, real[i]) for i in d_ours[:6]]})
    return {"files": len(files), "ids_equal": ids_equal, "ids_unmatched": unmatched, "loss_mask_equal": mask_equal,
            "mask_tokens_only_theirs": only_theirs, "mask_tokens_only_ours": only_ours, "mask_diff_examples": diff_examples}


# ---------------------------------------------------------------- rows


def rows(a: argparse.Namespace) -> None:
    """SmolLM2: every SpecForge sample against our export of the same conversation."""
    import torch

    work = os.path.join(a.work, "smol")
    theirs = sf_files(os.path.join(work, f"sf-{a.rows_batch}"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res: Dict = {"specforge_run": f"sf-{a.rows_batch}", "samples": len(theirs)}
    for dtype in ("bf16", "fp8"):
        ours = {}
        for p in glob.glob(os.path.join(work, f"ckpt-{dtype}", "*.ckpt")):
            s = torch.load(p, weights_only=True, mmap=True)
            ours[tuple(s["input_ids"].tolist())] = p
        cols: Dict[str, List[torch.Tensor]] = {}
        worst: List[Dict] = []
        matched = 0
        for p in theirs:
            t = torch.load(p, weights_only=True)
            ids = t["input_ids"].view(-1)
            nz = torch.nonzero(ids).view(-1)
            n = int(nz[-1]) + 1
            q = ours.get(tuple(ids[:n].tolist()))
            if q is None:
                continue
            matched += 1
            o = torch.load(q, weights_only=True)
            h = o["hidden_state"].shape[-1]
            pairs = {f"aux{k}": (t["aux_hidden_state"][0, :n, k * h:(k + 1) * h], o["aux_hidden_state"][0, :, k * h:(k + 1) * h])
                     for k in range(o["aux_hidden_state"].shape[-1] // h)}
            pairs["final"] = (t["hidden_state"][0, :n], o["hidden_state"][0])
            for col, (x, y) in pairs.items():
                x, y = x.to(dev, torch.float32), y.to(dev, torch.float32)
                cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
                top = torch.maximum(x.abs(), y.abs()).topk(4, dim=-1).indices
                keep = torch.ones_like(x).scatter_(-1, top, 0.0)
                cos4 = torch.nn.functional.cosine_similarity(x * keep, y * keep, dim=-1)
                cols.setdefault(col, []).append(cos.cpu())
                cols.setdefault(col + "-top4", []).append(cos4.cpu())
                for r in torch.nonzero(torch.minimum(cos, cos4) < 0.99).view(-1).tolist()[:3]:
                    if len(worst) < 20:
                        d = (x[r] - y[r]).abs()
                        worst.append({"file": os.path.basename(p), "col": col, "pos": r, "of": n, "token": int(ids[r]),
                                      "cos": round(float(cos[r]), 5), "cos_top4": round(float(cos4[r]), 5),
                                      "channels": d.topk(4).indices.tolist(),
                                      "theirs": [round(float(x[r, c]), 3) for c in d.topk(4).indices.tolist()],
                                      "ours": [round(float(y[r, c]), 3) for c in d.topk(4).indices.tolist()]})
        stats = {}
        for col, xs in cols.items():
            v = torch.cat(xs)
            stats[col] = {"rows": v.numel(), "min": round(float(v.min()), 5), "p0.1": round(float(torch.quantile(v, 0.001)), 5),
                          "below_0.99": int((v < 0.99).sum())}
        res[dtype] = {"matched": matched, "columns": stats, "below_0.99_examples": worst}
        log(f"rows {dtype}: {matched} samples; " + ", ".join(f"{c} p0.1 {s['p0.1']}" for c, s in stats.items()))
    save(a, "smol-rows", res)
    shutil.rmtree(os.path.join(work, f"sf-{a.rows_batch}"), ignore_errors=True)


# ---------------------------------------------------------------- plumbing


def du(path: str, pattern: str) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(path, pattern)))


def save(a: argparse.Namespace, name: str, info: Dict) -> None:
    os.makedirs(os.path.join(a.work, "results"), exist_ok=True)
    with open(os.path.join(a.work, "results", f"{name}.json"), "w") as f:
        json.dump(info, f, indent=1)


def result(a: argparse.Namespace, name: str) -> Optional[Dict]:
    path = os.path.join(a.work, "results", f"{name}.json")
    return json.load(open(path)) if os.path.exists(path) else None


def best_batch(a: argparse.Namespace, target: str) -> int:
    runs = {f"{target}-sf-{b}": result(a, f"{target}-sf-{b}") or {} for b in vs_specforge_report.BATCHES}
    return vs_specforge_report.best_batch(runs, target)


def plan(a: argparse.Namespace) -> List[Tuple[str, int, Callable[[GpuBusy], None]]]:
    """(result name, seconds it may take, what runs it), in order: the batch size SpecForge
    defaults to first; ``--compress`` on SmolLM2 only (real weights give real ratios; on the
    random 8B it would spend device time on gzip of noise)."""
    steps: List[Tuple[str, int, Callable[[GpuBusy], None]]] = [
        ("conversations", 60, lambda g: wait_for(a, "conversations", 400) or conversations(a))]
    for target in sorted(a.targets, key=lambda t: t != "l8b"):  # the 8B first: its bars decide
        est = {"smol": (200, 100), "l8b": (330, 240)}[target]  # the 8B: 45 s vocab mapping, 70 s first batch
        if target == "l8b":
            steps.append(("l8b-model", 30, lambda g: l8b_model(a)))
        steps.append((f"{target}-servers", est[0], lambda g, t=target: servers(a, t, g)))
        for b in SF_ORDER:
            steps.append((f"{target}-sf-{b}", est[1], lambda g, t=target, b=b: specforge(a, t, b, False, g)))
        if target == "smol":
            steps.append(("smol-sf-gz", est[1], lambda g: specforge(a, "smol", best_batch(a, "smol"), True, g)))
            steps.append(("smol-rows", 90, lambda g: rows(a)))
    return steps


def wait_for(a: argparse.Namespace, name: str, seconds: float) -> bool:
    """True once WORK/results/NAME.json exists, if a background stage (WORK/NAME.running) makes it."""
    if not os.path.exists(os.path.join(a.work, f"{name}.running")):
        return False
    for _ in range(int(seconds)):
        if result(a, name) is not None:
            return True
        time.sleep(1)
    raise SystemExit(f"{name} (in the background) has not finished after {seconds:.0f} s: see {a.work}/{name}.log")


def done(a: argparse.Namespace, name: str) -> bool:
    if name == "smol-sf-gz":
        return result(a, f"smol-sf-{best_batch(a, 'smol')}-gz") is not None
    return result(a, name) is not None


def _abort() -> None:
    """The deadline passed inside a stage: end this process tree at once (the results of finished
    stages are saved; the device script packs them), before the call's own limit kills everything."""
    log("deadline passed inside a stage: stopping it; call again to redo it")
    me = psutil.Process()
    for p in me.children(recursive=True):
        try:
            p.kill()
        except psutil.Error:
            pass
    os._exit(4)


def run(a: argparse.Namespace) -> int:
    gpu, t0 = GpuBusy(), time.monotonic()
    watchdog = threading.Timer(a.deadline_s + 25, _abort)
    watchdog.daemon = True
    watchdog.start()
    steps = plan(a)
    unknown = a.stages - {name for name, _, _ in steps}
    if unknown:
        raise SystemExit(f"--stages: no stage {', '.join(sorted(unknown))} in the plan for --targets "
                         f"{','.join(a.targets)}: {', '.join(name for name, _, _ in steps)}")
    for name, est, fn in steps:
        if done(a, name) or (a.stages and name not in a.stages):
            continue
        target = name.split("-")[0]
        if name.endswith("-servers") and os.path.exists(os.path.join(a.work, f"{target}-prestart.running")) \
                and os.path.exists(os.path.join(a.work, target, "servers.json")):
            est = 200  # started in the background: the measurements only
        left = a.deadline_s - (time.monotonic() - t0)
        if left < est:
            log(f"stopping before {name} (may take {est} s, {left:.0f} s left): call again to go on")
            return 3
        log(f"-- {name}")
        fn(gpu)
    log("all stages done")
    report(a)
    return 0


def report(a: argparse.Namespace) -> None:
    """The table (printed, and WORK/results/report.md) and the run's merged record beside it (vs_specforge_report.py)."""
    print(vs_specforge_report.write_report(os.path.join(a.work, "results"), a.targets, a.device,
                                           datetime.date.today().isoformat(), a.tree))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", help="run, report, l8b-weights, conversations, l8b-prestart (background), or a stage of the plan")
    ap.add_argument("--work", default="/tmp/vs")
    ap.add_argument("--prompts", default="prompts-train.jsonl", help="bench/drafter_data.py's training prompts")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--answer-tokens", type=int, default=384)
    ap.add_argument("--sf-samples", default="l8b:1000", help="TARGET:N gives SpecForge the first N conversations "
                    "(its padded, uncompressed 8B files for all 2,000 do not fit the H200's 64 GB disk beside the weights)")
    ap.add_argument("--sweep", default="64,256", help="requests in flight, each measured for the ceiling and extract "
                    "(both tools' best is kept)")
    ap.add_argument("--specforge", default=".specforge", help="SpecForge checkout (scripts/prepare_hidden_states.py)")
    ap.add_argument("--specforge-site", default="/tmp/site-0.5.14", help="PYTHONPATH with SGLang 0.5.14 and specforge")
    ap.add_argument("--targets", default="smol,l8b")
    ap.add_argument("--rows-batch", type=int, default=32, help="the SpecForge run whose files the rows stage reads")
    ap.add_argument("--deadline-s", type=float, default=540)
    ap.add_argument("--stages", type=lambda v: set(v.split(",")), default=set(),
                    help="only these stages of the plan (comma names, e.g. smol-servers: ours and the ceiling); default all")
    ap.add_argument("--spy-s", type=float, default=6, help="py-spy window of an extra extract pass after the sweep (0: none)")
    ap.add_argument("--server-args", default="", help="replaces the servers' flags (a CPU dry run)")
    ap.add_argument("--ours-args", default="", help="launcher flags for our server only (--capture-prefix-sharing off)")
    ap.add_argument("--device", default="h200", help="names the merged record (vs_specforge-DEVICE-DATE.json)")
    ap.add_argument("--tree", default="unknown", help="the commit the wheel was built from, for the merged record")
    a = ap.parse_args()
    a.targets = [t for t in a.targets.split(",") if t]
    a.sweep = [int(c) for c in a.sweep.split(",") if c]
    a.sf_samples = {t: int(n) for t, n in (x.split(":") for x in a.sf_samples.split(",") if x)}
    a.specforge = os.path.abspath(a.specforge)
    a.prompts = os.path.abspath(a.prompts)
    if a.stage == "run":
        return run(a)
    if a.stage == "report":
        report(a)
        return 0
    background = {"l8b-weights": l8b_weights, "conversations": conversations,
                  "l8b-prestart": lambda a: prestart(a, "l8b")}
    if a.stage in background:  # started in the background by an early device call
        os.makedirs(os.path.join(a.work, "l8b"), exist_ok=True)
        with open(os.path.join(a.work, f"{a.stage}.running"), "w") as f:
            f.write(str(os.getpid()))
        background[a.stage](a)
        return 0
    gpu = GpuBusy()
    for name, _, fn in plan(a):
        if name == a.stage:
            fn(gpu)
            return 0
    raise SystemExit(f"unknown stage {a.stage!r}: run, report, l8b-weights or one of "
                     f"{', '.join(n for n, _, _ in plan(a))}")


if __name__ == "__main__":
    sys.exit(main())
