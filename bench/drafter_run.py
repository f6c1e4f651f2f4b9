"""From captures to a served drafter (issue 27): one real model, end to end, on one GPU.

    python bench/drafter_run.py STAGE WORK [options]      (stages in order; each resumes)

Stages (bench/drafter.sh chains them over device calls; WORK keeps every stage's output):

``regen``     serve the target (plain SGLang) and regenerate an answer for each training prompt,
              greedily, as EAGLE-3 data is made: WORK/conversations.jsonl (ShareGPT lines).
``capture``   the package as a user runs it: ``python -m sglang_capture.launch`` on the target
              (default layers), ``sglang-capture extract`` of the conversations in bf16 and again
              with ``--capture-dtype fp8``, ``verify``, ``export --format specforge`` of each:
              WORK/ckpt-bf16, WORK/ckpt-fp8 (+ the exported drafter-config fragment).
``baseline``  the same conversations' features computed as SpecForge's offline path defines them
              (its layer convention), by a transformers forward of the target, one sample at a time
              (bf16; SpecForge batches its forward, so this is a slower baseline), aux = output_hidden_states at the layers
              SGLang will capture for the drafter's ids, last = the post-norm final state; same
              input ids and loss masks as WORK/ckpt-bf16: WORK/ckpt-baseline.
``train``     one SpecForge (0.2.0) run per feature set, the same seed, steps, draft config and
              vocab mapping for all three, side by side on the GPU; then ``specforge export --to
              sglang``: WORK/draft-{bf16,fp8,baseline}.
``serve``     the target served alone and with each drafter (``--speculative-algorithm EAGLE3``) at
              3 steps / top-k 1 / 4 draft tokens and at SGLang's default for Llama; the held-out
              prompts at temperature 0: mean acceptance length (per request, completion tokens /
              ``spec_verify_ct``) and output tok/s. WORK/drafter_results.json.

The flywheel (issue 38, item 4) follows ``train`` of the bf16 draft alone (``--features bf16``):

``flywheel``  the target served through the launcher with that draft (3 / 1 / 4); every training
              prompt sent once at temperature 0 asking for its file (loss on the answer only), so
              the answers come from the target through speculation and the rows of the prompt and
              of every accepted token from its extend and verify passes: WORK/caps-flywheel. Then
              each file's whole token sequence captured prefill-only on a launcher without
              speculation (``capture_prefill``, what ``extract`` sends; the same loss mask):
              WORK/caps-prefill. Rows compared per column (0.1st-percentile cosine, also without each
              row's 4 largest channels), both verified and exported: WORK/ckpt-{flywheel,prefill}.
``flytrain``  ``train`` for the two (same steps, seed, config and vocab mapping as the bf16 draft).
``flyserve``  ``serve`` of the three drafts; bar: flywheel >= 0.97 x prefill at every setting.

Prefix sharing (issue 50): the same data as a dataset with one sample per assistant turn, whose
samples re-send their conversation's history:

``turns``     serve the target (plain SGLang) and answer each chat of ``--chat-prompts`` turn by turn,
              greedily, each turn sent with the chat so far: WORK/turn-samples.jsonl, one ShareGPT line
              per assistant turn (``CHAT-tK``: the chat up to its K-th answer), turn-major, so that
              turn K's rows are stored before turn K+1 asks for them.
``sharecap``  ``extract`` of those samples on a launcher with ``--capture-prefix-sharing on`` and on
              one with it ``off``: WORK/caps-shared, WORK/caps-private; rows stored against the
              samples' unique rows, bytes on disk, every file's rows read through its blocks against the
              private capture's, both verified and exported: WORK/ckpt-{shared,private}. Then ``train``
              and ``serve`` with ``--features private,shared``; bar: shared >= 0.97 x private.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Union

import requests

from sglang_capture.core.names import FILE_SUFFIX
from sglang_capture.testbed.cpu import server_env
from sglang_capture.testbed.once import cache_dir
from sglang_capture.testbed.server import Server, start_server, stop_server

# Several servers share the GPU (serve starts seven side by side). SGLang 0.5.17 sizes a KV pool
# from what is free at its profiling minus (1 - fraction) of what was free before loading, so a
# neighbour loading in between would leave nothing with small fractions: a high fraction and
# --max-total-tokens capping each pool instead (a 135M model's KV: 23 KB per token).
GPU_ARGS = ("--attention-backend triton --grammar-backend none --cuda-graph-max-bs 64 --mem-fraction-static 0.93 "
            "--max-total-tokens 131072")
FEATURES = ("bf16", "fp8", "baseline")
FLY_FEATURES = ("flywheel", "prefill")  # flytrain's runs; flyserve serves them beside the bf16 draft
SHARE_FEATURES = ("private", "shared")  # sharecap's captures, private first: the vocab mapping comes from it
FLY_SETTING = "s3k1d4"  # the flywheel's served setting: chain drafting
SETTINGS = {"s3k1d4": "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4",
            "default": ""}  # SGLang 0.5.17 picks (5, 4, 8) for LlamaForCausalLM by itself


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _read_jsonl(path: str) -> List[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _done(work: str, stage: str) -> bool:
    return os.path.exists(os.path.join(work, f".done-{stage}"))


def _mark(work: str, stage: str, info: Dict) -> None:
    with open(os.path.join(work, f"{stage}.json"), "w") as f:
        json.dump(info, f, indent=2)
    open(os.path.join(work, f".done-{stage}"), "w").close()


def _server(cmd: List[str], work: str, name: str, capture_dir: str = "") -> Server:
    return start_server(cmd, server_env(cache_dir()), os.path.join(work, f"server-{name}.log"), capture_dir)


def _chat_ids(tokenizer, prompt: Union[str, List[Dict[str, str]]]) -> List[int]:
    """The template's ids for a prompt (a first user turn) or a chat so far, ready for the answer."""
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _generate(server: Server, ids: List[int], max_new: int, timeout: float = 600, custom: Optional[dict] = None) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
    if custom is not None:
        body["sampling_params"]["custom_params"] = custom
    r = requests.post(server.url + "/generate", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def regen(a: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = _read_jsonl(a.train_prompts)[:a.samples]
    server = _server([sys.executable, "-m", "sglang.launch_server", "--model-path", a.model, *shlex.split(a.server_args)],
                     a.work, "regen")
    t0, out = time.monotonic(), {}
    try:
        with cf.ThreadPoolExecutor(a.concurrency) as pool:
            futs = {pool.submit(_generate, server, _chat_ids(tok, p["prompt"]), a.answer_tokens): p for p in prompts}
            for fut in cf.as_completed(futs):
                out[futs[fut]["id"]] = fut.result()
    finally:
        stop_server(server)
    seconds = time.monotonic() - t0
    gen_tokens = 0
    with open(os.path.join(a.work, "conversations.jsonl"), "w") as f:
        for p in prompts:
            r = out[p["id"]]
            gen_tokens += r["meta_info"]["completion_tokens"]
            f.write(json.dumps({"id": p["id"], "conversations": [{"from": "human", "value": p["prompt"]},
                                                                 {"from": "gpt", "value": r["text"]}]}) + "\n")
    _mark(a.work, "regen", {"samples": len(prompts), "generated_tokens": gen_tokens, "seconds": round(seconds, 1),
                            "answer_tokens": a.answer_tokens})
    log(f"regen: {len(prompts)} answers, {gen_tokens:,} tokens in {seconds:.0f} s")


def _cli(*args: str) -> str:
    """``sglang-capture ARGS`` as a user runs it; its output, or exit on failure."""
    r = subprocess.run(["sglang-capture", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"sglang-capture {' '.join(args[:2])} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def _extract(url: str, model: str, src: str, caps: str, concurrency: int, *flags: str) -> Dict:
    """``sglang-capture extract`` of ``src`` into ``caps``: its summary line, time, tokens and bytes.
    ``model``'s tokenizer is cached first: the first extract on a machine builds extract's tokenizer
    cache (6-15 s of transformers, tools/tokenizer_cache.py), which r83 and r86 counted against
    whichever of the two compared extracts ran first."""
    from sglang_capture.tools.templating import load_tokenizer

    load_tokenizer(model)
    t0 = time.monotonic()
    out = _cli("extract", src, "--server", url, "--out", caps, "--concurrency", str(concurrency), "--no-progress", *flags)
    seconds = time.monotonic() - t0
    summary = out.strip().splitlines()[-1]
    tokens = int(re.search(r"([\d,]+) tokens", summary).group(1).replace(",", ""))
    return {"extract": summary, "seconds": round(seconds, 1), "tokens": tokens, "tok_per_s": round(tokens / seconds),
            "bytes_on_disk": _du(caps)}


def _verify_export(caps: str, ckpt: str) -> Dict[str, str]:
    """``verify`` of a capture dir and its ``export --format specforge`` into ``ckpt``: their last lines."""
    return {"verify": _cli("verify", caps, "--no-progress").strip().splitlines()[-1],
            "export": _cli("export", "--format", "specforge", caps, ckpt, "--no-progress").strip()}


def capture(a: argparse.Namespace) -> None:
    server_dir = os.path.join(a.work, "capture-server")
    os.makedirs(server_dir, exist_ok=True)
    conv = os.path.join(a.work, "conversations.jsonl")
    server = _server([sys.executable, "-m", "sglang_capture.launch", "--capture-dir", server_dir, "--model-path", a.model,
                      *shlex.split(a.server_args)], a.work, "capture", server_dir)
    info: Dict = {}
    try:
        for dtype in a.capture_dtypes:
            info[dtype] = _extract(server.url, a.model, conv, os.path.join(a.work, f"caps-{dtype}"), a.concurrency,
                                   *(["--capture-dtype", "fp8"] if dtype == "fp8" else []))
            log(f"capture {dtype}: {info[dtype]['extract']}")
    finally:
        stop_server(server)
    for dtype in a.capture_dtypes:
        caps, ckpt = os.path.join(a.work, f"caps-{dtype}"), os.path.join(a.work, f"ckpt-{dtype}")
        info[dtype].update(_verify_export(caps, ckpt))
        log(f"{dtype}: {info[dtype]['verify']}")
    fragment = os.path.join(a.work, "ckpt-bf16", "eagle3_draft_config_fragment.json")
    info["eagle_config"] = json.load(open(fragment))["eagle_config"]
    info["layers"] = _layers_of(os.path.join(a.work, "caps-bf16"))
    _mark(a.work, "capture", info)


def _chat_sample(cid: str, turn: int, history: List[Dict[str, str]]) -> dict:
    """A ShareGPT line: the chat up to and with its ``turn``-th answer."""
    who = {"user": "human", "assistant": "gpt"}
    return {"id": f"{cid}-t{turn}", "conversations": [{"from": who[m["role"]], "value": m["content"]}
                                                      for m in history[:2 * turn]]}


def turns(a: argparse.Namespace) -> None:
    """Each chat answered turn by turn by the target, every turn sent with the chat so far."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    chats = _read_jsonl(a.chat_prompts)[:a.samples] if a.chat_prompts and os.path.exists(a.chat_prompts) else []
    if not chats:
        raise SystemExit(f"turns: no chats in --chat-prompts {a.chat_prompts!r} (bench/drafter.sh carry CHATS=N)")
    history: Dict[str, List[Dict[str, str]]] = {c["id"]: [] for c in chats}
    server = _server([sys.executable, "-m", "sglang.launch_server", "--model-path", a.model, *shlex.split(a.server_args)],
                     a.work, "turns")

    def answer(chat: dict, turn: int) -> int:
        msgs = history[chat["id"]] + [{"role": "user", "content": chat["prompts"][turn]}]
        r = _generate(server, _chat_ids(tok, msgs), a.answer_tokens)
        history[chat["id"]] = msgs + [{"role": "assistant", "content": r["text"]}]
        return r["meta_info"]["completion_tokens"]

    t0, gen_tokens, most = time.monotonic(), 0, max(len(c["prompts"]) for c in chats)
    try:
        with cf.ThreadPoolExecutor(a.concurrency) as pool:
            for turn in range(most):
                gen_tokens += sum(pool.map(lambda c, t=turn: answer(c, t), [c for c in chats if len(c["prompts"]) > turn]))
    finally:
        stop_server(server)
    seconds = time.monotonic() - t0
    n = 0
    with open(os.path.join(a.work, "turn-samples.jsonl"), "w") as f:
        for turn in range(1, most + 1):
            for c in chats:
                if len(history[c["id"]]) >= 2 * turn:
                    f.write(json.dumps(_chat_sample(c["id"], turn, history[c["id"]])) + "\n")
                    n += 1
    _mark(a.work, "turns", {"chats": len(chats), "samples": n, "generated_tokens": gen_tokens,
                            "seconds": round(seconds, 1), "answer_tokens": a.answer_tokens})
    log(f"turns: {len(chats)} chats, {n} samples, {gen_tokens:,} tokens generated in {seconds:.0f} s")


def stored_rows(caps: str) -> Dict[str, int]:
    """Rows a capture dir stores (its blocks' rows, each block once, and the rows files hold themselves)
    against its samples' unique rows (distinct token prefixes: a row is its token and all before it)."""
    import sglang_capture
    from sglang_capture.core.blocks import BLOCKS_KEY
    from sglang_capture.core.format import row_count
    from sglang_capture.core.reader import read_meta

    in_blocks = sum(int(m["end"]) - int(m["start"]) for m in
                    (read_meta(p) for p in glob.glob(os.path.join(caps, ".blocks", "*", "*.block.msgpack"))))
    in_files, nodes = 0, {}
    for path in sorted(glob.glob(os.path.join(caps, "*" + FILE_SUFFIX))):
        d = sglang_capture.load(path, tensors=("input_ids", "output_ids"))
        meta = d["meta"]
        n = row_count(int(meta["num_prompt_tokens"]), int(meta["num_output_tokens"]))
        if meta.get(BLOCKS_KEY) is None:  # a self-contained file (sharing off): its rows are its own
            in_files += n
        node = 0
        for t in (d["input_ids"].tolist() + d["output_ids"].tolist())[:n]:
            node = nodes.setdefault((node, t), len(nodes) + 1)
    return {"rows_in_blocks": in_blocks, "rows_in_files": in_files, "unique_rows": len(nodes),
            "stored_per_unique": round((in_blocks + in_files) / max(len(nodes), 1), 4)}


def sharecap(a: argparse.Namespace) -> None:
    """The turn samples extracted with prefix sharing on and off; storage, rows and exports."""
    samples = os.path.join(a.work, "turn-samples.jsonl")
    info: Dict = {}
    for feature, flags in (("shared", ["--capture-prefix-sharing", "on"]), ("private", ["--capture-prefix-sharing", "off"])):
        server_dir, caps = os.path.join(a.work, f"capture-server-{feature}"), os.path.join(a.work, f"caps-{feature}")
        for stale in (server_dir, caps, os.path.join(a.work, f"ckpt-{feature}")):
            shutil.rmtree(stale, ignore_errors=True)  # a call cut off before: dedup would count its blocks
        os.makedirs(server_dir)
        server = _server([sys.executable, "-m", "sglang_capture.launch", "--capture-dir", server_dir, *flags,
                          "--model-path", a.model, *shlex.split(a.server_args)], a.work, f"sharecap-{feature}", server_dir)
        try:
            info[feature] = _extract(server.url, a.model, samples, caps, a.concurrency)
        finally:
            stop_server(server)
        info[feature].update(stored_rows(caps))
        log(f"sharecap {feature}: {json.dumps(info[feature])}")
    shared, private = (os.path.join(a.work, f"caps-{f}") for f in ("shared", "private"))
    names = sorted(os.path.basename(p)[:-len(FILE_SUFFIX)] for p in glob.glob(os.path.join(private, "*" + FILE_SUFFIX)))
    info["bytes_shared_per_private"] = round(info["shared"]["bytes_on_disk"] / max(info["private"]["bytes_on_disk"], 1), 4)
    info["rows"] = _compare_rows(shared, private, names, "shared", "private")
    log(f"{'PASS' if info['rows']['pass'] else 'FAIL'} rows through shared blocks against private captures (bar "
        f"{info['rows']['bar']}): {json.dumps(info['rows'])}")
    for feature, caps in (("shared", shared), ("private", private)):
        info[feature].update(_verify_export(caps, os.path.join(a.work, f"ckpt-{feature}")))
        log(f"{feature}: {info[feature]['verify']}")
    _mark(a.work, "sharecap", info)


def _du(path: str) -> int:
    """Bytes of a capture dir's files and of its shared blocks, each counted once."""
    files = [*glob.glob(os.path.join(path, "*")), *glob.glob(os.path.join(path, ".blocks", "*", "*.block.msgpack"))]
    return sum(os.path.getsize(p) for p in files if os.path.isfile(p))


def _layers_of(caps: str) -> List[int]:
    import sglang_capture

    first = sorted(glob.glob(os.path.join(caps, "*.capture.msgpack")))[0]
    return list(sglang_capture.load(first, tensors=())["layers"])


def baseline(a: argparse.Namespace) -> None:
    """SpecForge's offline features: transformers' hidden states of the same token ids."""
    import torch
    from transformers import AutoModelForCausalLM

    layers = json.load(open(os.path.join(a.work, "capture.json")))["layers"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to(device).eval()
    src, dst = os.path.join(a.work, "ckpt-bf16"), os.path.join(a.work, "ckpt-baseline")
    os.makedirs(dst, exist_ok=True)
    files = sorted(glob.glob(os.path.join(src, "*.ckpt")))
    tokens, t0, forward_s = 0, time.monotonic(), 0.0
    for path in files:
        s = torch.load(path, weights_only=True)
        ids = s["input_ids"]
        f0 = time.monotonic()
        with torch.no_grad():
            hs = model(ids[None].to(device), output_hidden_states=True).hidden_states
            aux = torch.cat([hs[i][0] for i in layers], dim=-1).to(torch.bfloat16).cpu()
            last = hs[-1][0].to(torch.bfloat16).cpu()  # .cpu() waits for the forward
        forward_s += time.monotonic() - f0
        sample = {"input_ids": ids, "loss_mask": s["loss_mask"], "hidden_state": last[None].contiguous(),
                  "aux_hidden_state": aux[None].contiguous()}
        torch.save(sample, os.path.join(dst, os.path.basename(path)))
        tokens += ids.numel()
    seconds = time.monotonic() - t0
    _mark(a.work, "baseline", {"samples": len(files), "tokens": tokens, "seconds": round(seconds, 1),
                               "tok_per_s": round(tokens / seconds), "forward_only_tok_per_s": round(tokens / forward_s),
                               "layers": layers})
    log(f"baseline: {len(files)} samples, {tokens:,} tokens, {tokens / seconds:,.0f} tok/s with writing")


def _draft_config(a: argparse.Namespace, eagle_config: Dict) -> Dict:
    """An EAGLE-3 draft (one Llama decoder layer) for the target's shapes, with the ids the
    capture's export wrote, so that SGLang serving it captures the layers the files hold."""
    t = json.load(open(os.path.join(a.model, "config.json")))
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": t["hidden_size"],
            "target_hidden_size": t["hidden_size"], "num_hidden_layers": 1,
            "num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"],
            "head_dim": t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
            "intermediate_size": t["intermediate_size"], "hidden_act": t.get("hidden_act", "silu"),
            "max_position_embeddings": t["max_position_embeddings"], "rms_norm_eps": t["rms_norm_eps"],
            "rope_theta": t.get("rope_theta") or (t.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            "rope_scaling": None, "vocab_size": t["vocab_size"], "draft_vocab_size": a.draft_vocab,
            "pad_token_id": t.get("pad_token_id"), "bos_token_id": t.get("bos_token_id"),
            "eos_token_id": t.get("eos_token_id"), "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "eagle_config": {**eagle_config, "use_aux_hidden_state": True}}


def _target_view(model: str, view: str) -> str:
    """SpecForge's TargetHead reads lm_head through an ``*.index.json``; a tied single-file
    checkpoint has neither: a folder of links plus an index naming every tensor's file."""
    import struct

    os.makedirs(view, exist_ok=True)
    st = os.path.join(model, "model.safetensors")
    with open(st, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    for name in os.listdir(model):
        if not os.path.lexists(os.path.join(view, name)):
            os.symlink(os.path.join(model, name), os.path.join(view, name))
    with open(os.path.join(view, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: "model.safetensors" for k in header if k != "__metadata__"}}, f)
    return view


def _run_config(a: argparse.Namespace, feature: str, steps: int, view: str, log_interval: int = 50) -> str:
    import yaml

    cfg = {"run_id": f"draft-{feature}", "output_dir": os.path.join(a.work, f"train-{feature}"),
           "model": {"target_model_path": view, "draft_model_config": os.path.join(a.work, "draft_config.json"),
                     "lm_head_key": "model.embed_tokens.weight", "embedding_key": "model.embed_tokens.weight",
                     "vocab_mapping_path": os.path.join(a.work, "vocab_mapping.pt"), "torch_dtype": "bfloat16"},
           "data": {"hidden_states_path": os.path.join(a.work, f"ckpt-{feature}"), "max_length": a.max_length,
                    "dataloader_num_workers": 2, "cache_dir": os.path.join(a.work, f"cache-{feature}")},
           "training": {"strategy": "eagle3", "attention_backend": a.attention_backend, "num_epochs": a.epochs,
                        "max_steps": steps, "batch_size": 1, "accumulation_steps": 1, "learning_rate": a.lr,
                        "ttt_length": 7, "seed": 42, "log_interval": log_interval, "save_interval": 0,
                        "fsdp_sharding": "NO_SHARD"}}
    path = os.path.join(a.work, f"run-{feature}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _train_proc(a: argparse.Namespace, feature: str, steps: int, view: str) -> subprocess.Popen:
    config = _run_config(a, feature, steps, view)
    logf = open(os.path.join(a.work, f"train-{feature}.log"), "w")
    return subprocess.Popen([*shlex.split(a.specforge), "train", "-c", config], stdout=logf, stderr=subprocess.STDOUT)


def _probe(a: argparse.Namespace, view: str) -> Dict:
    """Seconds per training step (and to the first step) of one run, from its step lines. Logged
    every quarter of the probe, as the real runs log rarely: a step line per step costs a device
    sync and made r49's probe read 0.151 s a step against 0.091 s in the runs."""
    config = _run_config(a, a.features[0], a.probe_steps, view, log_interval=max(1, a.probe_steps // 4))
    t0, seen = time.monotonic(), {}
    with open(os.path.join(a.work, f"train-{a.features[0]}-probe.log"), "w") as logf:
        p = subprocess.Popen([*shlex.split(a.specforge), "train", "-c", config], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in p.stdout:
            logf.write(line)
            m = re.match(r"step (\d+):", line)
            if m:
                seen[int(m.group(1))] = time.monotonic() - t0
        rc = p.wait()
    if rc != 0 or len(seen) < 2:
        raise SystemExit(f"probe training failed ({rc}); see {a.work}/train-{a.features[0]}-probe.log")
    first, last = min(seen), max(seen)
    step_s = (seen[last] - seen[first]) / (last - first)
    return {"steps": last, "step_s": round(step_s, 4), "startup_s": round(seen[first] - first * step_s, 1),
            "wall_s": round(time.monotonic() - t0, 1)}


def train(a: argparse.Namespace) -> None:
    """Time a few steps of one run, size the three runs to ``--train-budget-s`` side by side,
    train them, export each for SGLang."""
    first = os.path.join(a.work, f"ckpt-{a.features[0]}")  # every run's draft config and vocab mapping come from it
    eagle_config = json.load(open(os.path.join(first, "eagle3_draft_config_fragment.json")))["eagle_config"]
    with open(os.path.join(a.work, "draft_config.json"), "w") as f:
        json.dump(_draft_config(a, eagle_config), f, indent=2)
    view = _target_view(a.model, os.path.join(a.work, "target-view"))
    vocab = os.path.join(a.work, "vocab_mapping.pt")
    if not os.path.exists(vocab):  # one mapping for all the runs, from the loss-masked tokens
        import torch
        from specforge.data.preprocessing import process_token_dict_to_mappings
        from specforge.training.vocab_mapping import count_effective_feature_tokens

        t = json.load(open(os.path.join(a.model, "config.json")))
        counts = count_effective_feature_tokens(first, max_length=a.max_length,
                                                target_vocab_size=t["vocab_size"])
        d2t, t2d = process_token_dict_to_mappings(counts, a.draft_vocab, t["vocab_size"])
        torch.save({"d2t": d2t, "t2d": t2d}, vocab)
    samples = len(glob.glob(os.path.join(a.work, f"ckpt-{a.features[0]}", "*.ckpt")))
    steps = a.train_steps
    if a.stage == "flytrain" and steps <= 0:  # the flywheel's drafts train as long as the draft that served
        steps = json.load(open(os.path.join(a.work, "train.json")))["steps"]
    probe = {}
    if steps <= 0:  # size the runs: one run of PROBE steps, each step's line timed as it is printed
        probe = _probe(a, view)
        steps = int((a.train_budget_s - probe["startup_s"]) / (probe["step_s"] * a.parallel_slowdown))
        shutil.rmtree(os.path.join(a.work, f"train-{a.features[0]}"), ignore_errors=True)
    steps = max(1, min(steps, a.epochs * samples))
    log(f"train: {steps} steps per run ({steps / samples:.2f} epochs of {samples} samples); probe {probe}")
    t0 = time.monotonic()
    procs = {f: _train_proc(a, f, steps, view) for f in a.features}
    rcs = {f: p.wait() for f, p in procs.items()}
    seconds = time.monotonic() - t0
    if any(rcs.values()):
        raise SystemExit(f"training failed: {rcs}; see {a.work}/train-*.log")
    exported = {}
    for f in a.features:
        ckpt = os.path.join(a.work, f"train-{f}", f"draft-{f}-latest")
        out = os.path.join(a.work, f"draft-{f}")
        r = subprocess.run([*shlex.split(a.specforge), "export", "--to", "sglang", "--checkpoint", ckpt, "--draft-config",
                            os.path.join(a.work, "draft_config.json"), "--output-dir", out, "--vocab-mapping", vocab],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"specforge export {f} failed:\n{r.stderr[-3000:]}")
        exported[f] = json.load(open(os.path.join(out, "config.json"))).get("eagle_config")
    _mark(a.work, a.stage, {"steps": steps, "features": list(a.features), "samples": samples, "epochs": round(steps / samples, 3),
                            "seconds": round(seconds, 1), "probe": probe, "exported_eagle_config": exported,
                            "train_budget_s": a.train_budget_s, "parallel_slowdown": a.parallel_slowdown,
                            "lr": a.lr, "max_length": a.max_length, "draft_vocab": a.draft_vocab})
    log(f"{a.stage}: {len(procs)} runs of {steps} steps in {seconds:.0f} s; exported {list(exported)}")


def _capture_answer(server: Server, ids: List[int], name: str, max_new: int) -> dict:
    """One training prompt answered through speculation, its file asked for: loss on the answer
    only (an empty prompt mask), as a prefill-only capture of the conversation trains on it."""
    custom = {"capture": True, "capture_name": name, "capture_loss_mask": []}
    meta = _generate(server, ids, max_new, custom=custom)["meta_info"]
    if meta.get("capture", {}).get("status") != "ok":
        raise SystemExit(f"flywheel capture {name}: {meta.get('capture')}")
    return meta


def _rows_tokens(capture: Dict) -> List[int]:
    """The tokens a loaded capture's rows belong to: its prompt, then the outputs fed back."""
    n, prompt = capture["aux_hidden_states"].shape[0], capture["input_ids"].tolist()
    return prompt + capture["output_ids"].tolist()[:max(0, n - len(prompt))]


def _compare_rows(mine_dir: str, ref_dir: str, names: List[str], label: str = "flywheel",
                  ref_label: str = "prefill-only") -> Dict:
    """Each file's rows in ``mine_dir`` against the file of the same name in ``ref_dir``, a capture of
    the same token sequence (prefill-only, or private), per column."""
    from gpu_spec import ColumnCosines  # bench/ is on sys.path: this script lives there

    import sglang_capture

    compared = ColumnCosines()
    for name in names:
        mine = sglang_capture.load(os.path.join(mine_dir, name + FILE_SUFFIX))
        theirs = sglang_capture.load(os.path.join(ref_dir, name + FILE_SUFFIX))
        n = mine["aux_hidden_states"].shape[0]
        seq, ref_seq = _rows_tokens(mine), _rows_tokens(theirs)
        if ref_seq != seq or theirs["aux_hidden_states"].shape[0] != n:
            raise SystemExit(f"{label} {name}: the {ref_label} capture holds {len(ref_seq)} tokens' rows "
                             f"({theirs['aux_hidden_states'].shape[0]} rows), the {label} file {len(seq)} ({n} rows), "
                             "or the tokens differ")
        if list(theirs["layers"]) != list(mine["layers"]):
            raise SystemExit(f"{label} {name}: layers {mine['layers']} against {theirs['layers']} {ref_label}")
        compared.add(mine, theirs, n)
    return compared.result()


def _answer_span(seq: List[int], prompt_len: int) -> List[tuple]:
    """The loss span of a prefill-only capture of ``seq``: its answer's tokens (none when the answer
    was a single token, which has no row)."""
    return [(prompt_len, len(seq))] if len(seq) > prompt_len else []


def flywheel(a: argparse.Namespace) -> None:
    """Round two of the flywheel: the training prompts answered by the target speculating with
    the bf16 draft, captured as they are served; the same sequences captured prefill-only."""
    from transformers import AutoTokenizer

    from sglang_capture.tools.client import capture_prefill, discover

    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = _read_jsonl(a.train_prompts)[:a.samples]
    ids = {p["id"]: _chat_ids(tok, p["prompt"]) for p in prompts}
    fly_dir, pre_dir = os.path.join(a.work, "caps-flywheel"), os.path.join(a.work, "caps-prefill")
    draft = os.path.join(a.work, "draft-bf16")
    for stale in (fly_dir, pre_dir, os.path.join(a.work, "ckpt-flywheel"), os.path.join(a.work, "ckpt-prefill")):
        shutil.rmtree(stale, ignore_errors=True)  # a call cut off before: the writers refuse existing names
    os.makedirs(fly_dir)
    os.makedirs(pre_dir)
    cmd = [sys.executable, "-m", "sglang_capture.launch", "--capture-dir", fly_dir, "--model-path", a.model,
           *shlex.split(a.server_args), "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft,
           *shlex.split(SETTINGS[FLY_SETTING]), *shlex.split(a.spec_backend_args)]
    server = _server(cmd, a.work, "flywheel", fly_dir)
    try:
        warm = list(ids.values())[:a.concurrency]  # first batches compile kernels: not part of the figure
        with cf.ThreadPoolExecutor(a.concurrency) as pool:
            list(pool.map(lambda x: _generate(server, x, 32), warm))
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(a.concurrency) as pool:
            metas = dict(zip(ids, pool.map(lambda k: _capture_answer(server, ids[k], k, a.answer_tokens), ids),
                             strict=True))
        fly_s = time.monotonic() - t0
    finally:
        stop_server(server)
    fly_rows = sum(m["capture"]["rows"] for m in metas.values())
    info: Dict = {"samples": len(metas), "setting": FLY_SETTING, "draft": "draft-bf16",
                  "flywheel": {"seconds": round(fly_s, 1), "rows": fly_rows, "rows_per_s": round(fly_rows / fly_s),
                               "generated_tokens": sum(m["completion_tokens"] for m in metas.values()),
                               **acceptance(list(metas.values()))}}
    log(f"flywheel: {len(metas)} answers captured through speculation, {fly_rows:,} rows in {fly_s:.0f} s; "
        f"{info['flywheel']}")
    import sglang_capture

    sequences = {}
    for name in metas:
        d = sglang_capture.load(os.path.join(fly_dir, name + FILE_SUFFIX), tensors=("input_ids", "output_ids"))
        prompt = d["input_ids"].tolist()
        sequences[name] = (prompt + d["output_ids"].tolist())[:metas[name]["capture"]["rows"]], len(prompt)
    server = _server([sys.executable, "-m", "sglang_capture.launch", "--capture-dir", pre_dir, "--model-path", a.model,
                      "--capture-layers-from-draft", draft, *shlex.split(a.server_args)], a.work, "prefill", pre_dir)
    try:
        info_srv = discover(server.url)
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(a.concurrency) as pool:
            list(pool.map(lambda k: capture_prefill(info_srv, sequences[k][0], k, _answer_span(*sequences[k]), 600),
                          sequences))
        pre_s = time.monotonic() - t0
    finally:
        stop_server(server)
    # the same rows: _compare_rows checks every file's row count against its flywheel file
    info["prefill"] = {"seconds": round(pre_s, 1), "rows": fly_rows, "rows_per_s": round(fly_rows / pre_s)}
    info["rows"] = _compare_rows(fly_dir, pre_dir, sorted(metas))
    log(f"{'PASS' if info['rows']['pass'] else 'FAIL'} flywheel rows against prefill-only (bar "
        f"{info['rows']['bar']}): {json.dumps(info['rows'])}")
    for feature, caps in (("flywheel", fly_dir), ("prefill", pre_dir)):
        ckpt = os.path.join(a.work, f"ckpt-{feature}")
        info[feature].update(_verify_export(caps, ckpt))
        log(f"{feature}: {info[feature]['verify']}")
    _mark(a.work, "flywheel", info)


def _spec_cmd(a: argparse.Namespace, draft: Optional[str], setting: str) -> List[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", a.model, *shlex.split(a.server_args)]
    if draft is not None:
        cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft, *shlex.split(SETTINGS[setting]),
                *shlex.split(a.spec_backend_args)]
    return cmd


def _measure(server: Server, prompts: List[List[int]], max_new: int, concurrency: int) -> Dict:
    """Every prompt once at ``concurrency``: per-request acceptance lengths, output tok/s."""
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda ids: _generate(server, ids, max_new)["meta_info"], prompts))
    seconds = time.monotonic() - t0
    completion = sum(m["completion_tokens"] for m in outs)
    return {"requests": len(outs), "completion_tokens": completion, "seconds": round(seconds, 2),
            "output_tok_per_s": round(completion / seconds, 1), **acceptance(outs)}


def acceptance(metas: List[Dict]) -> Dict:
    """Acceptance lengths from the responses' ``meta_info``: the mean over requests of completion
    tokens / ``spec_verify_ct`` (issue 27's measure), and the token-weighted one ({} without a draft)."""
    verify = [m.get("spec_verify_ct", 0) for m in metas]
    if not any(verify):
        return {}
    per_request = [m["completion_tokens"] / v for m, v in zip(metas, verify, strict=True) if v]
    return {"mean_acceptance_length": round(sum(per_request) / len(per_request), 4),
            "token_weighted_acceptance_length": round(sum(m["completion_tokens"] for m in metas) / sum(verify), 4),
            "verify_steps": sum(verify)}


BARS = {"bf16 / baseline": ("bf16", "baseline", 0.97), "fp8 / bf16": ("fp8", "bf16", 0.97)}
MIN_ACCEPTANCE = ("bf16-s3k1d4", 1.5)
# issue 38, item 4: the draft trained on the flywheel's captures against the one trained on
# prefill-only captures of the same token sequences
FLY_BARS = {"flywheel / prefill": ("flywheel", "prefill", 0.97)}
# issue 50: the draft trained on files whose rows lie in shared blocks against one trained on private captures
SHARE_BARS = {"shared / private": ("shared", "private", 0.97)}


def bars_for(stage: str, features: tuple) -> tuple:
    """(bars, minimum) for ``verdicts``: the flywheel's, prefix sharing's (``--features private,shared``)
    or issue 27's."""
    if stage == "flyserve":
        return FLY_BARS, None
    if set(features) == set(SHARE_FEATURES):
        return SHARE_BARS, None
    return BARS, MIN_ACCEPTANCE


def verdicts(configs: Dict[str, Dict], bars: Dict[str, tuple] = BARS,
             minimum: Optional[tuple] = MIN_ACCEPTANCE) -> Dict[str, Dict]:
    """Issue 27's bars (issue 38's with ``FLY_BARS`` and no minimum) on a serve record's configs:
    each draft's mean acceptance length against the one it must match (ratio >= 0.97) at every
    setting, and bf16 at 3/1/4 against 1.5. Every bar is present: one whose configuration was
    not measured fails and names what is missing."""
    mean = lambda name: configs.get(name, {}).get("acceptance", {}).get("mean_acceptance_length")
    out: Dict[str, Dict] = {}
    for label, (num, den, bar) in bars.items():
        for setting in SETTINGS:
            names = (f"{num}-{setting}", f"{den}-{setting}")
            missing = [n for n in names if mean(n) is None]
            if missing:
                out[f"{label} ({setting})"] = {"bar": bar, "pass": False, "missing": missing}
            else:
                ratio = round(mean(names[0]) / mean(names[1]), 4)
                out[f"{label} ({setting})"] = {"ratio": ratio, "bar": bar, "pass": ratio >= bar}
    if minimum is None:
        return out
    name, bar = minimum
    value = mean(name)
    out[f"{name} mean acceptance length"] = ({"value": value, "bar": bar, "pass": value >= bar} if value is not None
                                             else {"bar": bar, "pass": False, "missing": [name]})
    return out


def serve(a: argparse.Namespace) -> None:
    """Each configuration in its own server, all started side by side (small models, one GPU),
    then measured one at a time so that the tok/s of one does not share the GPU with another."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = [_chat_ids(tok, p["prompt"]) for p in _read_jsonl(a.test_prompts)]
    fly = a.stage == "flyserve"
    drafts = ("bf16", *FLY_FEATURES) if fly else a.features
    configs = ([] if fly else [("target", None, "")]) + [(f"{f}-{s}", os.path.join(a.work, f"draft-{f}"), s)
                                                          for f in drafts for s in SETTINGS]
    def start(c) -> object:
        try:
            return _server(_spec_cmd(a, c[1], c[2]), a.work, f"serve-{c[0]}")
        except RuntimeError as e:  # recorded, and the others are still measured
            return f"did not start: {str(e)[-600:]}"

    with cf.ThreadPoolExecutor(len(configs)) as pool:
        started = dict(zip([c[0] for c in configs], pool.map(start, configs), strict=True))
    servers = {k: v for k, v in started.items() if isinstance(v, Server)}
    results: Dict = {"prompts": len(prompts), "max_new_tokens": a.eval_tokens, "settings": SETTINGS, "configs": {},
                     "failed": {k: v for k, v in started.items() if not isinstance(v, Server)}}
    try:
        for name, server in servers.items():
            # first requests of each batch size compile and tune kernels: not part of the figure
            _measure(server, prompts[:a.concurrency], 32, a.concurrency)
            try:
                info = requests.get(server.url + "/server_info", timeout=30).json()
            except (requests.RequestException, ValueError):
                info = {}
            r = {"acceptance": _measure(server, prompts, a.eval_tokens, a.concurrency),
                 "bs1": _measure(server, prompts[:a.bs1_prompts], a.eval_tokens, 1),
                 "speculative": {k: info.get(k) for k in ("speculative_algorithm", "speculative_num_steps",
                                                          "speculative_eagle_topk", "speculative_num_draft_tokens")}}
            results["configs"][name] = r
            log(f"{name}: {json.dumps(r)}")
            if a.mirror:  # what was measured survives a call cut off at its time limit
                with open(os.path.join(a.mirror, f"drafter-{a.stage}-partial.json"), "w") as f:
                    json.dump(results, f, indent=1)
    finally:
        for server in servers.values():
            stop_server(server)
    target = results["configs"].get("target")
    for name, r in results["configs"].items():
        for k in ("acceptance", "bs1"):
            if target:
                r[k]["speedup_vs_target"] = round(r[k]["output_tok_per_s"] / target[k]["output_tok_per_s"], 3)
    results["verdicts"] = verdicts(results["configs"], *bars_for(a.stage, a.features))
    _mark(a.work, a.stage, results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=("regen", "capture", "baseline", "train", "serve", "flywheel", "flytrain", "flyserve",
                                      "turns", "sharecap"))
    ap.add_argument("work")
    ap.add_argument("--model", required=True, help="target checkpoint (bf16 safetensors)")
    ap.add_argument("--train-prompts", default="")
    ap.add_argument("--test-prompts", default="")
    ap.add_argument("--chat-prompts", default="", help="turns: multi-turn chats (bench/drafter_data.py --chats)")
    ap.add_argument("--samples", type=int, default=3000, help="training conversations (turns: chats)")
    ap.add_argument("--answer-tokens", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--server-args", default=GPU_ARGS)
    ap.add_argument("--train-steps", type=int, default=0, help="steps per run (0: sized to --train-budget-s)")
    ap.add_argument("--train-budget-s", type=float, default=660.0, help="seconds the three runs may take side by side")
    ap.add_argument("--probe-steps", type=int, default=200)
    ap.add_argument("--parallel-slowdown", type=float, default=1.0,
                    help="a step's slowdown with three runs side by side (r49: none; the three ran 0.091 s a step)")
    ap.add_argument("--epochs", type=int, default=3, help="upper bound on the steps: epochs x samples")
    ap.add_argument("--lr", type=float, default=3e-4, help="a short run of a small draft: above SpecForge's 1e-4")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--attention-backend", default="sdpa", help="SpecForge's (its offline example uses sdpa)")
    ap.add_argument("--specforge", default=f"{sys.executable} -m specforge.cli",
                    help="the SpecForge command (a CPU dry run passes a wrapper)")
    ap.add_argument("--eval-tokens", type=int, default=256, help="max new tokens per held-out prompt")
    ap.add_argument("--mirror", default="", help="serve: also write the results so far here after each configuration")
    ap.add_argument("--bs1-prompts", type=int, default=20, help="held-out prompts also run one at a time (tok/s at batch 1)")
    ap.add_argument("--features", default=",".join(FEATURES),
                    help="train, serve: the feature sets (WORK/ckpt-NAME; the first gives the vocab mapping); flytrain: "
                         "always flywheel,prefill; private,shared: prefix sharing's bar")
    ap.add_argument("--capture-dtypes", default="bf16,fp8", help="capture: the dtypes extracted")
    ap.add_argument("--spec-backend-args", default="",
                    help="flags for every speculative server (a CPU dry run passes the test bed's EAGLE backends)")
    a = ap.parse_args()
    a.features = FLY_FEATURES if a.stage == "flytrain" else tuple(a.features.split(","))
    a.capture_dtypes = tuple(a.capture_dtypes.split(","))
    os.makedirs(a.work, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if _done(a.work, a.stage):
        log(f"{a.stage}: already done")
        return 0
    {"regen": regen, "capture": capture, "baseline": baseline, "train": train, "serve": serve, "flywheel": flywheel,
     "flytrain": train, "flyserve": serve, "turns": turns, "sharecap": sharecap}[a.stage](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
