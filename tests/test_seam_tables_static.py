"""Every supported SGLang release's seam table (0.5.17 to 0.5.23) against that release's own source,
read from its wheel without installing it (patches/wheel_source.py), and every changed function's
record saying what changed. Needs PyPI: ``pip download --no-deps sglang==X`` for each release
(about 27 MB each, 7 releases, once: cached under ~/.cache/sglang-capture-tests/sglang-wheels);
with the cache warm these tests take well under a minute."""
from __future__ import annotations

import json

import pytest

from sglang_capture.patches import (
    BASE_RELEASES,
    Seam,
    Watched,
    key,
    load_table,
    load_watched,
    supported_versions,
    unexplained,
)
from sglang_capture.patches.wheel_source import WheelSource, fetch_wheel


def _changed(version, records):
    """One line per record whose function in ``version``'s wheel is not the one it fingerprints."""
    source = WheelSource(fetch_wheel(version))
    return [f"{r.module}.{r.target} changed in sglang {version} ({'seam' if isinstance(r, Seam) else 'watched'} "
            f"{key(r)})" for r in records if source.fingerprint(r.module, r.target) != r.fingerprint]


@pytest.mark.parametrize("version", supported_versions())
def test_every_patched_and_watched_function_of_a_supported_release_matches_its_table(version):
    changed = _changed(version, [*load_table(version), *load_watched(version)])
    assert not changed, "\n".join(changed)


def test_a_release_that_changes_a_layer_rule_fails_until_someone_reads_it():
    """Issue 34 item 6: a setter whose rule changed would make exported draft configs name layers
    SGLang does not capture. Its changed fingerprint fails the check above; recorded, it is refused
    until its note says the layer rule was read against it."""
    [setter] = [w for w in load_watched("0.5.20") if w.name == "deepseek_v2_eagle3_setter"]
    moved = Watched(**{**setter.__dict__, "fingerprint": "sha256:" + "0" * 64})
    assert _changed("0.5.20", [moved]) == [
        "sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.set_eagle3_layers_to_capture changed in sglang 0.5.20 "
        "(watched deepseek_v2_eagle3_setter)"]
    assert unexplained([moved]) == [
        "deepseek_v2_eagle3_setter: sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.set_eagle3_layers_to_capture "
        "differs from SGLang 0.5.17 and 0.5.23's and its record does not say how; read "
        "sglang_capture.core.layers:sglang_layers_to_capture against it and write its differs"]
    read = Watched(**{**moved.__dict__, "differs": "read core.layers:sglang_layers_to_capture: vs 0.5.17: ..."})
    assert unexplained([read]) == []


def test_every_supported_models_layer_setter_and_decoder_loop_is_watched_in_both_base_releases():
    """The setter that runs for each architecture the package supports (inherited or its own, as the
    installed SGLang resolves it; every release's setters have one module and name, the tables say
    so) and its inner model's forward are in the base releases' tables."""
    import importlib
    import inspect
    import warnings

    from sglang_capture.core.layers import SUPPORTED_ARCHITECTURES

    modules = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
               "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
               "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v2",
               "KimiK25ForConditionalGeneration": "kimi_k25"}
    assert set(modules) == set(SUPPORTED_ARCHITECTURES)
    for version in BASE_RELEASES:
        watched = {(w.module, w.target) for w in load_watched(version)}
        for arch, module in modules.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), arch)
            setter = inspect.unwrap(cls.set_eagle3_layers_to_capture)
            assert (setter.__module__, setter.__qualname__) in watched, (version, arch)
    inner = {w.target.split(".")[0] for w in load_watched("0.5.17") if w.target.endswith("Model.forward")}
    assert inner == {"LlamaModel", "Qwen2Model", "Qwen2MoeModel", "DeepseekV2Model"}  # Qwen3(-MoE) inherit theirs


def test_the_fingerprint_read_from_a_wheel_is_the_one_the_instrumentor_computes_installed():
    from sglang_capture.patches.version_gate import fingerprint, installed_sglang_version, resolve

    version = installed_sglang_version()
    source = WheelSource(fetch_wheel(version))
    for seam in load_table(version):
        _, _, original = resolve(seam)
        assert source.fingerprint(seam.module, seam.target) == fingerprint(original), seam.seam
    with pytest.raises(LookupError, match=r"^sglang.srt.managers.scheduler.Scheduler.no_such_method is not in sglang-"):
        source.fingerprint("sglang.srt.managers.scheduler", "Scheduler.no_such_method")


def test_every_release_from_0_5_17_to_0_5_23_is_supported():
    assert supported_versions() == tuple(f"0.5.{n}" for n in range(17, 24))


@pytest.mark.parametrize("version", supported_versions())
def test_every_function_unlike_both_base_releases_says_what_changed_and_why_its_hook_holds(version):
    records = [*load_table(version), *load_watched(version)]
    assert not unexplained(records), "\n".join(unexplained(records))
    if version in BASE_RELEASES:
        assert not any(r.differs for r in records)


def test_one_function_has_one_note_in_every_table_that_has_it():
    """refresh copies a note to an identical function, so every table is what refresh would write."""
    notes = {}
    for version in supported_versions():
        for r in [*load_table(version), *load_watched(version)]:
            assert notes.setdefault((key(r), r.fingerprint), r.differs) == r.differs, (version, key(r))


