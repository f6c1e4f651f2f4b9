"""Compare two capture dirs file by file (e.g. the same requests captured with --tp 1 and --tp 2).

    python bench/compare_captures.py DIR_A DIR_B [--min-cos 0.999]

For every file name present in both: token ids must be equal and every row of every hidden-state
tensor must have cosine >= --min-cos against the other file's row (bf16 tolerance: TP changes the
order of reductions, not the values beyond rounding). Prints one line per file and PASS/FAIL.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List

import torch

import sglang_capture

SUFFIX = ".capture.msgpack"


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--min-cos", type=float, default=0.999)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    names = sorted(set(f for f in os.listdir(a.a) if f.endswith(SUFFIX)) & set(f for f in os.listdir(a.b) if f.endswith(SUFFIX)))
    rows, ok = [], bool(names)
    for name in names:
        x, y = sglang_capture.load(os.path.join(a.a, name)), sglang_capture.load(os.path.join(a.b, name))
        same_ids = torch.equal(x["input_ids"], y["input_ids"])
        # greedy outputs may part under rounding; rows are compared up to where the sequences agree
        sx = x["input_ids"].tolist() + x["output_ids"].tolist()
        sy = y["input_ids"].tolist() + y["output_ids"].tolist()
        n = next((i for i, (u, v) in enumerate(zip(sx, sy, strict=False)) if u != v), min(len(sx), len(sy)))
        n = min(n, x["last_hidden_states"].shape[0], y["last_hidden_states"].shape[0])
        cos = {k: torch.nn.functional.cosine_similarity(x[k][:n].float(), y[k][:n].float(), dim=-1).min().item()
               for k in ("aux_hidden_states", "last_hidden_states")}
        good = same_ids and min(cos.values()) >= a.min_cos
        ok &= good
        rows.append({"file": name, "same_ids": same_ids, "rows_compared": n, "same_output": sx == sy,
                     "min_cos": {k: round(v, 6) for k, v in cos.items()}, "pass": good})
        print(f"{'PASS' if good else 'FAIL'} {name} prompt ids {'equal' if same_ids else 'DIFFER'}, {n} rows, "
              f"outputs {'equal' if sx == sy else 'part'}, min cos {rows[-1]['min_cos']}")
    print(f"{'PASS' if ok else 'FAIL'}: {len(names)} files compared")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"files": rows, "pass": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
