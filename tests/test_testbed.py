"""The test bed's cached builds are safe when several processes or threads start at once
(a fresh machine, where two servers started together once raced on the stub's temporary name)."""
from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time

from sglang_capture.testbed import server as testbed_server
from sglang_capture.testbed.cpu import build_cuda_stub
from sglang_capture.testbed.once import build_once


def _slow_build(log: str):
    def build(tmp: str) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        with open(os.path.join(tmp, "part1"), "w") as f:
            f.write("1")
        time.sleep(0.5)  # long enough for every other caller to arrive while this one builds
        with open(os.path.join(tmp, "part2"), "w") as f:
            f.write("2")
    return build


def _build_in_child(path: str, log: str, seen: multiprocessing.Queue) -> None:
    out = build_once(path, _slow_build(log), stamp="v1")
    seen.put(sorted(os.listdir(out)))


def test_processes_racing_for_one_artifact_build_it_once_and_all_see_it_whole(tmp_path):
    path, log = str(tmp_path / "artifact"), str(tmp_path / "builds.log")
    ctx = multiprocessing.get_context("fork")
    seen = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(path, log, seen)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0] * 4
    assert len(open(log).read().split()) == 1
    assert [seen.get(timeout=5) for _ in procs] == [[".built", "part1", "part2"]] * 4
    assert sorted(os.listdir(tmp_path)) == ["artifact", "artifact.lock", "builds.log"]  # no temporary left


def test_a_changed_stamp_rebuilds_the_artifact_whole(tmp_path):
    path, log = str(tmp_path / "artifact"), str(tmp_path / "builds.log")
    build_once(path, _slow_build(log), stamp="v1")
    build_once(path, _slow_build(log), stamp="v1")
    assert len(open(log).read().split()) == 1
    build_once(path, _slow_build(log), stamp="v2")
    assert len(open(log).read().split()) == 2
    assert open(os.path.join(path, ".built")).read() == "v2"
    assert sorted(os.listdir(tmp_path)) == ["artifact", "artifact.lock", "builds.log"]


def test_a_failed_build_leaves_nothing_and_the_next_caller_builds_it(tmp_path):
    path = str(tmp_path / "artifact")

    def broken(tmp: str) -> None:
        open(os.path.join(tmp, "half"), "w").close()
        raise RuntimeError("compiler crashed")

    try:
        build_once(path, broken)
    except RuntimeError:
        pass
    assert sorted(os.listdir(tmp_path)) == ["artifact.lock"]
    build_once(path, lambda tmp: open(os.path.join(tmp, "whole"), "w").close())
    assert sorted(os.listdir(path)) == [".built", "whole"]


# Binds the HTTP port as uvicorn does: on a taken port it logs uvicorn's error line and exits.
_HTTP_SERVER = """
import sys, http.server
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
try:
    srv = http.server.HTTPServer(("127.0.0.1", port), H)
except OSError:
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
          "address already in use", flush=True)
    sys.exit(3)
srv.serve_forever()
"""


def test_a_server_whose_port_is_taken_before_it_binds_is_started_again_on_another(tmp_path, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1], testbed_server.free_port()])
        monkeypatch.setattr(testbed_server, "free_port", lambda: next(ports))
        server = testbed_server.start_server([sys.executable, "-c", _HTTP_SERVER], dict(os.environ),
                                             str(tmp_path / "server.log"))
        try:
            assert server.url != f"http://127.0.0.1:{taken.getsockname()[1]}"
            assert server.proc.poll() is None
        finally:
            testbed_server.stop_server(server)


def test_free_port_skips_a_port_whose_dp_attention_detokenizer_port_is_held_and_stays_below_ephemeral_ports():
    first = testbed_server.free_port()
    second = next(p for p in iter(testbed_server.free_port, None) if p != first)
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    assert testbed_server.LOWEST_PORT <= first < low - 240 and second < low - 240
    with socket.socket() as held:
        held.bind(("127.0.0.1", first + 235))  # SGLang's detokenizer port under DP attention
        held.listen()
        assert testbed_server.free_port([first, second]) == second


def test_servers_starting_together_on_a_fresh_machine_share_one_working_cuda_stub(tmp_path):
    stub_dir = str(tmp_path / "cudastub")
    results, errors = [], []

    def start() -> None:
        try:
            results.append(build_cuda_stub(stub_dir))
        except Exception as e:  # noqa: BLE001 - the test reports whatever a racing build raised
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and results == [stub_dir] * 4
    lib = os.path.join(stub_dir, "libcuda.so.1")
    assert open(lib, "rb").read(4) == b"\x7fELF"
    symbols = subprocess.run(["nm", "-D", lib], capture_output=True, text=True, check=True).stdout
    assert "cuInit" in symbols and "cuGetProcAddress_v2" in symbols


