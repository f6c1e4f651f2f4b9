"""``sglang-capture export --format specforge``: capture files to SpecForge's offline EAGLE-3 files.

SpecForge (``specforge_hidden_states_v1``) reads one ``torch.save`` dict per sample, found by
walking the directory for ``*.ckpt``, with exactly::

    input_ids        int64 [T]
    loss_mask        int64 [T]
    hidden_state     bf16  [1, T, H]    post-final-norm last hidden state (input of lm_head)
    aux_hidden_state bf16  [1, T, 3H]   the three aux layers, concatenated in layer order

T covers every captured row: the prompt, then any fed-back generated tokens (trained on).
Files are written beside their final name and renamed into place, so a reader never sees a
partial ``.ckpt``; an existing ``.ckpt`` is left alone, so an interrupted export resumes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

import torch

from sglang_capture.core.durable import replace_atomic
from sglang_capture.core.format import row_count
from sglang_capture.core.fp8 import FP8_DTYPE
from sglang_capture.core.layers import LayerError, eagle3_config_layer_ids
from sglang_capture.core.names import FILE_SUFFIX
from sglang_capture.core.reader import load
from sglang_capture.tools.manifest import sample_files

SPECFORGE_DTYPE = torch.bfloat16


class ExportError(ValueError):
    """A capture that cannot become a SpecForge sample; one actionable line."""


@dataclass
class ExportReport:
    written: int = 0
    skipped: int = 0
    layers: Optional[List[int]] = None
    architecture: str = ""
    eagle_ids: Optional[List[int]] = None
    note: str = ""


def to_specforge(d: dict, path: str, all_tokens: bool) -> dict:
    """One loaded capture as SpecForge's sample dict."""
    if len(d["layers"]) != 3:
        raise ExportError(f"{path}: EAGLE-3 needs 3 aux layers, this file has {len(d['layers'])} ({d['layers']})")
    if d.get("last_hidden_states") is None:
        raise ExportError(f"{path}: no final hidden state (captured with --capture-no-keep-last)")
    P, G = d["input_ids"].numel(), d["output_ids"].numel()
    ids = torch.cat([d["input_ids"], d["output_ids"][:row_count(P, G) - P]])
    if d.get("loss_mask") is not None:
        prompt_mask = d["loss_mask"].to(torch.int64)
    elif all_tokens:
        prompt_mask = torch.ones(P, dtype=torch.int64)
    else:
        raise ExportError(f"{path}: no loss_mask (not written by 'sglang-capture extract'); "
                          "pass --all-tokens to train on every token")
    mask = torch.cat([prompt_mask, torch.ones(ids.numel() - P, dtype=torch.int64)])
    return {
        "input_ids": ids.contiguous(),
        "loss_mask": mask.contiguous(),
        "hidden_state": d["last_hidden_states"].to(SPECFORGE_DTYPE).unsqueeze(0).contiguous(),
        "aux_hidden_state": d["aux_hidden_states"].to(SPECFORGE_DTYPE).unsqueeze(0).contiguous(),
    }


def export_specforge(directory: str, out: str, all_tokens: bool = False, progress: bool = True) -> ExportReport:
    """Write ``OUT/<sample>.ckpt`` for every capture file of ``directory``."""
    from tqdm import tqdm

    files = sample_files(directory)
    if not files:
        raise ExportError(f"{directory} has no capture files")
    os.makedirs(out, exist_ok=True)
    report = ExportReport()
    for path in tqdm(files, unit="sample", disable=None if progress else True):
        dst = os.path.join(out, os.path.basename(path)[: -len(FILE_SUFFIX)] + ".ckpt")
        done = os.path.exists(dst)
        d = load(path, tensors=() if done else None)
        if report.layers is None:
            report.layers, report.architecture = d["layers"], str(d["meta"].get("architecture", ""))
        elif d["layers"] != report.layers:
            raise ExportError(f"{path}: layers {d['layers']} differ from the other files' {report.layers}")
        if done:
            report.skipped += 1
            continue
        if d["meta"].get("storage_dtype") == FP8_DTYPE and not report.note:
            report.note = "captures are stored as FP8 (--capture-dtype fp8); their hidden states were restored to bf16"
        if d["aux_hidden_states"].dtype != SPECFORGE_DTYPE and not report.note:
            report.note = (f"captures are {d['aux_hidden_states'].dtype}; SpecForge files are bf16, "
                           "so hidden states were rounded to bf16")
        sample = to_specforge(d, path, all_tokens)
        replace_atomic(dst, lambda f, sample=sample: torch.save(sample, f))
        report.written += 1
    try:
        report.eagle_ids = eagle3_config_layer_ids(report.layers or [], report.architecture)
    except LayerError as e:
        report.note = (report.note + "; " if report.note else "") + str(e)
    return report
