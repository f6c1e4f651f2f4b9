"""What every export format trains on: a capture's token ids and loss mask, and the refusals.

The ids cover every captured row: the prompt, then any fed-back generated tokens. A file's own
``loss_mask`` (written by ``sglang-capture extract``) covers its prompt; generated tokens are
always trained on. A file without one (a request the operator captured, or one that sent none)
trains on every token with ``all_tokens``, on its generated tokens only with ``answers_only``,
and is refused otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from sglang_capture.core.format import row_count


class ExportError(ValueError):
    """A capture that cannot become a trainer's sample; one actionable line."""


class NoAnswer(ExportError):
    """``--answers-only`` on a file without a loss mask whose request fed back no generated token."""


@dataclass
class ExportCounts:
    """What an export did, whatever the format."""

    written: int = 0
    skipped: int = 0  # already in OUT from an earlier run
    without_answer: int = 0  # --answers-only: files without a loss mask and without a generated token fed back
    layers: Optional[List[int]] = None
    note: str = ""


def export_files(directory: str, all_tokens: bool, answers_only: bool) -> Tuple[List[str], dict]:
    """The capture files of ``directory`` to export, and the first one's metadata (``load`` without
    tensors), after refusing what no export can do."""
    from sglang_capture.core.reader import load
    from sglang_capture.tools.manifest import sample_files

    if all_tokens and answers_only:
        raise ExportError("--all-tokens and --answers-only exclude each other: pick one for files without a loss mask")
    files = sample_files(directory)
    if not files:
        raise ExportError(f"{directory} has no capture files")
    return files, load(files[0], tensors=())


def tokens_and_mask(d: dict, path: str, all_tokens: bool, answers_only: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [T], loss mask int64 [T]) of one loaded capture, T its row count."""
    P, G = d["input_ids"].numel(), d["output_ids"].numel()
    ids = torch.cat([d["input_ids"], d["output_ids"][:row_count(P, G) - P]])
    if d.get("loss_mask") is not None:
        prompt_mask = d["loss_mask"].to(torch.int64)
    elif all_tokens:
        prompt_mask = torch.ones(P, dtype=torch.int64)
    elif answers_only:
        if ids.numel() == P:
            raise NoAnswer(f"{path}: no loss_mask and no generated token fed back: nothing to train on")
        prompt_mask = torch.zeros(P, dtype=torch.int64)
    else:
        raise ExportError(f"{path}: no loss_mask (not written by 'sglang-capture extract'); pass --answers-only "
                          "to train on its generated tokens, or --all-tokens to train on every token")
    mask = torch.cat([prompt_mask, torch.ones(ids.numel() - P, dtype=torch.int64)])
    return ids.contiguous(), mask.contiguous()
