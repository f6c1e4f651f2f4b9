"""The launcher's start-up checks, the seam table and the instrumentor (in-process, no server)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import wrapt
from click.testing import CliRunner

import sglang_capture.patches.version_gate as gate
import sglang_capture.server.instrumentor as inst
from sglang_capture.core.config import CaptureConfig
from sglang_capture.patches import load_table, supported_versions, table_path
from sglang_capture.server.launch import main
from sglang_capture.testbed.server import device_args


def _launch(*args):
    result = CliRunner().invoke(main, list(args))
    lines = [l for l in result.output.strip().splitlines() if l.startswith("Error")]
    return result, lines


def test_missing_capture_dir_exits_non_zero_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sglang_capture.launch", "--capture-dir", str(tmp_path / "nope"),
                           "--model-path", "x"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    nope = tmp_path / "nope"
    assert proc.stderr.strip().splitlines()[-1] == f"Error: --capture-dir {nope} does not exist; create it first (mkdir -p {nope})"
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("how", [["-O"], ["-OO"], "PYTHONOPTIMIZE"])
def test_python_without_asserts_is_refused_in_one_line(tmp_path, how):
    """Issue 52 item 5: SGLang 0.5.17-0.5.19 check the count of captured layers with an assert only, which -O
    strips: the launcher refuses to start rather than let a miscount into the files."""
    env = {**os.environ, "PYTHONOPTIMIZE": "1"} if how == "PYTHONOPTIMIZE" else {**os.environ, "PYTHONOPTIMIZE": ""}
    flags = how if isinstance(how, list) else []
    proc = subprocess.run([sys.executable, *flags, "-m", "sglang_capture.launch", "--capture-dir", str(tmp_path),
                           "--model-path", "x"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "Error: python -O (or PYTHONOPTIMIZE) strips the asserts with which SGLang checks the count of captured layers "
        "(AuxHiddenStatePacker.finalize), so a miscount would go into the files unnoticed; start the launcher without "
        "-O and with PYTHONOPTIMIZE unset")


def test_a_removed_or_misspelt_capture_option_is_refused_in_one_line_not_passed_to_sglang(tmp_path):
    result, lines = _launch("--capture-dir", str(tmp_path), "--capture-gc-freeze", "--model-path", "x")
    assert result.exit_code != 0 and lines == ["Error: --capture-gc-freeze was removed: no full garbage collection runs "
                                               "under traffic once the server is up (bench/RESULTS.md, r69-r72); drop "
                                               "the option"]
    result, lines = _launch("--capture-dir", str(tmp_path), "--model-path", "x", "--capture-writer=4")
    assert result.exit_code != 0 and lines == ["Error: no such option --capture-writer; `python -m sglang_capture.launch "
                                               "--help` lists the --capture-* options"]


def test_capture_dir_that_is_a_file_or_unwritable(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    result, lines = _launch("--capture-dir", str(f), "--model-path", "x")
    assert result.exit_code != 0 and len(lines) == 1 and ("is a file" in lines[0] or "not a directory" in lines[0])
    result, lines = _launch("--capture-dir", "/proc", "--model-path", "x")  # not writable, even for root
    assert result.exit_code != 0 and lines == [lines[0]] and "not writable" in lines[0]


def test_layer_out_of_range_is_refused_before_start(tiny_models, tmp_path):
    result, lines = _launch("--capture-dir", str(tmp_path), "--capture-layers", "1,9", "--model-path",
                            tiny_models["tiny-dsv3"], "--device", "cpu")
    assert result.exit_code != 0
    assert lines == ["Error: --capture-layers 9 out of range: DeepseekV3ForCausalLM with 4 layers accepts ids 0..3 "
                     "(id i = input of decoder layer i)"]
    assert "SGLANG_CAPTURE_CONFIG" not in os.environ


def test_model_without_aux_capture_is_refused(tiny_models, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    cfg = json.load(open(os.path.join(tiny_models["tiny-llama"], "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(cfg))
    result, lines = _launch("--capture-dir", str(tmp_path), "--model-path", str(model), "--device", "cpu")
    assert result.exit_code != 0 and len(lines) == 1 and "GPT2LMHeadModel has no aux hidden-state capture" in lines[0]


def test_speculative_decoding_is_refused(tiny_models, tmp_path):
    """Speculation other than EAGLE-3 keeps no aux layers to capture."""
    result, lines = _launch("--capture-dir", str(tmp_path), "--model-path", tiny_models["tiny-llama"], "--device", "cpu",
                            "--speculative-algorithm", "NGRAM")
    assert result.exit_code != 0
    assert lines == ["Error: capture on a server that speculates supports --speculative-algorithm EAGLE3 (its target "
                     "keeps the aux layers the draft reads), not NGRAM; use EAGLE3 or drop it"]


@pytest.mark.parametrize("args, words", [
    (["--disaggregation-mode", "decode"], "a PD decode server computes no prompt rows (it receives the prompt's KV "
     "cache): start it with python -m sglang.launch_server and capture on the prefill servers"),
    (["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "fake"],
     "SGLang refused its arguments: Prefill server does not support 'fake' as the transfer backend"),
    (["--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "127.0.0.1:5757", "--tp", "2", "--dp", "2"],
      "--dp > 1 across several nodes only with --enable-dp-attention"),
])
def test_deployments_whose_captures_would_all_fail_are_refused_at_start(tiny_models, tmp_path, args, words):
    result, lines = _launch("--capture-dir", str(tmp_path), "--model-path", tiny_models["tiny-dsv3"], "--device", "cpu",
                            *args)
    assert result.exit_code != 0 and len(lines) == 1 and words in lines[0], result.output[-2000:]


def test_prefill_server_whose_transfer_engine_does_not_load_is_refused_at_start(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import fails as for a missing wheel
    result, lines = _launch("--capture-dir", str(tmp_path), "--model-path", tiny_models["tiny-dsv3"], "--device", "cpu",
                            "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake_tcp")
    assert result.exit_code != 0 and len(lines) == 1, result.output[-2000:]
    assert lines[0].startswith("Error: --disaggregation-transfer-backend mooncake (or mooncake_tcp) needs Mooncake's "
                               "transfer engine, which does not load (")


def test_writer_cpus_that_are_not_a_list_or_not_the_servers_are_refused(tmp_path):
    result, lines = _launch("--capture-dir", str(tmp_path), "--capture-writer-cpus", "8-x", "--model-path", "x")
    assert result.exit_code != 0
    assert lines == ["Error: --capture-writer-cpus must be a CPU list such as 8-15 or 2,4-6, got '8-x'"]
    beyond = max(os.sched_getaffinity(0)) + 1
    result, lines = _launch("--capture-dir", str(tmp_path), "--capture-writer-cpus", f"{beyond}-{beyond + 1}", "--model-path", "x")
    assert result.exit_code != 0 and len(lines) == 1
    assert lines[0].startswith(f"Error: --capture-writer-cpus names CPUs {beyond}-{beyond + 1} that this server may not use")


def test_gpu_codec_left_out_after_measurement_is_refused_naming_the_codecs_there_are(tmp_path):
    """nvCOMP's zstd was measured and left out (bench/RESULTS.md r43): asking for it gets one line."""
    result, lines = _launch("--capture-dir", str(tmp_path), "--capture-codec", "nvcomp-zstd", "--model-path", "x")
    assert result.exit_code != 0
    assert lines == ["Error: Invalid value for '--capture-codec': 'nvcomp-zstd' is not one of 'zstd', 'none'."]


