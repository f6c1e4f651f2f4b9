"""Deployment configurations on real SGLang (CPU, float32): DP attention, data-parallel schedulers, two nodes.

Each server gets concurrent capture and plain requests of mixed lengths, with chunked prefill
(every prompt over the chunk size is split) and radix-cache hits (plain requests sharing a
prefix), and every captured file must equal transformers on the same tokens. The CPU test bed
(testbed/cpu_mla.py) lets SGLang run several ranks over gloo.
"""
from __future__ import annotations

import contextlib
import glob
import os
import random
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterator, List, Optional

import pytest
import torch

import sglang_capture
from sglang_capture.core.capture_dir import writer_stats
from sglang_capture.core.reader import block_names, read_meta
from sglang_capture.patches.version_gate import installed_sglang_version
from sglang_capture.testbed.server import Server, capture_cmd, free_port, plain_cmd, start_server, stop_server
from tests.chats import chat_turns, length_ended_last_row
from tests.reference import max_abs_diff, min_block_cosines, min_row_cosine, reference_pre_norm, reference_states

LAYERS = [0, 2, 3]
TOL = 1e-4
CHUNK = 128  # DP attention halves it per rank: 64
# SGLang's CPU check for more ranks than NUMA nodes: 0.5.17 and 0.5.18 count the TP group, 0.5.19
# on every rank (dp x tp), and each refuses a bind list of another length
TWO_RANKS = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
TWO_REPLICAS = TWO_RANKS if tuple(map(int, installed_sglang_version().split("."))) >= (0, 5, 19) else None


def _requests() -> List[Dict]:
    rng = random.Random(16)
    out = []
    for i in range(18):
        ids = [rng.randrange(10, 1000) for _ in range(rng.choice([17, 40, 90, 150, 260, 330]))]
        out.append({"i": i, "ids": ids, "capture": i % 4 != 3, "new": 1 if i % 3 == 0 else 4})
    shared = [rng.randrange(10, 1000) for _ in range(120)]  # plain requests cache it; captures never hit it
    for i, tail in enumerate(([5, 6, 7], [8, 9], [11]), start=18):
        out.append({"i": i, "ids": shared + tail, "capture": i != 19, "new": 2})
    # two captures past a whole slot of the same tokens (prefix sharing): sent together, each rank may compute and
    # store the same block; it must be stored once and read whole by both
    slot = [rng.randrange(10, 1000) for _ in range(300)]
    out += [{"i": 21, "ids": slot + [13], "capture": True, "new": 2}, {"i": 22, "ids": slot + [14, 15], "capture": True, "new": 2}]
    return out


def _send(server, r: Dict, prefix: str = "", dtype: Optional[str] = None) -> Dict:
    params = {"max_new_tokens": r["new"], "temperature": 0, "ignore_eos": True}
    if r["capture"]:
        params["custom_params"] = {"capture": True, "capture_name": f"{prefix}req-{r['i']}"}
        if dtype is not None:
            params["custom_params"]["capture_dtype"] = dtype
    resp = server.generate({"input_ids": r["ids"], "sampling_params": params}, timeout=600)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _check_load(server, model: str, fp8: bool = False) -> List[Dict]:
    """Send the load concurrently; every capture ok, one file each, rows equal to transformers
    (``fp8``: each request asks for FP8 storage, and every row of every hidden-state vector is
    within cos 0.999 of them; half the single prompts, short and chunked, the plain ones beside them,
    and every shared-prefix one)."""
    reqs = [r for r in _requests() if not fp8 or r["i"] % 2 == 0 or not r["capture"] or r["i"] >= 18]
    prefix = "fp8-" if fp8 else ""
    with ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(lambda r: _send(server, r, prefix, "fp8" if fp8 else None), reqs))
    captured = [(r, o) for r, o in zip(reqs, outs, strict=False) if r["capture"]]
    assert all("capture" not in o["meta_info"] for r, o in zip(reqs, outs, strict=False) if not r["capture"])
    bad = [(r["i"], o["meta_info"]["capture"].get("error")) for r, o in captured if o["meta_info"]["capture"]["status"] != "ok"]
    assert bad == []
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(server.capture_dir, f"{prefix}req-*.capture.msgpack")))
    assert files == sorted(f"{prefix}req-{r['i']}.capture.msgpack" for r, _ in captured)
    assert not os.listdir(os.path.join(server.capture_dir, ".tmp"))
    for r, o in captured:
        data = sglang_capture.load(o["meta_info"]["capture"]["path"])
        assert data["rid"] == o["meta_info"]["id"] and data["input_ids"].tolist() == r["ids"]
        assert data["output_ids"].tolist() == o["output_ids"]
        ids = r["ids"] + o["output_ids"][:-1]
        aux, last = reference_states(model, torch.float32, ids, LAYERS)
        assert data["aux_hidden_states"].shape == aux.shape, r["i"]
        finals = [("last_hidden_states", last)]
        if data["final"] == "both":  # a server started with --capture-final both
            finals.append(("last_hidden_states_pre_norm", reference_pre_norm(model, torch.float32, ids)))
        if fp8:
            assert data["meta"]["storage_dtype"] == "float8_e4m3fn"
            assert min(min_block_cosines(data["aux_hidden_states"], aux, last.shape[-1])) >= 0.999, r["i"]
            assert all(min_row_cosine(data[name], want) >= 0.999 for name, want in finals), r["i"]
            continue
        assert max_abs_diff(data["aux_hidden_states"], aux) <= TOL, r["i"]
        assert all(max_abs_diff(data[name], want) <= TOL for name, want in finals), r["i"]
    return [o for _, o in captured]