def test_a_changed_function_without_its_note_is_refused_with_one_line_naming_it():
    seam = next(s for s in load_table("0.5.20") if s.seam == "run_batch")
    assert seam.seam == "run_batch" and seam.differs
    bare = Seam(**{**seam.__dict__, "differs": ""})
    assert unexplained([bare]) == [
        "run_batch: sglang.srt.managers.scheduler.Scheduler.run_batch differs from SGLang 0.5.17 and 0.5.23's and its "
        "record does not say how; read hook sglang_capture.server.hooks.batch:run_batch against it and write its differs"]


def test_a_note_that_does_not_name_the_code_it_read_is_refused():
    """Any text used to pass (issue 34 item 8): a note must say which hook was read against the source."""
    seam = next(s for s in load_table("0.5.20") if s.seam == "run_batch")
    assert seam.differs.startswith("read server.hooks.batch:run_batch: ")
    vague = Seam(**{**seam.__dict__, "differs": "vs 0.5.17: bookkeeping only"})
    assert unexplained([vague]) == [
        "run_batch: sglang.srt.managers.scheduler.Scheduler.run_batch differs from SGLang 0.5.17 and 0.5.23's and its "
        "note does not name the code read against it; start it with 'read server.hooks.batch:run_batch: '"]


def test_refresh_writes_a_releases_table_and_names_each_hook_to_read_again(tmp_path, capsys):
    """0.5.17's wheel reproduces its table and 0.5.21's its own, notes included; 0.5.20 compared
    with the base releases only names each hook whose function changed, leaves their notes empty
    (the table is refused until they are written) and exits 3."""
    from sglang_capture.patches.refresh import main

    out = tmp_path / "t.json"
    for version in ("0.5.17", "0.5.20", "0.5.21"):
        assert main(["--from-wheel", version, "--out", str(out)]) == 0
        assert [Seam(**s) for s in json.load(open(out))["seams"]] == load_table(version)
        assert [Watched(**w) for w in json.load(open(out))["watched"]] == load_watched(version)
    capsys.readouterr()
    assert main(["--from-wheel", "0.5.20", "--against", "0.5.17,0.5.23", "--out", str(out)]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert "copy_hidden_to_pool: same as 0.5.23" in lines and "append_final_hidden: same as 0.5.17, 0.5.23" in lines
    assert ("run_batch: CHANGED in sglang.srt.managers.scheduler.Scheduler.run_batch; read hook "
            "sglang_capture.server.hooks.batch:run_batch against it, then say in its differs what changed and why "
            "the hook holds") in lines
    written = [Seam(**s) for s in json.load(open(out))["seams"]]
    assert {s.seam for s in written if not s.differs} == {s.seam for s in written}
    assert [line.split(":")[0] for line in unexplained(written)] == [
        line.split(":")[0] for line in lines if "CHANGED" in line and not line.startswith("watched ")]
    watched = [Watched(**w) for w in json.load(open(out))["watched"]]
    assert ["watched " + line.split(":")[0] for line in unexplained(watched)] == [
        line.split(":")[0] for line in lines if "CHANGED" in line and line.startswith("watched ")]
    assert "watched req_set_extend_range: same as 0.5.17" in lines  # gone from 0.5.22 on
    assert "watched copy_result_to_cpu: absent, as in 0.5.20" in lines  # new in 0.5.23
    with pytest.raises(SystemExit):
        main(["--from-wheel", "0.5.20", "--against", "0.5.16"])
    assert "--against 0.5.16: not a supported release" in capsys.readouterr().err


def test_refresh_says_missing_when_a_new_release_drops_a_watched_function_the_last_one_had(tmp_path, capsys,
                                                                                         monkeypatch):
    """A release past 0.5.23 without ``Scheduler._copy_result_to_cpu`` (the stream the copy hook
    runs on) is a change to read, not an absence to copy: exit 3, MISSING named."""
    from sglang_capture.patches import refresh, wheel_source

    real = wheel_source.WheelSource.fingerprint

    def without_copy_wrapper(self, module, target):
        if target == "Scheduler._copy_result_to_cpu":
            raise LookupError(f"{module}.{target} is not in the wheel")
        return real(self, module, target)

    newest = fetch_wheel("0.5.23")  # stands in for the new release's wheel, less that function
    monkeypatch.setattr(wheel_source.WheelSource, "fingerprint", without_copy_wrapper)
    monkeypatch.setattr(wheel_source, "fetch_wheel", lambda version, cache=None: newest)
    assert refresh.main(["--from-wheel", "0.5.24", "--out", str(tmp_path / "t.json")]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "MISSING" in line] == [
        "watched copy_result_to_cpu: MISSING (sglang.srt.managers.scheduler.Scheduler._copy_result_to_cpu is not in "
        "the wheel); sglang_capture.server.hooks.transfer:copy_hidden_to_pool needs a new target"]


def test_the_code_each_record_names_exists_in_the_package():
    """A hook or a relying function renamed in the package must not leave the tables naming nothing."""
    import importlib

    for version in supported_versions():
        for r in [*load_table(version), *load_watched(version)]:
            module, _, path = (r.hook if isinstance(r, Seam) else r.relied_on_by).partition(":")
            obj = importlib.import_module(module)
            for part in path.split("."):
                obj = getattr(obj, part)


def test_every_seam_is_named_after_its_hook_function_and_runs_in_the_http_or_a_scheduler_process():
    for version in supported_versions():
        for seam in load_table(version):
            assert seam.seam == seam.hook.rpartition(":")[2], (version, seam.seam, seam.hook)
            assert seam.process in ("http", "scheduler"), (version, seam.seam, seam.process)