def test_unsupported_sglang_version_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(gate, "installed_sglang_version", lambda: "0.4.9")
    result, lines = _launch("--capture-dir", str(tmp_path), "--model-path", "x")
    assert result.exit_code != 0
    assert lines == [f"Error: sglang_capture supports SGLang {', '.join(supported_versions())}; found 0.4.9. "
                     f"Install a supported release (pip install sglang=={supported_versions()[-1]})"]


def test_seam_table_fingerprints_match_installed_sglang():
    seams = gate.seams_for_installed()
    assert {s.seam for s in seams} >= {"set_capture_layers", "append_final_hidden", "mark_capture_request",
                                         "take_prefill_rows", "take_decode_rows", "seal_finished",
                                         "await_capture_file"}
    assert [gate.check_seam(s) for s in seams] == [None] * len(seams)


def test_changed_sglang_function_fails_loudly():
    seam = replace(load_table(gate.installed_sglang_version())[0], fingerprint="sha256:" + "0" * 64)
    assert "changed (fingerprint" in gate.check_seam(seam)
    probe = inst.CaptureInstrumentor()
    probe._instrumented = True
    with pytest.raises(gate.UnsupportedSGLang, match="refusing to patch"):
        probe._patch(seam)


def test_instrument_is_idempotent_binds_each_hook_to_its_process_state_and_uninstrument_restores(tmp_path):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor as P

    from sglang_capture.server.scheduler_capture import SchedulerCapture

    original_init, original_decode = Req.__dict__["__init__"], P.__dict__["_append_decode_hidden_states"]
    probe = inst.CaptureInstrumentor()
    config = CaptureConfig(capture_dir=str(tmp_path))
    probe.instrument(config, processes=("scheduler",))
    probe.instrument(config, processes=("scheduler",))
    try:
        assert isinstance(Req.__dict__["__init__"], wrapt.FunctionWrapper)
        state = Req.__dict__["__init__"]._self_wrapper.args[0]  # state passes explicitly, bound at install
        assert isinstance(state, SchedulerCapture) and state.config is config
        assert P.__dict__["_append_decode_hidden_states"]._self_wrapper.args[0] is state  # one per process
        assert not isinstance(Req.__dict__["__init__"].__wrapped__, wrapt.FunctionWrapper)  # wrapped once
        from sglang.srt.managers.tokenizer_manager import TokenizerManager  # an http-process seam: left alone
        assert not isinstance(TokenizerManager.__dict__["_wait_one_response"], wrapt.FunctionWrapper)
    finally:
        probe.uninstrument()
    assert Req.__dict__["__init__"] is original_init
    assert P.__dict__["_append_decode_hidden_states"] is original_decode