def _stats_counting(capture_dir: str, files: int) -> List[Dict]:
    """Every writer rank's stats, once they count ``files`` written in all (each rank rewrites its
    file at most a few times a second, and once more a moment after its last file)."""
    deadline = time.monotonic() + 15
    while True:
        stats = list(writer_stats(capture_dir).values())
        if sum(s["written"] for s in stats) >= files or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def _check_two_writer_ranks(server, captured: List[Dict]) -> None:
    """Each DP rank wrote its own requests' files, with half the node's memory and writers."""
    stats = _stats_counting(server.capture_dir, len(captured))
    written = sorted(s["written"] for s in stats)
    assert len(written) == 2 and sum(written) == len(captured) and min(written) > 0
    # defaults: 8192 MiB for the node; writers auto = 2 on this 2-core machine
    assert [s["cap_bytes"] for s in stats] == [4096 << 20] * 2
    assert sum(len(s["writer_pids"]) for s in stats) == 2
    # prefix sharing: whichever rank stored a block, and however many computed its rows, it was written once, whole
    blocks = glob.glob(os.path.join(server.capture_dir, ".blocks", "*", "*.block.msgpack"))
    assert blocks and sum(s["blocks_written"] for s in stats) == len(blocks)
    firsts = {}
    for o in captured:
        path = o["meta_info"]["capture"]["path"]
        if os.path.basename(path).split(".")[0].endswith(("req-21", "req-22")):
            firsts.setdefault(os.path.basename(path).split("req-")[0], set()).add(block_names(read_meta(path), path)[0])
    assert firsts and all(len(names) == 1 for names in firsts.values()), firsts  # the whole slot: one block for both
    assert not os.listdir(os.path.join(server.capture_dir, ".tmp"))
    assert server.log().count("node budget 8192 MiB of host memory and 2 writer processes, shared by 2 writer "
                              "rank(s): 4096 MiB and 1 process(es) on this rank") == 2


def _dsv3_server(make_test_server, tiny_models, tmp_path, *parallel: str, env=None):
    capture_dir = str(tmp_path / "capture")
    os.makedirs(capture_dir)
    cmd = capture_cmd(tiny_models["tiny-dsv3"], capture_dir, "--capture-layers", ",".join(map(str, LAYERS)),
                      "--dtype", "float32", "--chunked-prefill-size", str(CHUNK), *parallel)
    return make_test_server(cmd, capture_dir, extra_env=env)


def test_dp_attention_captures_every_request_once_on_its_own_rank_equal_to_transformers_in_bf16_and_fp8(
        make_test_server, tiny_models, tmp_path):
    """The issue-16 defect: under DP attention SGLang re-slices the result tensor, which once lost the
    kept-rows map (IncompleteCapture, and other requests' rows in a file). FP8 rows go through the
    re-sliced results, chunked prefill and radix hits as bf16 rows do: the same load again, each
    request asking for FP8, every vector within cos 0.999. The pre-norm final state too (--capture-final both)."""
    server = _dsv3_server(make_test_server, tiny_models, tmp_path, "--tp", "2", "--dp", "2", "--enable-dp-attention",
                          "--capture-final", "both", env=TWO_RANKS)
    captured = _check_load(server, tiny_models["tiny-dsv3"])
    assert {sglang_capture.load(o["meta_info"]["capture"]["path"], tensors=())["final"] for o in captured} == {"both"}
    captured += _check_load(server, tiny_models["tiny-dsv3"], fp8=True)
    _check_two_writer_ranks(server, captured)
    _check_chat_hit(server, tiny_models["tiny-dsv3"], 72)  # the rank's re-sliced result holds the answer's last row
    log = server.log()
    assert "chunked prefill size is adjusted from 128 to 64" in log
    assert "aux layers computed in every forward (DP attention is on)" in log


