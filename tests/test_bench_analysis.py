"""The benchmarks' analysis: what bench/RESULTS.md's verdicts and attributions are computed from.

The GPU runs themselves happen on the lent H200 (bench/e2e.sh, writer.sh, gpu_deploy.sh, drafter.sh,
vs_specforge.sh); these check, on recorded or synthetic measurements, that a missed target names its
bottleneck from the data and that py-spy samples are attributed to the right frames; and that
RESULTS.md stays the current picture: short, every raw record it names present.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time

import e2e_report
import pyspy_summary
import pytest


def _window(others_tok_s, gpu, thread, host, writers=0.0):
    return {"tok": others_tok_s, "_gpu": {"util_pct": gpu},
            "_cpu": {"scheduler_top_threads_cores": [thread, 0.0], "host_busy_pct": host, "writer_processes_cores": writers}}


def _mode(windows, capture_ok=0):
    seconds = 10.0 * len(windows)
    tokens = sum(w["tok"] for w in windows) * 10.0
    kind = lambda toks, ok: {"requests": 10, "failed": 0, "capture_ok": ok, "tokens": toks, "seconds": seconds,
                             "tok_per_s": toks / seconds, "p50_s": 0.1, "p99_s": 0.5, "bytes_on_disk": 1 if ok else 0}
    return {"_gpu": [w["_gpu"] for w in windows], "_cpu": [w["_cpu"] for w in windows], "_peak_rss_bytes": 0,
            "_windows": [w["tok"] for w in windows], "mixed-other": kind(tokens, 0),
            "mixed-capture": kind(25600.0 * seconds, capture_ok)}


def _results(a_windows, d_windows, pyspy=None):
    res = {"config": {"tokens": 2048, "bytes_per_token_raw": 57344, "capture_rate": 12.5, "variants": []},
           "a_mixed": _mode(a_windows), "d_mixed": _mode(d_windows, capture_ok=250)}
    if pyspy:
        res["pyspy"] = pyspy
    return res


def test_a_missed_mixed_target_names_the_scheduler_thread_with_the_windows_measurements():
    a = [_window(500_000, 60, 0.87, 11), _window(480_000, 58, 0.88, 10)]
    d = [_window(430_000, 52, 0.83, 41, writers=4.8)]
    spy = {"d_mixed": {"main_on_cpu_pct": 88.9, "other_threads_cpu_pct": {},
                       "frames": {"[sglang_capture]": {"wall_pct": 1.6, "cpu_pct": 1.4}}}}
    lines = e2e_report.report(_results(a, d, spy)).splitlines()
    verdict = next(i for i, l in enumerate(lines) if l.startswith("mixed load, capture stream"))
    assert lines[verdict].endswith("MISS") and "(d)/(a) = 0.878" in lines[verdict]
    why = lines[verdict + 1]
    assert why.startswith("  bottleneck: SGLang's scheduler thread (GPU 59% busy in (a), 52% in (d); "
                          "scheduler thread 0.88 / 0.83 cores); the writer processes used 4.8 cores beside it "
                          "(host 10% -> 41% busy); the package's own code took 1.6% of the scheduler thread's wall time")
    assert "bench/RESULTS.md, r27" in why


def test_a_busy_gpu_is_named_as_the_bottleneck_and_a_met_target_needs_no_explanation():
    busy = e2e_report.mixed_bottleneck(_mode([_window(100, 95, 0.6, 9)]), _mode([_window(90, 96, 0.6, 30, 5.0)]))
    assert busy.startswith("bottleneck: the GPU (GPU 95% busy") and "interference" not in busy
    met = e2e_report.report(_results([_window(500_000, 60, 0.87, 11)] * 2, [_window(490_000, 60, 0.87, 40, 4.0)]))
    assert "(>= 0.95): PASS" in met and "bottleneck" not in met
    assert e2e_report.mixed_bottleneck({}, {}).startswith("bottleneck: not measured")


def _raw(path, lines):
    path.write_text("".join(f"{stack} {n}\n" for stack, n in lines))
    return pyspy_summary.load(str(path))


LOOP = ("thread (1): MainThread;run_scheduler_process (/x/site-packages/sglang/srt/managers/scheduler.py:1);"
        "Scheduler.event_loop_overlap (/x/site-packages/sglang/srt/managers/scheduler.py:2)")
WRAPPED = LOOP + ";run_batch (/tmp/sc/sglang_capture/server/hooks/batch.py:3);Scheduler.run_batch (/opt/sglang/srt/managers/scheduler.py:4)"


def test_pyspy_samples_split_wall_time_into_key_frames_and_the_packages_own_code(tmp_path):
    every = _raw(tmp_path / "all.txt", [
        (WRAPPED + ";TpModelWorker.forward_batch_generation (/opt/sglang/srt/managers/tp_worker.py:5)", 50),  # SGLang under our wrapper
        (WRAPPED + ";copy_hidden_to_pool (/tmp/sc/sglang_capture/server/hooks/transfer.py:6);"
                   "Event.record (/t/torch/cuda/streams.py:7)", 10),
        (LOOP + ";Event.synchronize (/t/site-packages/torch/cuda/streams.py:8)", 40),
        ("thread (2): sglang-capture-handoff-0;_run (/tmp/sc/sglang_capture/server/writer_pool.py:9)", 100),
        ("thread (3): sglang-capture-handoff-1;_run (/tmp/sc/sglang_capture/server/writer_pool.py:9)", 100),
    ])
    active = _raw(tmp_path / "active.txt", [
        (WRAPPED + ";TpModelWorker.forward_batch_generation (/opt/sglang/srt/managers/tp_worker.py:5)", 48),
        (WRAPPED + ";copy_hidden_to_pool (/tmp/sc/sglang_capture/server/hooks/transfer.py:6);"
                   "Event.record (/t/torch/cuda/streams.py:7)", 10),
        ("thread (2): sglang-capture-handoff-0;_run (/tmp/sc/sglang_capture/server/writer_pool.py:9)", 3),
        ("thread (3): sglang-capture-handoff-1;_run (/tmp/sc/sglang_capture/server/writer_pool.py:9);"
         "Event.synchronize (/t/site-packages/torch/cuda/streams.py:8)", 2),
    ])
    s = pyspy_summary.summarize(active, every, seconds=1.0, rate=100)
    assert s["samples"] == 100 and s["sampled_pct_of_expected"] == 100.0 and s["main_on_cpu_pct"] == 58.0
    f = s["frames"]
    assert f["event_loop_overlap"] == {"wall_pct": 100.0, "cpu_pct": 58.0}
    assert f["run_batch"]["wall_pct"] == 60.0 and f["forward_batch_generation"]["wall_pct"] == 50.0
    assert f["[sglang_capture]"] == {"wall_pct": 10.0, "cpu_pct": 10.0}  # its own code, not SGLang's under its wrapper
    assert f["synchronize"] == {"wall_pct": 40.0, "cpu_pct": 0.0}  # waiting for the GPU is off the CPU
    assert s["other_threads_cpu_pct"] == {"sglang-capture-handoff-*": 5.0}
    assert s["other_threads_top"]["sglang-capture-handoff-*"] == [  # where the hand-off threads' CPU went
        {"leaf": "_run (/tmp/sc/sglang_capture/server/writer_pool.py)", "cpu_pct": 3.0},
        {"leaf": "Event.synchronize (torch/cuda/streams.py)", "cpu_pct": 2.0}]
    assert s["leaves_top"][0]["leaf"] == "TpModelWorker.forward_batch_generation (sglang/srt/managers/tp_worker.py)"
    table = pyspy_summary.rows({"d_mixed": s, "a_mixed": {"error": "no py-spy executable"}})
    assert any(r.startswith("| d_mixed | 58.0 |") for r in table) and any("no py-spy executable" in r for r in table)


def test_pyspy_diff_gives_microseconds_per_batch_and_the_packages_own_code_by_hook_without_its_gpu_waits(tmp_path):
    """Two windows of 100 samples each at 10 batches a second (1 ms a sample per batch): the capture
    window's 20 samples in the copy hook are its own code (20 ms a batch, the hook SGLang called last); the 30
    it spends in a GPU wait that ``batch_result_context`` times for SGLang are not, though no SGLang
    frame lies between. A wait the package makes for itself (a job's copies) stays its own."""
    forward = WRAPPED + ";TpModelWorker.forward_batch_generation (/opt/sglang/srt/managers/tp_worker.py:5)"
    capture = _raw(tmp_path / "capture.txt", [
        (forward, 50),
        (WRAPPED + ";copy_hidden_to_pool (/tmp/sc/sglang_capture/server/hooks/transfer.py:6);"
                   "Event.record (/t/torch/cuda/streams.py:7)", 20),
        (LOOP + ";batch_result_context (/tmp/sc/sglang_capture/server/hooks/results.py:9);"
                "SeamClock.timed (/tmp/sc/sglang_capture/server/seam_clock.py:2);"
                "Event.synchronize (/t/site-packages/torch/cuda/streams.py:8)", 30)])
    none = _raw(tmp_path / "none.txt", [(forward, 50), (LOOP + ";Event.synchronize (/t/site-packages/torch/cuda/streams.py:8)", 50)])
    d = pyspy_summary.diff(capture, 10.0, none, 10.0)
    assert pyspy_summary.summarize(capture, capture, 1.0, 100)["frames"]["[sglang_capture]"]["wall_pct"] == 20.0
    own_wait = _raw(tmp_path / "own_wait.txt", [(LOOP + ";post_block_events (/tmp/sc/sglang_capture/server/hooks/prefix.py:1);"
                                                        "describe_chunks (/tmp/sc/sglang_capture/core/handoff.py:3);"
                                                        "Event.synchronize (/t/site-packages/torch/cuda/streams.py:8)", 1)])
    assert pyspy_summary.summarize(own_wait, own_wait, 1.0, 1)["frames"]["[sglang_capture]"]["wall_pct"] == 100.0
    assert d["us_per_batch"] == [100_000, 100_000]
    assert d["own_by_hook"] == {"copy_hidden_to_pool": [20_000, 0]}  # the wait is not the package's
    frames = {f["frame"]: f for f in d["frames"]}
    assert frames["copy_hidden_to_pool (/tmp/sc/sglang_capture/server/hooks/transfer.py)"]["delta"] == 20_000
    assert frames["Event.synchronize (torch/cuda/streams.py)"]["us"] == [30_000, 50_000]
    assert frames["TpModelWorker.forward_batch_generation (sglang/srt/managers/tp_worker.py)"]["delta"] == 0


@pytest.mark.parametrize("text,cpus", [("8-11", [8, 9, 10, 11]), ("0,2-3", [0, 2, 3])])
def test_the_writer_cpu_list_is_parsed_as_the_kernel_writes_it(text, cpus):
    from sglang_capture.core.config import parse_cpu_list

    assert parse_cpu_list(text) == cpus


BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def test_the_serialization_benchmark_times_every_path_on_the_cpu(tmp_path):
    import json
    import subprocess

    out = tmp_path / "serialization.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "serialization.py"), "--tokens", "16", "--hidden", "64",
                           "--repeat", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.load(open(out))["rows"]
    paths = {r["path"] for r in rows}
    assert {"sglang-json", "msgpack-raw", "zstd-1+shuffle"} <= paths
    raw = next(r for r in rows if r["path"] == "msgpack-raw")
    assert 4 * 64 * 2 <= raw["bytes_per_token"] < 4 * 64 * 2 * 1.5  # the bf16 bytes plus the file's framing
    assert "sglang-json" in proc.stdout and "zstd-1+shuffle" in proc.stdout  # the markdown table
    fp8 = next(r for r in rows if r["path"] == "fp8-raw")  # e4m3 bytes plus one float32 scale per vector
    assert 4 * 64 + 4 * 4 <= fp8["bytes_per_token"] < raw["bytes_per_token"] * 0.6 and fp8["min_row_cos"] >= 0.999


def test_the_e2e_benchmark_runs_the_mixed_load_on_cpu_servers_and_checks_its_target(tiny_models, tmp_path):
    """The GPU benchmark's own code path, end to end on two real CPU servers (numbers meaningless here),
    with a per-request variant (FP8) measured in its own windows on the same capture server, and the
    radix-cache windows: its usual prompts never read the cache (counted from the server's log), a
    shared prefix does, except in capture requests (their private namespace)."""
    import json
    import subprocess

    out = tmp_path / "e2e"
    cmd = [sys.executable, os.path.join(BENCH, "e2e.py"), tiny_models["tiny-dsv3"], str(out), "--tokens", "64",
           "--concurrency", "4", "--seconds", "2", "--capture-rate", "2", "--phases", "capture_ab,prefix_ab,capacity,mixed",
           "--mixed-rounds", "1", "--ab-rounds", "1",
           "--mixed-rates", "2", "--client-procs", "2", "--capture-dir", str(tmp_path / "caps"),
           "--capture-args", "--capture-layers 1,2,3 --capture-writers 2", "--request-variants", '{"capture_dtype": "fp8"}',
           "--sglang-args", "--device cpu --attention-backend torch_native --max-total-tokens 4096 --skip-server-warmup "
                            "--max-running-requests 8 --sleep-on-idle"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.load(open(out / "e2e.json"))
    d = res["d_mixed"]["mixed-capture"]
    assert d["requests"] > 0 and d["failed"] == 0 and d["capture_ok"] == d["requests"] and d["bytes_on_disk"] > 0
    assert res["a_mixed"]["mixed-capture"]["capture_ok"] == 0  # plain SGLang's stream captures nothing
    assert len(res["a_mixed"]["_windows"]) == 2 and len(res["d_mixed"]["_windows"]) == 1  # (a) on both sides of (d)
    assert res["d_mixed"]["_scheduler_thread"]["run_batch/extend/capture"]["calls"] > 0
    assert res["d_prefill"]["capture"]["capture_ok"] == res["d_prefill"]["capture"]["requests"] > 0
    assert res["b_prefill"]["prefill"]["capture_ok"] == 0 and len(res["capture_ab_windows"]) == 1
    # the variant's windows: every capture ok, and FP8 files hold fewer bytes per captured request
    fp8_ab, fp8_mixed = res["d_prefill_r0"]["capture"], res["d_mixed_r0"]["mixed-capture"]
    assert fp8_ab["capture_ok"] == fp8_ab["requests"] > 0 and fp8_mixed["capture_ok"] == fp8_mixed["requests"] > 0
    bf16_ab = res["d_prefill"]["capture"]
    assert fp8_ab["bytes_on_disk"] / fp8_ab["capture_ok"] < bf16_ab["bytes_on_disk"] / bf16_ab["capture_ok"]
    assert len(res["capture_ab_windows"][0]) == 3
    assert 'every request capturing with {"capture_dtype": "fp8"}: / nothing capturing' in proc.stdout
    assert any(l.startswith('mixed load [{"capture_dtype": "fp8"} per request], capture stream') for l in proc.stdout.splitlines())
    assert "every request capturing / nothing capturing" in proc.stdout
    batches = {name: r["_prefill_batches"][0] for name, r in res["prefix_ab"].items()}
    assert all(b["batches"] > 0 for b in batches.values())
    # the premise: no capture request reads the cache (the shared prefix is below what sharing reuses,
    # server/shared_rows.MIN_REUSE_ROWS), nor a request of the usual prompts
    for name in ("b_prefill", "d_prefill", "d_prefill_shared"):
        assert batches[name]["cached_tokens"] == 0 and batches[name]["batches_with_cached"] == 0, name
    assert batches["b_prefill_shared"]["batches_with_cached"] > 0  # every request after the first reads 1 token
    assert all(w["cached_tokens"] == 0 for m in ("b_prefill", "d_prefill", "d_prefill_r0") for w in res[m]["_prefill_batches"])
    assert "radix-cache hits in prefill windows" not in proc.stdout and "no 'Prefill batch' lines" not in proc.stdout
    assert res["d_file_capture"]["_prefill_batches"]["cached_tokens"] == 0  # one window, reported unmerged
    assert any(l.startswith("prefix_ab, a shared prefix / the usual prompts: nothing capturing") for l in proc.stdout.splitlines())
    verdict = next(l for l in proc.stdout.splitlines() if l.startswith("mixed load, capture stream 128 tok/s"))
    assert verdict.endswith(("PASS", "MISS"))
    assert verdict.endswith("PASS") or "  bottleneck: " in proc.stdout


def test_the_writer_benchmark_compares_dtypes_and_checksums_on_the_cpu(tmp_path):
    """bench/writer.py's dtype and checksum axes: the same rows through the real writer pool as
    bf16 and as the server's packed FP8 rows, hashed with each checksum; every file written, FP8
    smaller on disk, writer CPU accounted."""
    import json
    import subprocess

    out = tmp_path / "writer.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "writer.py"), str(out), "--tokens", "128", "--hidden", "128",
                           "--files", "4", "--threads", "1", "--codecs", "zstd+shuffle", "--gil-hog", "0",
                           "--dtypes", "model,fp8", "--checksums", "xxh3_128,sha256", "--dir", str(tmp_path / "w")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.load(open(out))
    runs = {(r["dtype"], r["checksum"]): r for r in res["runs"]}
    assert set(runs) == {(d, c) for d in ("model", "fp8") for c in ("xxh3_128", "sha256")}
    assert all(r["failed"] == 0 for r in runs.values())
    assert runs["fp8", "sha256"]["disk_bytes_per_token"] < runs["model", "sha256"]["disk_bytes_per_token"]
    assert runs["fp8", "xxh3_128"]["writer_cores_per_gb_s"] >= 0 and "| fp8 | zstd+shuffle | sha256 |" in proc.stdout
    assert {"xxh3_128_of_compressed", "sha256_of_compressed"} <= set(res["stage_rates_gb_per_s"])


def test_the_fp8_benchmark_compares_each_request_captured_in_bf16_and_fp8_row_for_row(tiny_models, tmp_path):
    """bench/gpu_fp8.py on a real CPU server: every prompt captured in the model's dtype and in FP8,
    each row within the FP8 bar, FP8 files smaller, every block of every row counted."""
    import json
    import subprocess

    out = tmp_path / "fp8"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_fp8.py"), tiny_models["tiny-dsv3"], str(out),
                           "--prompts", "3", "--max-tokens", "96", "--server-args",
                           "--device cpu --attention-backend torch_native --max-total-tokens 4096 --skip-server-warmup "
                           "--sleep-on-idle"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.load(open(out / "gpu_fp8.json"))
    assert res["prompt_tokens"] == [32, 64, 96]
    assert set(res["blocks"]) == {"aux_layer_1", "aux_layer_2", "aux_layer_3", "final"}
    assert all(b["rows"] == 192 and b["min_cos"] >= 0.999 and b["rows_below_0.999"] == 0 for b in res["blocks"].values())
    sizes = res["bytes_per_token"]
    assert sizes["fp8"]["before_compression"] < sizes["model"]["before_compression"]
    assert res["checks"]["every_row_cos_ge_0.999"] and res["checks"]["fp8_smaller_than_model_dtype"]
    assert proc.stdout.splitlines()[-1].startswith("PASS every row cos >= 0.999")


def test_drafter_acceptance_is_the_mean_over_requests_of_completion_tokens_per_verify_step():
    import drafter_run

    metas = [{"completion_tokens": 30, "spec_verify_ct": 20}, {"completion_tokens": 10, "spec_verify_ct": 4}]
    assert drafter_run.acceptance(metas) == {"mean_acceptance_length": 2.0, "token_weighted_acceptance_length": 1.6667,
                                             "verify_steps": 24}
    assert drafter_run.acceptance([{"completion_tokens": 30}]) == {}  # served without a draft


def test_drafter_verdicts_apply_issue_27_bars_to_the_recorded_run_and_catch_a_shortfall():
    import drafter_run

    record = json.load(open(os.path.join(BENCH, "results", "drafter-smollm2-h200-2026-12-02-r49.json")))
    v = drafter_run.verdicts(record["serve"]["configs"])
    assert set(v) == {"bf16 / baseline (s3k1d4)", "bf16 / baseline (default)", "fp8 / bf16 (s3k1d4)",
                      "fp8 / bf16 (default)", "bf16-s3k1d4 mean acceptance length"}
    assert all(x["pass"] for x in v.values()) and v["bf16-s3k1d4 mean acceptance length"]["value"] == 1.5246
    short = {"bf16-s3k1d4": {"acceptance": {"mean_acceptance_length": 1.4}},
             "baseline-s3k1d4": {"acceptance": {"mean_acceptance_length": 1.5}}}
    v = drafter_run.verdicts(short)
    assert v["bf16 / baseline (s3k1d4)"] == {"ratio": 0.9333, "bar": 0.97, "pass": False}
    assert not v["bf16-s3k1d4 mean acceptance length"]["pass"]
    assert v["fp8 / bf16 (s3k1d4)"] == {"bar": 0.97, "pass": False, "missing": ["fp8-s3k1d4"]}  # a draft that never served
    assert v["bf16 / baseline (default)"]["missing"] == ["bf16-default", "baseline-default"]


def test_flywheel_verdicts_compare_the_flywheel_draft_with_the_prefill_draft_of_the_recorded_run():
    import drafter_run

    record = json.load(open(os.path.join(BENCH, "results", "drafter-flywheel-smollm2-h200-2026-12-04-r64.json")))
    v = drafter_run.verdicts(record["flyserve"]["configs"], drafter_run.FLY_BARS, None)
    assert v == {"flywheel / prefill (s3k1d4)": {"ratio": 0.9824, "bar": 0.97, "pass": True},
                 "flywheel / prefill (default)": {"ratio": 1.0055, "bar": 0.97, "pass": True}}
    assert v == record["flyserve"]["verdicts"]
    assert record["flywheel"]["rows"]["pass"] and record["flywheel"]["rows"]["rows"] == 308075
    short = {"flywheel-s3k1d4": {"acceptance": {"mean_acceptance_length": 1.3}},
             "prefill-s3k1d4": {"acceptance": {"mean_acceptance_length": 1.4}}}
    v = drafter_run.verdicts(short, drafter_run.FLY_BARS, None)
    assert v["flywheel / prefill (s3k1d4)"] == {"ratio": 0.9286, "bar": 0.97, "pass": False}
    assert v["flywheel / prefill (default)"]["missing"] == ["flywheel-default", "prefill-default"]


def test_flywheel_and_prefill_only_files_of_one_sequence_export_the_same_ids_and_loss_mask():
    """The flywheel's file (prompt P, answer G, mask of P zeros: ``capture_loss_mask: []``) and the prefill-only
    capture of its P + G - 1 fed tokens (one sampled token, the answer span as its mask) train on the same tokens."""
    import torch
    from drafter_run import _answer_span

    from sglang_capture.core.format import row_count
    from sglang_capture.core.loss_mask import mask_from_spans
    from sglang_capture.tools.export_specforge import to_specforge

    P, G, H = 5, 4, 2
    prompt, answer = list(range(10, 10 + P)), list(range(50, 50 + G))
    rows = row_count(P, G)
    states = {"layers": [1, 2, 3], "aux_hidden_states": torch.randn(rows, 3 * H), "last_hidden_states": torch.randn(rows, H)}
    fly = {**states, "input_ids": torch.tensor(prompt), "output_ids": torch.tensor(answer),
           "loss_mask": torch.tensor(mask_from_spans([], P))}
    seq = (prompt + answer)[:rows]
    pre = {**states, "input_ids": torch.tensor(seq), "output_ids": torch.tensor([7]),
           "loss_mask": torch.tensor(mask_from_spans(_answer_span(seq, P), len(seq)))}
    a, b = to_specforge(fly, "fly", False), to_specforge(pre, "pre", False)
    assert a["input_ids"].tolist() == b["input_ids"].tolist() == seq
    assert a["loss_mask"].tolist() == b["loss_mask"].tolist() == [0] * P + [1] * (G - 1)
    assert _answer_span(prompt, P) == []  # answered in one token: no row, no span (an empty one is refused)


def test_column_cosines_take_each_aux_layer_and_the_final_state_apart_and_fail_on_one_bad_column():
    import torch
    from gpu_spec import MIN_COS, ColumnCosines

    H, n = 8, 200
    g = torch.Generator().manual_seed(0)
    mine = {"hidden_size": H, "aux_hidden_states": torch.randn(n, 3 * H, generator=g),
            "last_hidden_states": torch.randn(n, H, generator=g)}
    close = {k: v + 1e-4 * torch.randn(v.shape, generator=g) if torch.is_tensor(v) else v for k, v in mine.items()}
    compared = ColumnCosines()
    compared.add(mine, close, n)
    good = compared.result()
    assert good["files"] == 1 and good["rows"] == n and good["pass"] and good["bar"] == MIN_COS
    assert set(good["columns"]) == {f"{c}/{k}" for c in ("aux0", "aux1", "aux2", "final") for k in ("cos", "cos_top4_out")}
    far = {**close, "aux_hidden_states": close["aux_hidden_states"].clone()}
    far["aux_hidden_states"][:, H:2 * H] = torch.randn(n, H, generator=g)  # layer 1's rows are another sequence's
    compared.add(mine, far, n)
    bad = compared.result()
    assert not bad["pass"] and bad["rows"] == 2 * n
    assert bad["columns"]["aux1/cos"]["p0.1"] < 0.5 and bad["columns"]["aux0/cos"]["p0.1"] >= MIN_COS


def test_drafter_prompts_are_whole_objects_up_to_the_cut_first_human_turns_without_duplicates(tmp_path):
    import drafter_data

    conv = lambda i, who, text: {"id": str(i), "conversations": [{"from": who, "value": text}, {"from": "gpt", "value": "a"}]}
    whole = [conv(1, "human", "hello"), conv(2, "gpt", "not a prompt"), conv(3, "human", "hello"),
             conv(4, "human", "x" * 50), conv(5, "human", " second ")]
    path = tmp_path / "sharegpt.json"
    path.write_text("[" + ", ".join(json.dumps(c) for c in whole) + ', {"id": "6", "conversations": [{"from": "hu')
    prompts, read = drafter_data.first_prompts(str(path), max_chars=20)
    assert read == 5
    assert prompts == [{"id": "sharegpt-1", "prompt": "hello"}, {"id": "sharegpt-5", "prompt": "second"}]


def test_drafter_chats_keep_their_first_human_turns_in_order_when_each_is_usable(tmp_path):
    import drafter_data

    def chat(i, *msgs):
        return {"id": str(i), "conversations": [{"from": who, "value": text} for who, text in msgs]}
    whole = [chat(1, ("human", "a"), ("gpt", "x"), ("human", " b "), ("gpt", "y"), ("human", "c")),
             chat(2, ("human", "only one"), ("gpt", "x")),  # too few turns
             chat(3, ("gpt", "x"), ("human", "a"), ("human", "b")),  # opens with an answer
             chat(4, ("human", "a"), ("human", "again")),  # the same first turn as chat 1
             chat(5, ("human", "d"), ("gpt", "x"), ("human", "")),  # an empty turn
             chat(6, ("human", "e"), ("gpt", "x"), ("human", "y" * 50)),  # a turn too long
             chat(7, ("human", "f"), ("human", "g"))]
    path = tmp_path / "sharegpt.json"
    path.write_text("[" + ", ".join(json.dumps(c) for c in whole) + "]")
    assert drafter_data.chat_prompts(str(path), max_chars=20, turns=2) == [
        {"id": "chat-1", "prompts": ["a", "b"]}, {"id": "chat-7", "prompts": ["f", "g"]}]
    assert drafter_data.chat_prompts(str(path), max_chars=20, turns=3) == [{"id": "chat-1", "prompts": ["a", "b", "c"]}]


def test_the_prefix_sharing_drafts_are_held_to_shared_against_private_at_every_setting():
    import drafter_run

    bars = drafter_run.bars_for("serve", ("private", "shared"))
    configs = {f"{f}-{s}": {"acceptance": {"mean_acceptance_length": m}}
               for f, m in (("private", 2.0), ("shared", 1.95)) for s in drafter_run.SETTINGS}
    v = drafter_run.verdicts(configs, *bars)
    assert set(v) == {f"shared / private ({s})" for s in drafter_run.SETTINGS}
    assert all(x["pass"] and x["ratio"] == 0.975 for x in v.values())
    configs["shared-default"]["acceptance"]["mean_acceptance_length"] = 1.9
    assert not drafter_run.verdicts(configs, *bars)["shared / private (default)"]["pass"]
    assert drafter_run.bars_for("serve", ("bf16", "fp8", "baseline")) == (drafter_run.BARS, drafter_run.MIN_ACCEPTANCE)
    assert drafter_run.bars_for("flyserve", ("flywheel", "prefill"))[0] == drafter_run.FLY_BARS


def test_a_turn_sample_is_the_chat_up_to_that_turns_answer():
    from drafter_run import _chat_sample

    history = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
               {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    assert _chat_sample("c", 1, history) == {"id": "c-t1", "conversations": [{"from": "human", "value": "q1"},
                                                                             {"from": "gpt", "value": "a1"}]}
    assert _chat_sample("c", 2, history)["conversations"][2:] == [{"from": "human", "value": "q2"},
                                                                  {"from": "gpt", "value": "a2"}]


def test_results_page_is_the_current_picture_and_every_record_it_names_exists():
    """bench/RESULTS.md stays short (history lives in git), each raw record it names is in bench/results/, and each
    command in today's form names a phase that its entry point's --help lists."""
    import re
    import subprocess

    text = open(os.path.join(BENCH, "RESULTS.md")).read()
    assert len(text.splitlines()) <= 300
    named = set(re.findall(r"bench/results/([\w.-]+\.[A-Za-z0-9]+)", text))
    assert len(named) > 20  # every table names its runs' records
    missing = sorted(n for n in named if not os.path.isfile(os.path.join(BENCH, "results", n)))
    assert not missing, missing
    flat = " ".join(text.split())
    commands = set(re.findall(r"bash bench/(e2e|writer|gpu_deploy|drafter|vs_specforge)\.sh ([\w-]+)", flat))
    assert {family for family, _ in commands} == {"e2e", "writer", "gpu_deploy", "drafter", "vs_specforge"}
    for family in {family for family, _ in commands}:
        usage = subprocess.run(["bash", os.path.join(BENCH, f"{family}.sh"), "--help"], capture_output=True, text=True, timeout=30)
        assert usage.returncode == 0 and usage.stdout.startswith(f"usage: bash bench/{family}.sh"), usage
        phases = set(re.split(r"[ |]", usage.stdout.split(".sh ", 1)[1].split(" OUT")[0]))
        assert {phase for f, phase in commands if f == family} <= phases, (family, phases)


def test_vs_specforge_report_needs_only_the_standard_library_and_its_merged_record_gives_the_same_table(tmp_path):
    """Issue 51: the side by side's table comes back from its stage JSONs anywhere. Under `python -I -S` (no
    site-packages: neither the package nor SGLang importable) the report writes the table and one merged record
    with the stage names as keys; the record alone gives the same table; the harness's own `report` stage writes
    the same record; RESULTS.md's figures are the recorded run's."""
    import subprocess

    record = json.load(open(os.path.join(BENCH, "results", "vs_specforge-h200-2026-12-04-r73.json")))
    assert record["run"] == {"date": "2026-12-04", "device": "h200", "tree": "9cd7e2b"}
    assert {"l8b-servers", "l8b-sf-32", "l8b-sf-64", "smol-servers", "smol-sf-64", "smol-sf-64-gz", "smol-rows"} <= set(record)
    results = tmp_path / "work" / "results"
    results.mkdir(parents=True)
    for name, stage in record.items():
        if name != "run":
            (results / f"{name}.json").write_text(json.dumps(stage))

    def bare(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-I", "-S", *args], capture_output=True, text=True, cwd=tmp_path, timeout=60)

    assert bare("-c", "import sglang_capture").returncode != 0  # the premise: nothing beyond the standard library
    report = os.path.join(BENCH, "vs_specforge_report.py")
    proc = bare(report, str(results), "--date", "2026-12-04", "--tree", "9cd7e2b")
    assert proc.returncode == 0, proc.stderr
    merged = results / "vs_specforge-h200-2026-12-04.json"
    assert json.load(open(merged)) == record
    assert (results / "report.md").read_text() == proc.stdout
    assert bare(report, str(merged)).stdout == proc.stdout
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    assert "| 34,728 (39,621) | 0.849 (0.968) |" in rows[("l8b", "sglang_capture", "bf16")]
    assert "| 10.43 GB | 0.175 |" in rows[("l8b", "sglang_capture", "fp8")]  # per real token: SpecForge had 1,000 samples
    assert "| 5,378 (11,482; 57% padding) |" in rows[("l8b", "SpecForge prepare_hidden_states", "batch 64")]
    assert "| 960/1000 |" in rows[("l8b", "SpecForge prepare_hidden_states", "batch 64")]
    assert "| 0.792 |" in rows[("smol", "SpecForge prepare_hidden_states", "batch 64 --compress")]
    assert "bf16 0.1st-percentile cosine >= 0.99977 in every column; fp8 0.1st-percentile cosine >= 0.99946" in proc.stdout
    missing = bare(report, str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1 and "results dir" in missing.stderr
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps({**record, "l8b-servers": {"ceiling": {}}}))
    bad = bare(report, str(damaged))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [bad.stderr.strip()] and "KeyError" in bad.stderr
    failed = {**record, "smol-sf-8": {**record["smol-sf-8"], "rc": 1, "tok_per_s": 10 ** 9}}
    (tmp_path / "failed.json").write_text(json.dumps(failed))
    assert "| 0.792 |" in bare(report, str(tmp_path / "failed.json")).stdout  # a failed run is never the reference

    os.remove(merged)
    harness = subprocess.run([sys.executable, os.path.join(BENCH, "vs_specforge.py"), "report", "--work", str(tmp_path / "work"),
                              "--device", "cpu", "--tree", "9cd7e2b"], capture_output=True, text=True, timeout=120)
    assert harness.returncode == 0, harness.stderr[-2000:]
    written = glob.glob(str(results / "vs_specforge-cpu-*.json"))
    assert len(written) == 1 and {k: v for k, v in json.load(open(written[0])).items() if k != "run"} == \
        {k: v for k, v in record.items() if k != "run"}

    text = open(os.path.join(BENCH, "RESULTS.md")).read()
    for figure in ("**34,728 / 34,906** (39,621 / 40,059)", "0.849 / 0.853 (0.968 / 0.979)", "2,808 / **5,378** (11,462 / 11,482)",
                   "0.291 / **0.175**", "**64,068 / 71,596** (88,354 / 99,244)", "36,056** (20,478 / 55,675 / 84,695)",
                   "9,483 (11,927)", "0.99977", "0.99946"):
        assert figure in text, figure


def test_the_prefix_limit_bench_replays_a_pass_on_the_index_of_the_tree_and_of_a_revision():
    """``bench/prefix_limit_cost.py`` (the figures in docs/performance.md) runs on the working tree's index and on
    a git revision's, loaded in its place, under both of SGLang's policies, and on closed-loop chats."""
    import subprocess

    for policy in ("fcfs", "lpm"):
        proc = subprocess.run([sys.executable, os.path.join(BENCH, "prefix_limit_cost.py"), "--policy", policy,
                               "--conversations", "60", "--waiting", "12", "--admit", "4", "--rev", "HEAD"],
                              capture_output=True, text=True, timeout=120, cwd=os.path.dirname(BENCH))
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines = proc.stdout.splitlines()
        assert [line.split(":")[0] for line in lines] == [f"working tree, {policy}", f"HEAD, {policy}"]
        assert all("ms per scheduling pass, 12 waiting (60 conversations" in line for line in lines)
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "prefix_limit_cost.py"), "--load", "chats", "--chats", "6",
                           "--turns", "3", "--repeat", "1", "--rev", "HEAD"],
                          capture_output=True, text=True, timeout=120, cwd=os.path.dirname(BENCH))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["working tree, chats", "HEAD, chats"]
    assert all(" us a capture's cap, best of 1 (6 chats x 3 turns, " in line for line in lines)


def test_a_windows_scheduler_clock_is_the_seams_and_collections_between_two_stats_reads_summed_over_ranks():
    import e2e_probes

    def rank(decode, gen2):
        return {"scheduler_thread": {"run_batch/decode/capture": {"calls": decode, "s": decode * 0.005,
                                                                  "cpu_s": decode * 0.002}},
                "gc_pauses": {"gen0": {"calls": 10, "s": 0.01, "max_ms": 1.0}, "gen2": {"calls": gen2, "s": gen2 * 0.5, "max_ms": 500.0}}}

    before = e2e_probes.scheduler_clock({"a": rank(100, 0), "b": rank(100, 0)})
    after = e2e_probes.scheduler_clock({"a": rank(150, 1), "b": rank(130, 0)})
    assert before["run_batch/decode/capture"] == [200, pytest.approx(1.0), pytest.approx(0.4)]
    assert before["gc/gen0"] == [20, pytest.approx(0.02), pytest.approx(0.02)]
    # 80 more decode steps at 5 ms (2 ms of them the thread's CPU), one full collection of 0.5 s; gen0 did not
    # run in between, so it is left out
    assert e2e_probes.clock_deltas(before, after) == {"gc/gen2": [1, 500000.0, 500000.0],
                                                      "run_batch/decode/capture": [80, 5000.0, 2000.0]}
    assert e2e_probes.clock_deltas({}, {}) == {}
    old = {"a": {"scheduler_thread": {"prefix_cap/capture": {"calls": 10, "s": 0.001}}}}  # before the CPU clock
    assert e2e_probes.clock_deltas({}, e2e_probes.scheduler_clock(old)) == {"prefix_cap/capture": [10, 100.0, None]}


def test_a_gpu_timeline_counts_the_time_the_gpu_waited_for_the_host_apart_from_other_gaps(tmp_path):
    """``bench/gpu_timeline.py`` on a profiler trace: two kernels 200 us apart whose second was launched
    after the first ended (the GPU waited for the host 180 us of it), then one queued in time behind a
    copy (a gap, not the host's), and a graph launch (a decode step); kernel time by what launched it, and
    a device free (which waits for the whole device)."""
    import gzip

    import gpu_timeline

    def x(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    events = [x("cuda_runtime", "cudaGraphLaunch", 0, 5, correlation=1), x("kernel", "k1", 10, 100, correlation=1, stream=7),
              x("cuda_runtime", "cudaLaunchKernel", 290, 5, correlation=2), x("kernel", "k2", 310, 100, correlation=2, stream=7),
              x("cuda_runtime", "cudaLaunchKernel", 320, 5, correlation=3),
              x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 410, 50, stream=9, bytes=2_000_000),
              x("kernel", "k3", 470, 30, correlation=3, stream=7),
              x("cuda_runtime", "cudaEventSynchronize", 330, 140), x("cuda_runtime", "cudaFree", 600, 20),
              x("kernel", "k4", 500, 10, stream=7)]  # no launch recorded for it
    path = str(tmp_path / "t.trace.json.gz")
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = gpu_timeline.summarize(path)
    assert s["span_ms"] == 0.5 and s["kernel_busy_ms"] == 0.24
    assert s["gaps"]["count"] == 2 and s["gaps"]["total_ms"] == 0.26
    assert s["gaps"]["host_bound"] == {"cudaLaunchKernel": {"count": 1, "ms": 0.18}}
    assert s["copies"] == {"Memcpy DtoH (Device -> Pinned)": {"count": 1, "ms": 0.05, "mb": 2.0}}
    assert s["graph_launches"] == 1 and s["cuda_calls"]["cudaEventSynchronize"] == {"count": 1, "ms": 0.14}
    assert s["kernel_ms_by_launch"] == {"?": 0.01, "cudaGraphLaunch": 0.1, "cudaLaunchKernel": 0.13}
    assert s["cuda_calls"]["cudaFree"] == {"count": 1, "ms": 0.02}


def test_a_sessions_window_counts_the_cuda_allocator_only_where_both_ends_have_it():
    """``gpu_sessions`` sums the allocator counters over the ranks' stats files; a rank without them
    (no CUDA, or not pushed yet) makes the window's counts None, never counts since the start."""
    import gpu_sessions

    def doc(retries, frees):
        return {"device_allocator": {"num_alloc_retries": retries, "num_device_alloc": 5, "num_device_free": frees,
                                     "num_sync_all_streams": retries}}

    before = gpu_sessions.allocator_counts({"a": doc(1, 2), "b": doc(0, 0)})
    after = gpu_sessions.allocator_counts({"a": doc(3, 2), "b": doc(1, 4)})
    assert gpu_sessions.allocator_delta(before, after) == {"num_alloc_retries": 3, "num_device_alloc": 0,
                                                           "num_device_free": 4, "num_sync_all_streams": 3}
    assert gpu_sessions.allocator_counts({"a": doc(1, 1), "b": {}}) is None
    assert gpu_sessions.allocator_delta(None, after) is None and gpu_sessions.allocator_counts({}) is None


def test_a_timed_pass_ends_when_its_load_does_not_when_the_gpu_sampler_is_reaped(monkeypatch):
    import e2e_probes

    class SlowToStop:  # nvidia-smi -lms ends only at its next sample
        def stop(self):
            time.sleep(0.3)
            return {"util_pct": 90.0}

    monkeypatch.setattr(e2e_probes, "GpuSampler", SlowToStop)
    result, seconds, gpu = e2e_probes.timed_with_gpu(lambda: time.sleep(0.05) or "done")
    assert result == "done" and gpu == {"util_pct": 90.0}
    assert 0.05 <= seconds < 0.25


def test_a_sessions_window_counts_the_answers_last_rows_it_kept_as_stored():
    """Rows stored against the chats' unique rows: the files' own and each answer's last row kept for
    its next turn (server/answer_tail.py); a record from before them counts the files' alone."""
    import gpu_sessions

    ranks = {"a": {"rows_stored": 100, "rows_for_next_turn": 3}, "b": {"rows_stored": 50}}
    assert gpu_sessions.counters(ranks)["rows_for_next_turn"] == 3
    assert gpu_sessions.stored_rows({"delta": {"rows_stored": 150, "rows_for_next_turn": 3}}) == 153
    assert gpu_sessions.stored_rows({"delta": {"rows_stored": 150}}) == 150