def test_the_kimi_compute_config_serves_with_dummy_weights_and_captures(make_test_server, tmp_path):
    """bench/e2e.sh kimi's model (Kimi-K2.5's head dims, dense layer 0 of 18,432, top-8 of 2,048-wide
    experts), shrunk to 4 layers of width 512 so a CPU serves it: the config loads with
    ``--load-format dummy`` and a capture request is written at the default layers."""
    import sglang_capture
    from sglang_capture.testbed.server import capture_cmd
    from sglang_capture.testbed.tiny_models import build_tokenizer, save_deepseek_v3

    model = save_deepseek_v3(str(tmp_path / "kimi"), build_tokenizer(), layers=4, hidden=512, shape="kimi")
    assert not os.path.exists(os.path.join(model, "model.safetensors"))  # config and tokenizer only
    capture_dir = str(tmp_path / "caps")
    os.makedirs(capture_dir)
    server = make_test_server(capture_cmd(model, capture_dir, "--load-format", "dummy"), capture_dir)
    r = server.generate({"input_ids": list(range(10, 300)),
                         "sampling_params": {"max_new_tokens": 2, "custom_params": {"capture": True}}}).json()
    ref = r["meta_info"]["capture"]
    assert ref["status"] == "ok" and ref["rows"] == 291 and ref["layers"] == [2, 3]
    assert sglang_capture.load(ref["path"])["aux_hidden_states"].shape == (291, 2 * 512)


def _routed_experts(model_dir: str, prompts) -> list:
    """Per MoE layer, the set of expert-choice rows transformers computes for ``prompts``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    chosen = {}

    def keep(layer):
        def hook(module, args, out):
            if isinstance(out, tuple):  # newer transformers' router: (logits, weights, the chosen experts)
                picks = out[2]
            else:  # older: the logits; sigmoid scores plus the selection bias make the choice
                picks = (torch.sigmoid(out.float()) + module.e_score_correction_bias).topk(2, -1).indices
            chosen.setdefault(layer, set()).update(tuple(sorted(r)) for r in picks.tolist())
        return hook

    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(keep(i))
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]))
    return [chosen[i] for i in sorted(chosen)]


def test_the_gpu_shape_routes_every_token_to_the_same_experts_of_a_layer(tmp_path):
    """bench/gpu_e2e.py holds the GPU shape to the dense models' bar (every row >= 0.999): that is
    only sound if bf16 rounding cannot flip its router, i.e. each layer's choice is fixed."""
    import json

    from sglang_capture.testbed.tiny_models import build_tokenizer, save_deepseek_v3

    tok = build_tokenizer()
    gpu = save_deepseek_v3(str(tmp_path / "gpu"), tok, layers=3, hidden=512, shape="gpu")
    cpu = save_deepseek_v3(str(tmp_path / "cpu"), tok, layers=3, hidden=256, shape="cpu")
    assert json.load(open(os.path.join(gpu, "config.json")))["testbed_routing"] == "fixed"
    prompts = [list(range(5, 60)), list(range(400, 470))]
    gpu_choice = _routed_experts(gpu, prompts)
    assert len(gpu_choice) == 2 and all(len(c) == 1 for c in gpu_choice)  # one expert pair per layer
    assert gpu_choice[0] != gpu_choice[1]  # a permutation per layer, not the same experts everywhere
    assert any(len(c) > 1 for c in _routed_experts(cpu, prompts))  # the CPU shape's router stays random


def test_the_kimi_k25_cli_writes_the_checkpoint_and_its_language_model_reference(tmp_path):
    import torch
    from safetensors.torch import load_file

    out = str(tmp_path / "k")
    run = subprocess.run([sys.executable, "-m", "sglang_capture.testbed.tiny_models", out, "--arch", "kimi_k25",
                          "--shape", "gpu", "--layers", "2", "--hidden", "256"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    kimi, text = load_file(os.path.join(out, "model.safetensors")), load_file(os.path.join(out + "-text", "model.safetensors"))
    assert set(text) == {k[len("language_model."):] for k in kimi if k.startswith("language_model.")}
    assert all(torch.equal(text[k], kimi["language_model." + k]) for k in text)
    bad = subprocess.run([sys.executable, "-m", "sglang_capture.testbed.tiny_models", str(tmp_path / "x"), "--arch",
                          "kimi_k25", "--shape", "kimi"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--shape cpu or gpu" in bad.stderr.strip().splitlines()[-1]
