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

Beside them, ``OUT/eagle3_draft_config_fragment.json`` is the part of the drafter's config.json
that makes SGLang capture the exported layers when it serves the trained drafter
(``{"eagle_config": {"eagle_aux_hidden_state_layer_ids": [...]}}``, by SGLang's rule for the
target architecture, core/layers.py). ``--draft-config`` checks an existing drafter config
against the files before anything is written, so a drafter is never trained further on other
layers than the ones SGLang feeds it.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from sglang_capture.core.durable import replace_atomic
from sglang_capture.core.final_state import PRE_NORM
from sglang_capture.core.fp8 import FP8_DTYPE
from sglang_capture.core.layers import (
    EAGLE3_IDS_KEY,
    DraftEagle3Ids,
    LayerError,
    draft_capture_layers,
    eagle3_config_layer_ids,
    needs_reordered_ids,
    read_draft_eagle3_ids,
)
from sglang_capture.core.names import FILE_SUFFIX
from sglang_capture.core.reader import load
from sglang_capture.tools.export_sample import ExportCounts, ExportError, NoAnswer, export_files, tokens_and_mask

SPECFORGE_DTYPE = torch.bfloat16
# OUT/<this>: the drafter config fields SGLang needs to capture the exported layers (merge into config.json)
DRAFT_FRAGMENT_NAME = "eagle3_draft_config_fragment.json"
# OUT/<this>: the --draft-config given, with the ids SGLang used by default written out explicitly
FILLED_DRAFT_CONFIG_NAME = "draft_config.json"


@dataclass
class ExportReport(ExportCounts):
    architecture: str = ""
    eagle_ids: Optional[List[int]] = None
    fragment_path: Optional[str] = None  # OUT/eagle3_draft_config_fragment.json, when the ids exist
    draft_check: str = ""  # with --draft-config: the one line saying that it matches the files
    filled_config_path: Optional[str] = None  # with a --draft-config without ids: the config with them


def draft_fragment(eagle_ids: List[int]) -> dict:
    """The drafter config.json fields that make SGLang capture the exported layers."""
    return {"eagle_config": {EAGLE3_IDS_KEY: list(eagle_ids)}}


def check_draft_config(path: str, layers: List[int], architecture: str, num_layers: Optional[int],
                       directory: str) -> Tuple[DraftEagle3Ids, str]:
    """Refuse (ExportError, one line) a drafter config for which SGLang would capture other
    layers than ``directory``'s files hold: training it further on them would teach its fc
    layer features that the server never gives it. Returns (the draft read, the one line that
    says it matches)."""
    try:
        draft = read_draft_eagle3_ids(path, "--draft-config")
        if draft.ids is None and num_layers is None:
            raise ExportError(f"--draft-config {draft.path} has no {EAGLE3_IDS_KEY} (SGLang then uses its default, "
                              f"which depends on the depth) and {directory}'s files do not record num_layers; "
                              f"add eagle_config.{EAGLE3_IDS_KEY} to the drafter config")
        served = draft_capture_layers(draft, num_layers if num_layers is not None else max(layers) + 1,
                                      architecture, "--draft-config")
    except LayerError as e:
        raise ExportError(str(e)) from None
    given = "absent: SGLang's default" if draft.ids is None else json.dumps(draft.ids)
    if served != layers:
        raise ExportError(
            f"--draft-config {draft.path}: SGLang serving it captures layers {served} ({EAGLE3_IDS_KEY} {given}, "
            f"{architecture} rule) but {directory} holds layers {layers} (id i = input of decoder layer i); "
            f"capture again with --capture-layers-from-draft {draft.path}"
        )
    return draft, (f"--draft-config {draft.path} matches: SGLang serving it captures layers {served}, "
                   f"the files' layers ({EAGLE3_IDS_KEY} {given})")


