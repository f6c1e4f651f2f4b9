"""A capture or sample directory as a ``torch.utils.data.Dataset``.

Indexing is by sample (manifest order when the directory has one, else file name order);
each ``__getitem__`` reads and decodes only that one file, so the dataset opens instantly on
hundreds of thousands of files and works with DataLoader workers. Tensors keep the serving
dtype (bf16 for real models).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Iterable, List, Optional

from torch.utils.data import Dataset

from sglang_capture.core.reader import load
from sglang_capture.tools.manifest import sample_files


class CaptureDataset(Dataset):
    """``CaptureDataset(dir)[i]`` = ``sglang_capture.load`` of the i-th sample file."""

    def __init__(self, directory: str, tensors: Optional[Iterable[str]] = None) -> None:
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"{directory} is not a directory")
        self.directory = directory
        self.files: List[str] = sample_files(directory)
        self.tensors = None if tensors is None else tuple(tensors)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        if not -len(self.files) <= index < len(self.files):
            raise IndexError(f"sample {index} out of range for {len(self.files)} samples")
        return load(self.files[index], tensors=self.tensors)
