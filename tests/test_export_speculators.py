"""``export --format speculators`` and ``--capture-final`` offline: which files it takes, what it
says, what ``load()`` and ``inspect`` show of the final state. Synthetic capture files; no server
(speculators' own check of an export from a real server: test_e2e_llama.py)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

import sglang_capture
from sglang_capture.core.config import CaptureConfig, ConfigError
from sglang_capture.tools.cli import cli
from tests.test_export_draft_config import _captures


def _export(src, out, *extra):
    return CliRunner().invoke(cli, ["export", "--format", "speculators", src, str(out), "--no-progress", *extra])


def test_post_norm_files_are_refused_in_one_line_and_nothing_is_written(tmp_path):
    for final in (None, "post-norm"):  # written before --capture-final, and with its default
        src = _captures(tmp_path / f"src-{final}", [3, 31, 59], final=final)
        r = _export(src, tmp_path / f"out-{final}")
        assert r.exit_code == 1 and r.output.count("\n") == 1, r.output
        assert "holds no pre-norm final state (final: post-norm), and speculators trains on the state before the " \
               "final norm; capture with --capture-final pre-norm or both" in r.output
        assert not (tmp_path / f"out-{final}").exists()


def test_pre_norm_files_export_with_the_trainers_layer_flag_and_load_shows_which_final_state(tmp_path):
    src = _captures(tmp_path / "src", [3, 31, 59], n=3, final="both", loss_mask=False)
    d = sglang_capture.load(tmp_path / "src" / "s0.capture.msgpack")
    assert d["final"] == "both" and d["last_hidden_states"].shape == d["last_hidden_states_pre_norm"].shape == (6, 8)
    assert _export(src, tmp_path / "refused").exit_code == 1  # no loss mask: --all-tokens or --answers-only
    r = _export(src, tmp_path / "out", "--answers-only")
    assert r.exit_code == 0, r.output
    assert "3 speculators samples in" in r.output and "train with: --data-path" in r.output
    assert "--target-layer-ids 3 31 59" in r.output
    hs = load_file(str(tmp_path / "out" / "hidden_states" / "hs_2.safetensors"))
    assert hs["hidden_states"].shape == (6, 4, 8) and hs["token_ids"].tolist() == [0, 1, 2, 3, 4, 0]
    from datasets import load_from_disk

    ds = load_from_disk(str(tmp_path / "out"))
    assert ds[2]["loss_mask"].tolist() == [0, 0, 0, 0, 0, 1] and ds[2]["seq_len"].item() == 6
    r = CliRunner().invoke(cli, ["export", "--format", "speculators", src, str(tmp_path / "o2"), "--draft-config", "x"])
    assert r.exit_code == 2 and "--draft-config checks a SpecForge/SGLang drafter config" in r.output


def test_inspect_shows_the_final_state_of_old_and_new_files(tmp_path):
    _captures(tmp_path / "old", [3, 31, 59], n=1)
    _captures(tmp_path / "new", [3, 31, 59], n=1, final="pre-norm")
    for name, want in (("old", "post-norm"), ("new", "pre-norm")):
        r = CliRunner().invoke(cli, ["inspect", str(tmp_path / name / "s0.capture.msgpack")])
        assert r.exit_code == 0 and ["final", want] in [line.split() for line in r.output.splitlines()], r.output
    assert sglang_capture.load(tmp_path / "old" / "s0.capture.msgpack")["final"] == "post-norm"


def test_capture_final_choices_and_the_keep_last_conflict_are_one_line_errors():
    assert CaptureConfig(capture_dir="/tmp", final="both").final == "both"
    with pytest.raises(ConfigError, match="--capture-final must be one of post-norm, pre-norm, both, got 'pre'"):
        CaptureConfig(capture_dir="/tmp", final="pre")
    with pytest.raises(ConfigError, match="--capture-final pre-norm keeps a final hidden state and "
                                          "--capture-no-keep-last drops it"):
        CaptureConfig(capture_dir="/tmp", final="pre-norm", keep_last_hidden=False)


def test_a_rerun_skips_what_it_wrote_rewrites_what_changed_and_never_leaves_a_stale_dataset(tmp_path):
    out = tmp_path / "out"
    src = _captures(tmp_path / "a", [3, 31, 59], n=2, final="pre-norm")
    assert _export(src, out).exit_code == 0
    (out / "d2t-100.npy").write_bytes(b"x")  # the draft vocabulary speculators' trainer cached from token_freq.pt
    (out / "t2d-100.npy").write_bytes(b"x")
    r = _export(src, out)
    assert "(0 written, 2 already there)" in r.output and (out / "d2t-100.npy").exists()  # same tokens: kept
    # the same sample names captured again on other layers: rewritten, never taken for the old ones
    src = _captures(tmp_path / "b", [2, 30], n=2, final="both", generated=3)
    r = _export(src, out)
    assert "(2 written, 0 already there)" in r.output and "--target-layer-ids 2 30" in r.output
    assert load_file(str(out / "hidden_states" / "hs_0.safetensors"))["hidden_states"].shape == (7, 3, 8)
    assert not (out / "d2t-100.npy").exists() and not (out / "t2d-100.npy").exists()  # the tokens changed
    # a post-norm file among them: refused in one line, and no dataset is left to pair with the new hs files
    _captures(tmp_path / "b", [2, 30], n=1, first=5)
    r = _export(src, out)
    assert r.exit_code == 1 and "s5.capture.msgpack: holds no pre-norm final state" in r.output
    assert not (out / "state.json").exists() and not list(out.glob("data-*.arrow"))


def test_specforge_refuses_pre_norm_only_files_and_verify_checks_the_final_states_a_file_says_it_holds(tmp_path):
    from sglang_capture.tools.verify import check_tensors

    src = _captures(tmp_path / "src", [3, 31, 59], n=1, final="pre-norm")
    r = CliRunner().invoke(cli, ["export", "--format", "specforge", src, str(tmp_path / "sf"), "--no-progress"])
    assert r.exit_code == 1 and "holds only the pre-norm final state (--capture-final pre-norm) and SpecForge trains " \
                               "on the post-norm one; capture with --capture-final post-norm or both" in r.output
    d = sglang_capture.load(tmp_path / "src" / "s0.capture.msgpack")
    assert check_tensors(d) == []
    del d["last_hidden_states_pre_norm"]
    assert check_tensors(d) == ["no last_hidden_states_pre_norm tensor (the file says it holds it)"]
    d["final"] = "pre"
    assert check_tensors(d) == ["metadata final is 'pre', not one of post-norm, pre-norm, both"]


def test_a_smaller_rerun_removes_the_hs_files_and_scratch_dirs_it_no_longer_owns(tmp_path):
    out = tmp_path / "out"
    assert _export(_captures(tmp_path / "three", [3, 31, 59], n=3, final="pre-norm"), out).exit_code == 0
    (out / ".dataset-killed").mkdir()  # the scratch dir of a run killed while it saved the dataset
    assert _export(_captures(tmp_path / "two", [3, 31, 59], n=2, final="pre-norm"), out).exit_code == 0
    assert sorted(p.name for p in (out / "hidden_states").iterdir()) == ["hs_0.safetensors", "hs_1.safetensors"]
    assert not (out / ".dataset-killed").exists()


def test_a_file_whose_metadata_claims_the_pre_norm_state_it_lacks_is_one_line(tmp_path):
    import sglang_capture.core.format as fmt
    from sglang_capture.core.reader import read_bytes

    src = _captures(tmp_path / "src", [3, 31, 59], n=1, final="pre-norm")
    path = tmp_path / "src" / "s0.capture.msgpack"
    meta, _ = fmt.read_records(read_bytes(str(path)))
    d = sglang_capture.load(path)
    tensors = {k: d[k] for k in ("input_ids", "output_ids", "loss_mask", "aux_hidden_states")}
    with open(path, "wb") as f:  # the tensor dropped, the metadata unchanged
        fmt.write_capture(f, meta, tensors, fmt.Codec())
    r = _export(src, tmp_path / "out")
    assert r.exit_code == 1 and r.output.count("\n") == 1
    assert "says it holds last_hidden_states_pre_norm but has no such tensor; check it with sglang-capture verify" \
        in r.output