def test_two_data_parallel_schedulers_without_overlap_capture_every_request_once_equal_to_transformers(
        make_test_server, tiny_models, tmp_path):
    """Two DP schedulers, each its own writer rank; without overlap SGLang never calls copy_to_cpu,
    so the rows kept in the forward stay on the device and the row seams must still find them
    through the batch's state (one server for both: overlap itself runs in every other test)."""
    server = _dsv3_server(make_test_server, tiny_models, tmp_path, "--dp", "2", "--disable-overlap-schedule",
                          env=TWO_REPLICAS)
    _check_two_writer_ranks(server, _check_load(server, tiny_models["tiny-dsv3"]))
    # without overlap no step feeds an answer's last token after it ended: the radix cache stops before
    # it, and a capturing chat's next turn hits exactly that, as a plain chat's does
    _check_chat_hit(server, tiny_models["tiny-dsv3"], 70, overlap=False)


def _check_chat_hit(server, model: str, seed: int, overlap: bool = True) -> None:
    """A capturing chat's second turn hits the radix cache as a plain chat's does (both on DP rank 0,
    where the first turn's KV is): every token of the first turn under overlap, whose step after the
    answer fed its last token (its row kept in the blocks, server/answer_tail.py), one fewer without;
    and it reads exact, that row included."""
    history, _, plain = chat_turns(server, seed, routed_dp_rank=0)
    assert plain["meta_info"]["cached_tokens"] == history - (0 if overlap else 1)
    history, one, two = chat_turns(server, seed + 1, f"chat-{seed}", routed_dp_rank=0)
    hit = history - (0 if overlap else 1)
    assert two["meta_info"]["cached_tokens"] == hit
    assert one["meta_info"]["capture"]["rows_for_next_turn"] == int(overlap)
    ref = two["meta_info"]["capture"]
    assert ref["status"] == "ok" and ref["rows_shared"] == hit, ref
    data = sglang_capture.load(ref["path"])
    aux, last = reference_states(model, torch.float32, data["input_ids"].tolist() + data["output_ids"].tolist()[:-1],
                                 LAYERS)
    assert max_abs_diff(data["aux_hidden_states"], aux) <= TOL and max_abs_diff(data["last_hidden_states"], last) <= TOL


def _node_args(addr: str, rank: int) -> List[str]:
    return ["--tp", "2", "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", addr]


def _start_node1(cmd: List[str], env: Dict[str, str], log_path: str) -> subprocess.Popen:
    """Node 1, started until past SGLang's port checks. Both "nodes" share this host, and each checks
    the ZMQ ports derived from --dist-init-addr, which node 0 binds (on two hosts they never
    collide): node 0 may start only once node 1 logged its server_args, which follows the checks
    (in 0.5.23 too: ``PortArgs.init_new`` runs just before the log line)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        with open(log_path, errors="replace") as f:
            if "server_args=" in f.read():  # 0.5.17 logs ServerArgs(...), 0.5.23 a dict, both after the checks
                return proc
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    _stop(proc)
    with open(log_path, errors="replace") as f:
        raise RuntimeError(f"node 1 did not get past its port checks:\n{f.read()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    stop_server(Server("node1", proc, ""))


@contextlib.contextmanager
def _two_nodes(make_test_server, model: str, capture_dir: str, tmp_path, env, node_args) -> Iterator:
    """Node 1 started, then node 0 (the HTTP front) as a capture server; node 1 stopped after."""
    os.makedirs(capture_dir)
    addr = f"127.0.0.1:{free_port()}"
    layers = ["--capture-layers", ",".join(map(str, LAYERS)), "--dtype", "float32"]
    node1 = _start_node1(capture_cmd(model, capture_dir, *layers, *node_args(addr, 1)), {**env, **TWO_RANKS},
                         str(tmp_path / "node1.log"))
    try:
        yield make_test_server(capture_cmd(model, capture_dir, *layers, *node_args(addr, 0)), capture_dir,
                               extra_env=TWO_RANKS)
    finally:
        _stop(node1)


def test_tp_across_two_nodes_writes_every_file_where_the_response_says(make_test_server, tiny_models, tmp_path, env):
    """Two "nodes" on loopback, one rank each; only node 0's TP rank 0 writes, next to the HTTP front. A
    conversation's second turn reuses the first turn's stored rows: node 1's rank caps its radix hit
    alike, from the block events node 0's rank sends with the requests (else their batches would part)."""
    model, capture_dir = tiny_models["tiny-dsv3"], str(tmp_path / "capture")
    with _two_nodes(make_test_server, model, capture_dir, tmp_path, env, _node_args) as server:
        ids = list(range(20, 120))
        for turn in range(3):
            out = _send(server, {"i": turn, "ids": ids, "capture": True, "new": 3})
            ref = out["meta_info"]["capture"]
            assert ref["status"] == "ok" and os.path.dirname(ref["path"]) == capture_dir
            # every row of the turn before, and its answer's last token's where SGLang fed it (server/answer_tail.py)
            assert ref["rows_shared"] == (0 if turn == 0 else len(ids) - 4 + length_ended_last_row())
            data = sglang_capture.load(ref["path"])
            aux, last = reference_states(model, torch.float32, ids + out["output_ids"][:-1], LAYERS)
            assert max_abs_diff(data["aux_hidden_states"], aux) <= TOL
            assert max_abs_diff(data["last_hidden_states"], last) <= TOL
            ids = ids + out["output_ids"] + [7, 8, 9]
        assert len(writer_stats(capture_dir)) == 1  # node 1 writes nothing


