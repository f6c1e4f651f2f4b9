"""Drafter config ids in ``export --format specforge`` (fragment, ``--draft-config``) and the
launcher's ``--capture-layers-from-draft``: both go through core/layers.py's SGLang rule.
Synthetic capture files and drafter configs; no server."""
from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

import sglang_capture.core.format as fmt
from sglang_capture.core.config import ENV_VAR, CaptureConfig, ConfigError, config_from_options
from sglang_capture.core.final_state import POST_NORM, kept_states
from sglang_capture.core.final_state import TENSOR as FINAL_TENSOR
from sglang_capture.core.layers import layers_from_eagle3_ids
from sglang_capture.core.names import FILE_SUFFIX
from sglang_capture.server.launch import main as launch_main
from sglang_capture.server.launch import resolve_capture_layers
from sglang_capture.tools.cli import cli
from sglang_capture.tools.export_specforge import DRAFT_FRAGMENT_NAME, FILLED_DRAFT_CONFIG_NAME

H = 8
PUBLISHED_KIMI_DRAFT = {"architectures": ["LlamaForCausalLMEagle3"],
                        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True}}


def _captures(directory, layers, arch="KimiK25ForConditionalGeneration", num_layers=61, n=2, loss_mask=True,
              generated=2, first=0, final=None):
    """Capture files as the server writes them; ``final`` (``--capture-final``) None: a file written
    before that option, with the post-norm state and no ``final`` key."""
    os.makedirs(directory, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for k in range(first, first + n):
        P, G = 5, generated
        meta = {"rid": f"r{k}", "layers": layers, "layer_convention": "x", "hidden_size": H, "model": "m",
                "sglang_version": "0.5.17", "schema": fmt.SCHEMA, "architecture": arch, "num_layers": num_layers,
                "dtype": "bfloat16"}
        rows = fmt.row_count(P, G)
        tensors = {"input_ids": torch.arange(P, dtype=torch.int64), "output_ids": torch.arange(G, dtype=torch.int64),
                   "aux_hidden_states": torch.randn(rows, len(layers) * H, generator=g).to(torch.bfloat16)}
        if final is not None:
            meta["final"] = final
        for kind in kept_states(final or POST_NORM):
            tensors[FINAL_TENSOR[kind]] = torch.randn(rows, H, generator=g).to(torch.bfloat16)
        if loss_mask:
            tensors["loss_mask"] = torch.ones(P, dtype=torch.int64)
        with open(os.path.join(directory, f"s{k}{FILE_SUFFIX}"), "wb") as f:
            fmt.write_capture(f, meta, tensors, fmt.Codec())
    return str(directory)


def _draft(tmp_path, doc, name="draft"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(doc))
    return str(d / "config.json")


def _export(src, out, *extra):
    r = CliRunner().invoke(cli, ["export", "--format", "specforge", src, str(out), "--no-progress", *extra])
    errors = [line for line in r.output.splitlines() if line.startswith("Error")]
    return r, errors


def test_export_writes_and_prints_the_drafter_config_fragment_by_sglangs_rule(tmp_path):
    for arch, want in (("KimiK25ForConditionalGeneration", [3, 31, 59]), ("LlamaForCausalLM", [2, 30, 58])):
        out = tmp_path / f"sf-{arch}"
        r, _ = _export(_captures(tmp_path / arch, [3, 31, 59], arch), out)
        assert r.exit_code == 0, r.output
        fragment = json.loads((out / DRAFT_FRAGMENT_NAME).read_text())
        assert fragment == {"eagle_config": {"eagle_aux_hidden_state_layer_ids": want}}
        assert json.dumps(fragment) in r.output and str(out / DRAFT_FRAGMENT_NAME) in r.output
        assert layers_from_eagle3_ids(want, 61, arch) == [3, 31, 59]  # SGLang serving it captures the files' layers


def test_export_notes_deepseek_ids_reordered_because_ids_starting_at_1_are_shifted(tmp_path):
    out = tmp_path / "sf"
    r, _ = _export(_captures(tmp_path / "c", [1, 30, 58], "DeepseekV3ForCausalLM"), out)
    assert r.exit_code == 0, r.output
    ids = json.loads((out / DRAFT_FRAGMENT_NAME).read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [30, 1, 58] and layers_from_eagle3_ids(ids, 61, "DeepseekV3ForCausalLM") == [1, 30, 58]
    notes = [line for line in r.output.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "unsorted on purpose" in notes[0]


def test_export_says_in_one_line_when_no_drafter_ids_express_the_layers(tmp_path):
    out = tmp_path / "sf"
    r, _ = _export(_captures(tmp_path / "c", [0, 4, 8], "LlamaForCausalLM", num_layers=12), out)
    assert r.exit_code == 0, r.output  # the training files are still fine
    notes = [line for line in r.output.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "no drafter config fragment written" in notes[0] and "cannot capture layer 0" in notes[0]
    assert not (out / DRAFT_FRAGMENT_NAME).exists()


def test_export_refuses_a_draft_config_whose_layers_differ_in_one_line_before_writing(tmp_path):
    out = tmp_path / "sf"
    r, errors = _export(_captures(tmp_path / "c", [3, 31, 59]), out, "--draft-config",
                        _draft(tmp_path, PUBLISHED_KIMI_DRAFT))
    assert r.exit_code != 0 and len(errors) == 1, r.output
    assert "captures layers [2, 30, 58]" in errors[0] and "holds layers [3, 31, 59]" in errors[0]
    assert "--capture-layers-from-draft" in errors[0] and "Traceback" not in r.output
    assert not out.exists()  # nothing written


def test_export_accepts_a_draft_config_that_matches_and_says_so(tmp_path):
    out = tmp_path / "sf"
    draft = _draft(tmp_path, PUBLISHED_KIMI_DRAFT)
    r, _ = _export(_captures(tmp_path / "c", [2, 30, 58]), out, "--draft-config", os.path.dirname(draft))
    assert r.exit_code == 0, r.output
    assert f"--draft-config {draft} matches" in r.output
    assert len([f for f in os.listdir(out) if f.endswith(".ckpt")]) == 2
    assert not (out / FILLED_DRAFT_CONFIG_NAME).exists()  # its ids were given: nothing to fill in


def test_export_fills_in_the_ids_of_a_draft_config_without_them_by_sglangs_default(tmp_path):
    out = tmp_path / "sf"
    no_ids = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 7168, "eagle_config": {}}
    r, _ = _export(_captures(tmp_path / "c", [2, 30, 58]), out, "--draft-config", _draft(tmp_path, no_ids))
    assert r.exit_code == 0, r.output
    filled = json.loads((out / FILLED_DRAFT_CONFIG_NAME).read_text())
    assert filled["hidden_size"] == 7168 and filled["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    # SGLang's default without ids (2, L//2, L-3) is not the package's default capture (3, 31, 59)
    r, errors = _export(_captures(tmp_path / "d", [3, 31, 59]), tmp_path / "sf2", "--draft-config",
                        _draft(tmp_path, no_ids, "d2"))
    assert r.exit_code != 0 and len(errors) == 1 and "absent: SGLang's default" in errors[0]


def _config(tmp_path, *args):
    ctx = launch_main.make_context("launch", ["--capture-dir", str(tmp_path), *args, "--model-path", "m"])
    return config_from_options({k: v for k, v in ctx.params.items() if k != "sglang_args"})


def test_capture_layers_from_draft_takes_the_layers_sglang_captures_for_that_drafter(tmp_path):
    draft = _draft(tmp_path, PUBLISHED_KIMI_DRAFT)
    config = _config(tmp_path, "--capture-layers-from-draft", os.path.dirname(draft))
    assert config.layers is None and config.layers_from_draft == os.path.dirname(draft)
    for arch in ("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM", "LlamaForCausalLM"):
        assert resolve_capture_layers(config, 61, arch) == [2, 30, 58]
    llama = _draft(tmp_path, {"architectures": ["LlamaForCausalLMEagle3"],
                              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}, "llama")
    assert resolve_capture_layers(CaptureConfig(capture_dir=str(tmp_path), layers_from_draft=llama), 32,
                                  "LlamaForCausalLM") == [3, 16, 28]


def test_launcher_publishes_the_drafters_layers_to_the_schedulers_not_the_path(tiny_models, tmp_path, monkeypatch):
    """The schedulers resolve ``config.layers`` themselves: prepare must hand them the drafter's."""
    import sglang_capture.server.launch as launch

    monkeypatch.setenv(ENV_VAR, "")  # prepare overwrites it; monkeypatch removes it after the test
    draft = _draft(tmp_path, {"architectures": ["LlamaForCausalLMEagle3"],
                              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}})
    config = CaptureConfig(capture_dir=str(tmp_path), layers_from_draft=draft)
    _, returned, _ = launch.prepare(config, ["--model-path", tiny_models["tiny-dsv3"], "--device", "cpu"])
    published = CaptureConfig.from_env()
    assert published == returned
    assert published.layers == [2, 3] and published.layers_from_draft is None  # DeepSeek: ids [1, 2] -> 2, 3


def test_capture_layers_and_capture_layers_from_draft_exclude_each_other_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="--capture-layers and --capture-layers-from-draft exclude each other"):
        _config(tmp_path, "--capture-layers", "3,31,59", "--capture-layers-from-draft", str(tmp_path))
    r = CliRunner().invoke(launch_main, ["--capture-dir", str(tmp_path), "--capture-layers", "3",
                                         "--capture-layers-from-draft", str(tmp_path), "--model-path", "m"])
    errors = [line for line in r.output.splitlines() if line.startswith("Error")]
    assert r.exit_code != 0 and len(errors) == 1 and "exclude each other" in errors[0], r.output


@pytest.mark.parametrize("doc, why", [
    (None, "does not exist; give the drafter's config.json"),
    ("{oops", "is not a readable JSON config"),
    ({"architectures": ["KimiK25ForConditionalGeneration"]}, "is not an EAGLE-3 drafter config"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": "1,29,57"}}, "must be a non-empty list of integers"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 60]}}, r"capture layers \[2, 30, 61\].*only 0..60 exist"),
])
def test_capture_layers_from_draft_bad_file_or_ids_is_one_actionable_line(tmp_path, doc, why):
    path = tmp_path / "config.json"
    if doc is not None:
        path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    config = CaptureConfig(capture_dir=str(tmp_path), layers_from_draft=str(path))
    with pytest.raises(ConfigError, match=why) as e:
        resolve_capture_layers(config, 61, "KimiK25ForConditionalGeneration")
    assert "\n" not in str(e.value) and str(e.value).startswith("--capture-layers-from-draft ")


def test_export_of_files_without_a_loss_mask_trains_on_answers_only_or_every_token_as_asked(tmp_path):
    plain = _captures(tmp_path / "plain", [3, 31, 59], n=1, loss_mask=False)  # as the operator captures a request
    r, errors = _export(plain, tmp_path / "refused")
    assert r.exit_code == 1 and len(errors) == 1 and "--answers-only" in errors[0] and "--all-tokens" in errors[0]
    masks = {}
    for flag in ("--answers-only", "--all-tokens"):
        r, _ = _export(plain, tmp_path / flag, flag)
        assert r.exit_code == 0, r.output
        masks[flag] = torch.load(tmp_path / flag / "s0.ckpt")["loss_mask"].tolist()
    assert masks["--answers-only"] == [0, 0, 0, 0, 0, 1]  # 5 prompt tokens, the one generated token fed back
    assert masks["--all-tokens"] == [1] * 6
    _captures(tmp_path / "plain", [3, 31, 59], n=1, loss_mask=False, generated=1, first=1)  # answered in one token
    _captures(tmp_path / "plain", [3, 31, 59], n=1, generated=2, first=2)  # a request that sent its mask: kept
    r, _ = _export(plain, tmp_path / "mixed", "--answers-only")
    assert r.exit_code == 0 and "1 SpecForge samples written" not in r.output, r.output
    assert "2 SpecForge samples written" in r.output and "1 without a generated token to train on left out" in r.output
    assert sorted(os.listdir(tmp_path / "mixed")) == ["eagle3_draft_config_fragment.json", "s0.ckpt", "s2.ckpt"]
    assert torch.load(tmp_path / "mixed" / "s2.ckpt")["loss_mask"].tolist() == [1] * 6  # its own mask, not zeros
    r, errors = _export(plain, tmp_path / "both", "--answers-only", "--all-tokens")
    assert r.exit_code == 1 and errors == ["Error: --all-tokens and --answers-only exclude each other: pick one for "
                                           "files without a loss mask"]
    assert not (tmp_path / "both").exists()
