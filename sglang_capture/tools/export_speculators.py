"""``sglang-capture export --format speculators``: capture files to what vLLM's speculators trains on.

speculators 0.9.0's trainer (``speculators/train/data.py``: ``ArrowDataset`` over
``hs_connectors.FileTransfer``) reads one data directory, OUT here:

- the preprocessed dataset, as ``datasets.Dataset.save_to_disk`` writes it, torch-formatted, with
  ``input_ids`` int64 [S], ``loss_mask`` int64 [S] and ``seq_len`` per sample (what its
  ``prepare-data`` writes);
- ``hidden_states/hs_{i}.safetensors`` for row i: ``token_ids`` int64 [S] (the trainer drops a
  sample whose ids differ from the row's) and ``hidden_states`` [S, L + 1, H], the L aux layers in
  layer order, then the final state *before* the model's final norm: the trainer applies the
  verifier's norm itself (``verifier_norm``), so only files captured with
  ``--capture-final pre-norm`` or ``both`` can feed it;
- ``token_freq.pt``: how often each trained token occurs, ``{id: count}``, which its
  ``--draft-vocab-size`` reads to build a reduced draft vocabulary.

The layer ids mean the same in both tools (id i = the residual stream entering decoder layer i,
as vLLM and SGLang capture aux layers), so the files' layers are the trainer's ``--target-layer-ids``.
Hidden states keep their serving dtype (FP8 captures restored to it); the trainer casts them.
Each ``hs_{i}`` is written beside its final name and renamed into place, naming the capture it came
from in its metadata; a rerun leaves one from the same capture alone, so an interrupted export
resumes. An earlier run's dataset is removed first and the new one written last, once every file
has passed: a refused or interrupted run leaves no dataset for the trainer to read.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass

import torch

from sglang_capture.core.durable import replace_atomic
from sglang_capture.core.final_state import PRE_NORM, kept_states
from sglang_capture.core.final_state import TENSOR as FINAL_TENSOR
from sglang_capture.core.fp8 import FP8_DTYPE
from sglang_capture.core.reader import loads, read_bytes
from sglang_capture.tools.export_sample import ExportCounts, ExportError, NoAnswer, export_files, tokens_and_mask

HIDDEN_STATES_DIR = "hidden_states"
TOKEN_FREQ_NAME = "token_freq.pt"
SOURCE_KEY = "sglang_capture_source"  # in each hs_{i}'s safetensors metadata: the capture it was made from
_DATASET_FILES = ("dataset_info.json", "state.json")  # beside its data-*.arrow shards
_SCRATCH_PREFIX = ".dataset-"
_TOKEN_TENSORS = ("input_ids", "output_ids", "loss_mask")  # what a sample's ids and mask come from


@dataclass
class SpeculatorsReport(ExportCounts):
    samples: int = 0  # in the dataset: written and skipped
    hidden_size: int = 0


def hs_path(out: str, index: int) -> str:
    return os.path.join(out, HIDDEN_STATES_DIR, f"hs_{index}.safetensors")


def check_pre_norm(d: dict, path: str) -> None:
    """Refuse, in one line, a capture (loaded with or without its tensors) without the pre-norm state."""
    if PRE_NORM not in kept_states(d["final"] or ""):
        raise ExportError(f"{path}: holds no pre-norm final state (final: {d['final'] or 'none'}), and speculators "
                          "trains on the state before the final norm; capture with --capture-final pre-norm or both")


def hidden_states(d: dict, path: str) -> torch.Tensor:
    """The ``hidden_states`` of an ``hs_{i}``: [S, L + 1, H], the aux layers, then the pre-norm state."""
    missing = [name for name in ("aux_hidden_states", FINAL_TENSOR[PRE_NORM]) if name not in d]
    if missing:
        raise ExportError(f"{path}: says it holds {', '.join(missing)} but has no such tensor; "
                          "check it with sglang-capture verify")
    aux, final = d["aux_hidden_states"], d[FINAL_TENSOR[PRE_NORM]]
    rows, H = final.shape
    return torch.cat([aux.reshape(rows, -1, H), final.unsqueeze(1)], dim=1).contiguous()


def _source(d: dict, path: str) -> str:
    """What an ``hs_{i}`` was made from, kept in its safetensors metadata: a rerun rewrites it unless
    it came from the same capture (request, time, layers, final state)."""
    return json.dumps({"file": os.path.basename(path), "rid": d["rid"], "created": d["meta"].get("created"),
                       "layers": d["layers"], "final": d["final"]}, sort_keys=True)


def _already_there(path: str, source: str) -> bool:
    from safetensors import SafetensorError, safe_open

    if not os.path.exists(path):
        return False
    try:
        with safe_open(path, framework="pt") as f:
            return (f.metadata() or {}).get(SOURCE_KEY) == source
    except (SafetensorError, OSError):
        return False  # partial or foreign: written again


def export_speculators(directory: str, out: str, all_tokens: bool = False, answers_only: bool = False,
                       progress: bool = True) -> SpeculatorsReport:
    """Write OUT as speculators' training data dir for every capture file of ``directory``."""
    from tqdm import tqdm

    try:
        import datasets
    except ImportError:
        raise ExportError("--format speculators writes a Hugging Face dataset: pip install datasets "
                          "(speculators' trainer needs it too)") from None
    files, first = export_files(directory, all_tokens, answers_only)
    report = SpeculatorsReport()
    report.layers, report.hidden_size = first["layers"], first["hidden_size"]
    check_pre_norm(first, files[0])  # before anything is written
    os.makedirs(os.path.join(out, HIDDEN_STATES_DIR), exist_ok=True)
    _remove_dataset(out)  # an earlier run's rows must never pair with the hs files written now
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq: Counter = Counter()
    for path in tqdm(files, unit="sample", disable=None if progress else True):
        buf = read_bytes(path)  # read once; the hidden states are decoded only for an hs file to write
        d = loads(buf, path, tensors=_TOKEN_TENSORS)
        if d["layers"] != report.layers or d["hidden_size"] != report.hidden_size:
            raise ExportError(f"{path}: layers {d['layers']} of width {d['hidden_size']} differ from the other "
                              f"files' {report.layers} of width {report.hidden_size}")
        check_pre_norm(d, path)
        try:
            ids, mask = tokens_and_mask(d, path, all_tokens, answers_only)
        except NoAnswer:
            report.without_answer += 1
            continue
        dst, source = hs_path(out, len(rows["input_ids"])), _source(d, path)
        if _already_there(dst, source):
            report.skipped += 1
        else:
            if d["meta"].get("storage_dtype") == FP8_DTYPE and not report.note:
                report.note = ("captures are stored as FP8 (--capture-dtype fp8); their hidden states were restored "
                               f"to {d['meta'].get('dtype')}")
            states = hidden_states(loads(buf, path, tensors=("aux_hidden_states", FINAL_TENSOR[PRE_NORM])), path)
            data = _safetensors_bytes({"token_ids": ids, "hidden_states": states}, {SOURCE_KEY: source})
            replace_atomic(dst, lambda f, data=data: f.write(data))
            report.written += 1
        rows["input_ids"].append(ids.tolist())
        rows["loss_mask"].append(mask.tolist())
        rows["seq_len"].append(ids.numel())
        freq.update(ids[mask.bool()].tolist())
    report.samples = len(rows["input_ids"])
    if not report.samples:
        raise ExportError(f"{directory}: none of its {len(files)} files has a token to train on")
    _remove_hs_files_from(out, report.samples)  # an earlier, larger export's: never read, only taking space
    _save_token_freq(out, dict(freq))
    _save_dataset(datasets, rows, out)
    return report


