"""Counters of the copies of captured rows to the host, declared once.

The copy hook (hooks/transfer.py), a request's capture (request_capture.py) and the decode rows'
copy (decode_rows.py) count into one
``CopyCounts`` per scheduler process; the writer's stats file shows them as ``result_copy``
(core/capture_dir.py: StatsFile), where they say whether the row selection and the FP8 packing
on the device are doing their job under real traffic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict


@dataclass
class CopyCounts:
    """Result copies of capture batches: plain ints, each written by one thread (the scheduler's,
    or the row copier's for ``decode_rows_scattered`` and ``decode_scatters``; only while a closing
    copier drains its queue can both add to those two, and an update may then be lost)."""

    batches: int = 0  # capture batches whose rows went to the host through the package's pool
    batch_rows: int = 0  # rows those batches had
    copied_rows: int = 0  # rows copied: the capture requests' only, where the batch was shared
    gathered_in_forward: int = 0  # batches whose rows were selected inside the forward
    fp8_packed_before_copy_rows: int = 0  # FP8 rows packed on the device, before the copy
    fp8_packed_per_request_rows: int = 0  # FP8 rows packed on the host, on the scheduler thread
    decode_rows_scattered: int = 0  # decode rows copied into their runs with the step's others (decode_rows.py)
    decode_scatters: int = 0  # the copies that did it (one per flush and source tensor)
    decode_copy_waits: int = 0  # flushes that waited for the row copier to catch up (decode_rows.py)

    def count_copy(self, batch_rows: int, copied_rows: int, in_forward: bool) -> None:
        """Account one capture batch's copy to the host."""
        self.batches += 1
        self.batch_rows += batch_rows
        self.copied_rows += copied_rows
        self.gathered_in_forward += int(in_forward)

    def as_dict(self) -> Dict[str, int]:
        return dict(self.__dict__)  # not dataclasses.asdict: this runs ahead of every batch of jobs sent