def test_doctor_reports_version_fingerprints_plugin_and_configuration():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "sglang_capture", "doctor"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"installed SGLang: {gate.installed_sglang_version()}" in r.stdout
    assert "supported SGLang: 0.5.17, 0.5.18, 0.5.19, 0.5.20, 0.5.21, 0.5.22, 0.5.23" in r.stdout
    version = gate.installed_sglang_version()
    assert f"seam table: {table_path(version)}" in r.stdout and table_path(version).endswith(f"sglang_{version.replace('.', '_')}.json")
    assert r.stdout.count("matches its fingerprint") == len(load_table(version)) == 24 and "FAIL" not in r.stdout
    assert "plugin entry point sglang.srt.plugins: sglang_capture" in r.stdout
    assert f"writers = auto ({CaptureConfig(capture_dir='.').writer_processes()} here)" in r.stdout and "max_pending_mb = 8192" in r.stdout


def test_doctor_and_the_launcher_help_label_every_unset_option_with_its_own_meaning(monkeypatch):
    """Each option's unset meaning is declared once in the option table; doctor shows the table's
    text for every option left out (it once called every one "model default (EAGLE-3 layers)")."""
    import dataclasses

    from click.testing import CliRunner

    from sglang_capture.core.config import ENV_VAR, shown_value
    from sglang_capture.server.launch import main
    from sglang_capture.tools.doctor import diagnose

    monkeypatch.delenv(ENV_VAR, raising=False)
    lines, _ = diagnose(seams=[])
    shown = dict(line.strip().split(" = ", 1) for line in lines if line.startswith("  "))
    unset = {f.name: f.metadata["option"]["unset"] for f in dataclasses.fields(CaptureConfig) if f.default is None}
    assert set(unset) == {"layers", "layers_from_draft", "level", "writer_cpus", "clients"}
    assert len(set(unset.values())) == len(unset)  # no two options share one meaning
    for f in dataclasses.fields(CaptureConfig):
        if f.name == "capture_dir":
            continue
        want = f"auto ({CaptureConfig(capture_dir='.').writer_processes()} here)" if f.name == "writers" else \
            shown_value(f.name, f.default)
        assert shown[f.name] == want, f.name
    assert shown["level"].startswith("entropy-first") and shown["writer_cpus"] == "the CPUs the server may use"
    help_text = " ".join(CliRunner().invoke(main, ["--help"]).output.split())
    for text in unset.values():
        assert f"[default: ({' '.join(text.split())})]" in help_text