def _safetensors_bytes(tensors: dict, metadata: dict) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata=metadata)


def _save_token_freq(out: str, freq: dict) -> None:
    """``token_freq.pt``; when it changes, the draft vocabularies speculators' trainer cached from
    the old one (``d2t-<size>.npy``, ``t2d-<size>.npy`` in the data dir) are removed with it."""
    path = os.path.join(out, TOKEN_FREQ_NAME)
    try:
        if torch.load(path, weights_only=True) == freq:
            return
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):
        pass  # absent or not ours: written anew
    for name in os.listdir(out):
        if name.endswith(".npy") and name.startswith(("d2t-", "t2d-")):
            os.remove(os.path.join(out, name))
    replace_atomic(path, lambda f: torch.save(freq, f))


def _remove_dataset(out: str) -> None:
    """An earlier run's dataset, and the scratch dirs of a run killed while writing one."""
    for name in os.listdir(out):
        if name in _DATASET_FILES or (name.startswith("data-") and name.endswith(".arrow")):
            os.remove(os.path.join(out, name))
        elif name.startswith(_SCRATCH_PREFIX):
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)


def _remove_hs_files_from(out: str, first: int) -> None:
    directory = os.path.join(out, HIDDEN_STATES_DIR)
    for name in os.listdir(directory):
        stem = name[len("hs_"):-len(".safetensors")] if name.startswith("hs_") and name.endswith(".safetensors") else ""
        if stem.isdigit() and int(stem) >= first:
            os.remove(os.path.join(directory, name))


def _save_dataset(datasets, rows: dict, out: str) -> None:
    """The dataset into OUT: written whole in a scratch dir inside OUT, then moved in, its
    ``state.json`` last (``load_from_disk`` reads that first); old shards are removed."""
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict(rows, features=features)
    ds.set_format(type="torch")
    scratch = tempfile.mkdtemp(prefix=_SCRATCH_PREFIX, dir=out)
    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # one bar per export is tqdm's, above
    try:
        ds.save_to_disk(scratch)
        for name in sorted(os.listdir(scratch), key=lambda n: n == "state.json"):
            os.replace(os.path.join(scratch, name), os.path.join(out, name))
    finally:
        if was_on:
            datasets.enable_progress_bars()
        shutil.rmtree(scratch, ignore_errors=True)