def test_a_plain_sglang_node_beside_a_launcher_node_is_refused_at_start(tiny_models, tmp_path, env):
    """Its ranks would keep capture requests in the shared radix cache and the ranks' batches would part."""
    model, capture_dir = tiny_models["tiny-dsv3"], str(tmp_path / "capture")
    os.makedirs(capture_dir)
    addr = f"127.0.0.1:{free_port()}"
    node1 = _start_node1(plain_cmd(model, "--dtype", "float32", *_node_args(addr, 1)), {**env, **TWO_RANKS},
                         str(tmp_path / "node1.log"))
    log = str(tmp_path / "node0.log")
    try:
        with pytest.raises(RuntimeError, match="server exited"):
            server = start_server(capture_cmd(model, capture_dir, "--capture-layers", "1,2,3", *_node_args(addr, 0)),
                                  {**env, **TWO_RANKS, "SGLANG_CAPTURE_PEER_WAIT_S": "6"}, log, capture_dir)
            stop_server(server)
        assert ("sglang_capture: rank(s) [1] of 2 run without the capture patches (a node started with plain "
                "sglang.launch_server?)") in open(log).read()
    finally:
        _stop(node1)


def _dp_node_args(addr: str, rank: int) -> List[str]:
    return [*_node_args(addr, rank), "--dp", "2", "--enable-dp-attention", "--chunked-prefill-size", str(CHUNK)]


def test_dp_attention_across_two_nodes_sharing_one_capture_dir_writes_each_file_on_its_own_node(
        make_test_server, tiny_models, tmp_path, env):
    """DP group 1 lives on node 1 and writes there; with one shared dir node 0's front finds every outcome."""
    model, capture_dir = tiny_models["tiny-dsv3"], str(tmp_path / "capture")
    with _two_nodes(make_test_server, model, capture_dir, tmp_path, env, _dp_node_args) as server:
        captured = _check_load(server, model)
        stats = _stats_counting(capture_dir, len(captured))
        written = sorted(s["written"] for s in stats)
        assert len(written) == 2 and sum(written) == len(captured) and min(written) > 0  # one writer rank per node
        assert [s["cap_bytes"] for s in stats] == [8192 << 20] * 2  # each node's budget, one writer rank on each
        assert not glob.glob(os.path.join(capture_dir, ".tmp", "peer-rank*"))  # the shared-dir markers are gone


def test_dp_attention_across_nodes_without_a_shared_capture_dir_is_refused_at_start(tiny_models, tmp_path, env):
    """Node 1 would write its DP group's files where node 0's front never looks: every such capture would time out."""
    model = tiny_models["tiny-dsv3"]
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    for d in dirs:
        os.makedirs(d)
    addr = f"127.0.0.1:{free_port()}"
    node1 = _start_node1(capture_cmd(model, dirs[1], "--dtype", "float32", *_dp_node_args(addr, 1)), {**env, **TWO_RANKS},
                         str(tmp_path / "node1.log"))
    log = str(tmp_path / "node0.log")
    try:
        with pytest.raises(RuntimeError, match="server exited"):
            server = start_server(capture_cmd(model, dirs[0], "--dtype", "float32", *_dp_node_args(addr, 0)),
                                  {**env, **TWO_RANKS}, log, dirs[0])
            stop_server(server)
        assert (f"sglang_capture: --dp across nodes needs one --capture-dir shared by every node at the same path: "
                f"rank(s) [1] wrote into {dirs[1]}") in open(log).read()
    finally:
        _stop(node1)