def test_doctor_fails_on_a_changed_sglang_function():
    import dataclasses

    from sglang_capture.patches.version_gate import seams_for_installed
    from sglang_capture.tools.doctor import diagnose

    seams = seams_for_installed()
    seams[2] = dataclasses.replace(seams[2], fingerprint="sha256:" + "0" * 64)
    lines, ok = diagnose(seams)
    assert not ok
    assert any(line.startswith(f"FAIL {seams[2].seam}:") and "changed" in line for line in lines)


def _eagle3_draft(tmp_path, target: str, use_aux=True) -> str:
    """A draft's config.json (all the launcher and SGLang's argument parser read) for ``target``."""
    draft = tmp_path / ("draft" if use_aux else "draft-no-aux")
    draft.mkdir(exist_ok=True)
    cfg = json.load(open(os.path.join(target, "config.json")))
    cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, eagle_config={
        "eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": use_aux})
    (draft / "config.json").write_text(json.dumps(cfg))
    return str(draft)


def test_a_server_that_speculates_captures_its_drafts_layers_and_refuses_others(tiny_models, tmp_path):
    from types import SimpleNamespace

    from sglang_capture.core.config import ConfigError
    from sglang_capture.server.launch import speculative_layers

    draft = _eagle3_draft(tmp_path, tiny_models["tiny-llama"])
    spec = SimpleNamespace(speculative_algorithm="EAGLE3", speculative_draft_model_path=draft)
    config = CaptureConfig(capture_dir=str(tmp_path))
    # Llama's rule: ids [0, 1, 2] are the outputs of layers 0-2, the residual entering layers 1-3
    assert speculative_layers(spec, config, 4, "LlamaForCausalLM") == [1, 2, 3]
    assert speculative_layers(spec, replace(config, layers=[3, 1, 2]), 4, "LlamaForCausalLM") == [1, 2, 3]
    assert speculative_layers(SimpleNamespace(speculative_algorithm=None), config, 4, "LlamaForCausalLM") is None
    with pytest.raises(ConfigError, match="sets eagle_config.use_aux_hidden_state false"):
        no_aux = SimpleNamespace(speculative_algorithm="EAGLE3", speculative_draft_model_path=_eagle3_draft(
            tmp_path, tiny_models["tiny-llama"], use_aux=False))
        speculative_layers(no_aux, config, 4, "LlamaForCausalLM")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [0, 2]}}))
    with pytest.raises(ConfigError, match="^--capture-layers-from-draft asks for layers 1,3, but the served draft makes"):
        speculative_layers(spec, replace(config, layers_from_draft=str(other)), 4, "LlamaForCausalLM")
    with pytest.raises(ConfigError, match="needs --speculative-draft-model-path"):
        speculative_layers(SimpleNamespace(speculative_algorithm="EAGLE3", speculative_draft_model_path=None),
                           config, 4, "LlamaForCausalLM")
    result, lines = _launch("--capture-dir", str(tmp_path), "--capture-layers", "1,2", "--model-path",
                            tiny_models["tiny-llama"], "--device", "cpu", "--speculative-algorithm", "EAGLE3",
                            "--speculative-draft-model-path", draft)
    assert result.exit_code != 0
    assert lines == ["Error: --capture-layers asks for layers 1,2, but the served draft makes this server capture "
                     "layers 1,2,3; a server that speculates captures its draft's layers: drop --capture-layers"]


