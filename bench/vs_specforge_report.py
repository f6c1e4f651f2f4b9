"""The side by side with SpecForge as one table and one record, from its stage JSONs alone.

    python bench/vs_specforge_report.py SOURCE [--targets l8b,smol] [--record PATH] [--device D] [--date D] [--tree T]

SOURCE is the harness's results dir (one JSON per stage: ``l8b-servers.json``, ``l8b-sf-32.json``, ...)
or a merged record (``bench/results/vs_specforge-<device>-<date>-rNN.json``). It prints the table and,
from a dir, writes ``report.md`` and the merged record there (or to ``--record``). The Python
standard library only: the table comes back wherever the results are, without the package,
SGLang or the device (``bench/vs_specforge.py report`` calls the same code on the device).

Figures per tool (real tokens: SpecForge's padding excluded): ours, the whole ``extract`` pass
and, in brackets, from its first file; SpecForge, its whole stage after model load and, in
brackets, after its first batch (which compiles kernels). Bytes are compared per real token
(on the 8B SpecForge was given the first 1,000 conversations only).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import sys
from typing import Dict, List, Optional

BATCHES = (8, 32, 64)
RUN_KEY = "run"  # the merged record's one key that is not a stage: date, device, tree
TARGETS = ("l8b", "smol")
NOT_STAGES = ("report",)


def load_stages(source: str) -> Dict[str, dict]:
    """Stage name -> its JSON, from a results dir or a merged record."""
    if os.path.isdir(source):
        stages = {}
        for path in sorted(glob.glob(os.path.join(source, "*.json"))):
            name = os.path.basename(path)[:-len(".json")]
            if name in NOT_STAGES or name.startswith("vs_specforge-"):
                continue
            with open(path) as f:
                stages[name] = json.load(f)
        return stages
    with open(source) as f:
        merged = json.load(f)
    return {k: v for k, v in merged.items() if k != RUN_KEY}


def best_batch(stages: Dict[str, dict], target: str) -> int:
    """SpecForge's fastest batch size for TARGET (whole stage) among the runs that ended well, 8 if none did."""
    speeds = [0 if r.get("rc") else r.get("tok_per_s", 0) for r in (stages.get(f"{target}-sf-{b}") or {} for b in BATCHES)]
    return BATCHES[max(range(len(BATCHES)), key=lambda k: speeds[k])]


def _ratio(x: Optional[float], y: Optional[float]) -> str:
    return f"{x / y:.3f}" if x and y else "-"


def _per_token(run: dict, tokens_key: str) -> Optional[float]:
    return run["bytes"] / run[tokens_key] if run.get("bytes") and run.get(tokens_key) else None


def table(stages: Dict[str, dict], targets: List[str]) -> str:
    """The comparison as one markdown table, best first within each tool."""
    lines = ["| target | tool | setting | real tok/s, whole stage (from first file / after first batch) | of ceiling | "
             "start-up s | written/given | bytes | bytes per real token / SpecForge's | peak RSS GB | GPU busy |",
             "|" + "---|" * 11]
    for target in targets:
        s = stages.get(f"{target}-servers")
        ref = stages.get(f"{target}-sf-{best_batch(stages, target)}", {})
        ref_bpt = _per_token(ref, "real_tokens")
        ceiling = (s or {}).get("ceiling", {}).get("tok_per_s")
        if s:
            c = s["ceiling"]
            lines.append(f"| {target} | plain SGLang 0.5.17 (ceiling) | prefill only | {c['tok_per_s']:,} | 1 | "
                         f"{s['plain_startup_s']} | {c['samples']}/{c['samples']} | - | - | {c['peak_rss_gb']} | {c['gpu_busy']} |")
            for dtype in ("bf16", "fp8"):
                o = s[dtype]
                lines.append(f"| {target} | sglang_capture | {dtype} | {o['tok_per_s']:,} ({o['tok_per_s_from_first_file']:,}) | "
                             f"{o['of_ceiling']} ({_ratio(o['tok_per_s_from_first_file'], ceiling)}) | {s['ours_startup_s']} | "
                             f"{o['written']}/{o['given']} | {o['bytes'] / 1e9:.2f} GB | {_ratio(_per_token(o, 'tokens'), ref_bpt)} | "
                             f"{o['peak_rss_gb']} | {o['gpu_busy']} |")
        for b in BATCHES:
            for gz in ("", "-gz"):
                r = stages.get(f"{target}-sf-{b}{gz}")
                if not r or r.get("rc"):
                    continue
                lines.append(f"| {target} | SpecForge prepare_hidden_states | batch {b}{' --compress' if gz else ''} | "
                             f"{r['tok_per_s']:,} ({r['tok_per_s_after_first_batch']:,}; {r['padding_share']:.0%} padding) | "
                             f"{_ratio(r['tok_per_s'], ceiling)} | {r['startup_s']} | {r['written']}/{r['given']} | "
                             f"{r['bytes'] / 1e9:.2f} GB | {_ratio(_per_token(r, 'real_tokens'), ref_bpt)} | "
                             f"{r['peak_rss_gb']} | {r['gpu_busy_stage']} |")
    rows = stages.get("smol-rows")
    if rows:
        worst = {dtype: min(c["p0.1"] for c in rows[dtype]["columns"].values()) for dtype in ("bf16", "fp8") if dtype in rows}
        lines.append("")
        lines.append(f"rows (smol, SpecForge's {rows['specforge_run']} files against ours, {rows['samples']:,} samples): "
                     + "; ".join(f"{dtype} 0.1st-percentile cosine >= {v} in every column" for dtype, v in worst.items()))
    return "\n".join(lines)


def merged(stages: Dict[str, dict], device: str, date: str, tree: str) -> dict:
    """One record of a run: every stage's JSON under its stage name, and what ran it under RUN_KEY."""
    return {RUN_KEY: {"date": date, "device": device, "tree": tree}, **dict(sorted(stages.items()))}


def write_report(results: str, targets: List[str], device: str, date: str, tree: str,
                 record: Optional[str] = None) -> str:
    """The table to RESULTS/report.md and the merged record to RECORD (default: RESULTS/vs_specforge-<device>-<date>.json)."""
    stages = load_stages(results)
    text = table(stages, targets)
    with open(os.path.join(results, "report.md"), "w") as f:
        f.write(text + "\n")
    record = record or os.path.join(results, f"vs_specforge-{device}-{date}.json")
    with open(record + ".tmp", "w") as f:
        json.dump(merged(stages, device, date, tree), f, indent=1)
    os.replace(record + ".tmp", record)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="the harness's results dir, or a merged record")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--record", help="where the merged record goes (from a results dir)")
    ap.add_argument("--device", default="h200")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--tree", default="unknown", help="the commit the package's wheel was built from")
    a = ap.parse_args()
    targets = [t for t in a.targets.split(",") if t]
    if not os.path.exists(a.source):
        print(f"vs_specforge_report: {a.source} does not exist: give the harness's results dir or a merged record",
              file=sys.stderr)
        return 2
    try:
        if os.path.isdir(a.source):
            print(write_report(a.source, targets, a.device, a.date, a.tree, a.record))
        else:
            print(table(load_stages(a.source), targets))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # a stage JSON cut short or not the harness's
        print(f"vs_specforge_report: cannot make the table from {a.source}: {type(e).__name__}: {e} (a stage JSON is "
              "damaged or from another harness version; rerun that stage)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