def to_specforge(d: dict, path: str, all_tokens: bool, answers_only: bool = False) -> dict:
    """One loaded capture as SpecForge's sample dict (its tokens and mask: export_sample.py)."""
    if len(d["layers"]) != 3:
        raise ExportError(f"{path}: EAGLE-3 needs 3 aux layers, this file has {len(d['layers'])} ({d['layers']})")
    if d.get("last_hidden_states") is None:
        if d.get("final") == PRE_NORM:
            raise ExportError(f"{path}: holds only the pre-norm final state (--capture-final pre-norm) and SpecForge "
                              "trains on the post-norm one; capture with --capture-final post-norm or both")
        raise ExportError(f"{path}: no final hidden state (captured with --capture-no-keep-last)")
    ids, mask = tokens_and_mask(d, path, all_tokens, answers_only)
    return {
        "input_ids": ids,
        "loss_mask": mask,
        "hidden_state": d["last_hidden_states"].to(SPECFORGE_DTYPE).unsqueeze(0).contiguous(),
        "aux_hidden_state": d["aux_hidden_states"].to(SPECFORGE_DTYPE).unsqueeze(0).contiguous(),
    }


def export_specforge(directory: str, out: str, all_tokens: bool = False, progress: bool = True,
                     draft_config: Optional[str] = None, answers_only: bool = False) -> ExportReport:
    """Write ``OUT/<sample>.ckpt`` for every capture file of ``directory``, and the drafter
    config fragment for its layers; with ``draft_config`` first refuse (ExportError) a drafter
    config for which SGLang would capture other layers than the files hold."""
    from tqdm import tqdm

    files, first = export_files(directory, all_tokens, answers_only)
    report = ExportReport()
    report.layers, report.architecture = first["layers"], str(first["meta"].get("architecture", ""))
    num_layers = first["meta"].get("num_layers")
    num_layers = int(num_layers) if num_layers is not None else None
    draft = None
    if draft_config is not None:  # before anything is written: a mismatch must cost nothing
        draft, report.draft_check = check_draft_config(draft_config, report.layers, report.architecture,
                                                       num_layers, directory)
    ids_note = ""
    try:
        report.eagle_ids = eagle3_config_layer_ids(report.layers, report.architecture)
    except LayerError as e:
        ids_note = f"no drafter config fragment written: {e}"
    os.makedirs(out, exist_ok=True)
    for path in tqdm(files, unit="sample", disable=None if progress else True):
        dst = os.path.join(out, os.path.basename(path)[: -len(FILE_SUFFIX)] + ".ckpt")
        done = os.path.exists(dst)
        d = load(path, tensors=() if done else None)
        if d["layers"] != report.layers:
            raise ExportError(f"{path}: layers {d['layers']} differ from the other files' {report.layers}")
        if done:
            report.skipped += 1
            continue
        if d["meta"].get("storage_dtype") == FP8_DTYPE and not report.note:
            report.note = "captures are stored as FP8 (--capture-dtype fp8); their hidden states were restored to bf16"
        if d["aux_hidden_states"].dtype != SPECFORGE_DTYPE and not report.note:
            report.note = (f"captures are {d['aux_hidden_states'].dtype}; SpecForge files are bf16, "
                           "so hidden states were rounded to bf16")
        try:
            sample = to_specforge(d, path, all_tokens, answers_only)
        except NoAnswer:  # a request answered in one token (max_new_tokens 1, an immediate end of sequence)
            report.without_answer += 1
            continue
        replace_atomic(dst, lambda f, sample=sample: torch.save(sample, f))
        report.written += 1
    if report.eagle_ids is not None:
        report.fragment_path = os.path.join(out, DRAFT_FRAGMENT_NAME)
        _write_json(report.fragment_path, draft_fragment(report.eagle_ids))
        if needs_reordered_ids(report.eagle_ids, report.architecture):
            ids_note = (f"{EAGLE3_IDS_KEY} {report.eagle_ids} are unsorted on purpose: SGLang's DeepSeek rule "
                        "shifts ids that start with 1, and captures the layers in ascending order whatever the ids' order")
    if ids_note:
        report.note = (report.note + "; " if report.note else "") + ids_note
    if draft is not None and draft.ids is None and report.eagle_ids is not None:
        cfg = copy.deepcopy(draft.config)
        if not isinstance(cfg.get("eagle_config"), dict):
            cfg["eagle_config"] = {}
        cfg["eagle_config"][EAGLE3_IDS_KEY] = list(report.eagle_ids)
        report.filled_config_path = os.path.join(out, FILLED_DRAFT_CONFIG_NAME)
        _write_json(report.filled_config_path, cfg)
    return report


def _write_json(path: str, doc: dict) -> None:
    data = (json.dumps(doc, indent=2) + "\n").encode()
    replace_atomic(path, lambda f: f.write(data))