def test_pre_norm_capture_under_prefill_cuda_graphs_is_refused_at_start_in_one_line():
    """A prefill CUDA graph's replay runs no Python hook, so the final norm's input would be missing."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.cuda_graph_config import Backend

    from sglang_capture.core.config import CaptureConfig, ConfigError
    from sglang_capture.server.launch import check_final_state

    def args(prefill, **flags):
        return SimpleNamespace(cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(backend=prefill)), **flags)

    for final in ("pre-norm", "both"):
        config = CaptureConfig(capture_dir="/tmp", final=final)
        with pytest.raises(ConfigError, match=f"--capture-final {final} needs eager prefill: SGLang's prefill CUDA "
                                              r"graphs \(breakable\) .* add --disable-prefill-cuda-graph"):
            check_final_state(config, args(Backend.BREAKABLE))
        check_final_state(config, args(Backend.DISABLED))  # --disable-prefill-cuda-graph, or a CPU server
        check_final_state(config, SimpleNamespace(disable_prefill_cuda_graph=True))  # a release without the config
        with pytest.raises(ConfigError, match=r"CUDA graphs \(on\)"):
            check_final_state(config, SimpleNamespace(disable_prefill_cuda_graph=False))
    check_final_state(CaptureConfig(capture_dir="/tmp"), args(Backend.BREAKABLE))  # post-norm: the logits processor's input


def _has_sglang_aux_flag() -> bool:
    from sglang.srt.server_args import ServerArgs

    return hasattr(ServerArgs, "enable_return_aux_hidden_states")


@pytest.mark.skipif(not _has_sglang_aux_flag(), reason="SGLang before 0.5.23 has no --enable-return-aux-hidden-states")
@pytest.mark.parametrize("ids, hint", [
    ([0, 1, 2], "--capture-layers 1,2,3 captures the layers of --return-aux-hidden-state-layer-ids 0,1,2 on this "
                "LlamaForCausalLM"),
    (None, "choose them with --capture-layers"),  # SGLang's default ids on 4 layers repeat a layer: no equivalent
])
def test_sglangs_own_aux_capture_flags_are_refused_in_one_line_naming_the_same_layers(tiny_models, tmp_path, ids, hint):
    """Issue 52 item 3: SGLang 0.5.23's --enable-return-aux-hidden-states sets the captured layers through the
    same setter as capture and hands plain requests aux rows: the launcher refuses it, naming the
    --capture-layers that capture what SGLang would have (EAGLE-3 ids: the residual entering layer id + 1)."""
    extra = ["--return-aux-hidden-state-layer-ids", *map(str, ids)] if ids else []
    proc = subprocess.run([sys.executable, "-m", "sglang_capture.launch", "--capture-dir", str(tmp_path),
                           "--model-path", tiny_models["tiny-llama"], *device_args(), "--enable-return-aux-hidden-states",
                           "--speculative-algorithm", "EAGLE3", *extra], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "Error: capture sets the layers SGLang keeps itself: drop --enable-return-aux-hidden-states (and "
        f"--return-aux-hidden-state-layer-ids); {hint}")


def test_the_aux_flag_refusal_translates_eagle3_ids_per_architecture():
    """The same rule on every release, from the parsed arguments (``core/layers.sglang_layers_to_capture``'s
    mapping): Llama ids + 1; DeepSeek-V3 ids as given unless the first is 1."""
    from types import SimpleNamespace

    from sglang_capture.core.config import ConfigError
    from sglang_capture.server.launch import refuse_sglang_aux_capture

    def message(ids, arch, algorithm="EAGLE3"):
        args = SimpleNamespace(enable_return_aux_hidden_states=True, aux_hidden_state_capture=None,
                               speculative_algorithm=algorithm, return_aux_hidden_state_layer_ids=ids)
        with pytest.raises(ConfigError) as e:
            refuse_sglang_aux_capture(args, 61, arch)
        return str(e.value)

    assert message([2, 30, 58], "LlamaForCausalLM").endswith("--capture-layers 3,31,59 captures the layers of "
                                                             "--return-aux-hidden-state-layer-ids 2,30,58 on this LlamaForCausalLM")
    assert "--capture-layers 3,31,59 captures" in message([3, 31, 59], "DeepseekV3ForCausalLM")
    assert "--capture-layers 2,30,58 captures" in message([1, 29, 57], "DeepseekV3ForCausalLM")
    assert "--capture-layers 2,30,58 captures the layers of SGLang's default ids" in message(None, "DeepseekV3ForCausalLM")
    assert message([3, 31, 59], "LlamaForCausalLM", "DFLASH").endswith("choose them with --capture-layers")
    refuse_sglang_aux_capture(SimpleNamespace(), 61, "LlamaForCausalLM")  # 0.5.17-0.5.22: no such flag, nothing refused
