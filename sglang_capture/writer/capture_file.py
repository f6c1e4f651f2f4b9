"""One capture file into the capture dir: encode, make durable, publish under its final name.

The file is encoded (core/format.py) into a private temp file under ``.tmp/``, written behind to
the disk as it grows and flushed per the durability policy (durability.py), and published under
its final name without ever replacing an existing file (core/durable.py): a reader sees either no
file or a whole one.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from sglang_capture.core.capture_dir import DirFds
from sglang_capture.core.checksum import DEFAULT_CHECKSUM
from sglang_capture.core.durable import publish_new
from sglang_capture.core.format import Codec, HostTensor, write_capture
from sglang_capture.core.names import FILE_SUFFIX
from sglang_capture.writer.durability import Durability, WriteBehind


def write_capture_file(dirs: DirFds, name: str, meta: Mapping[str, Any], tensors: Mapping[str, HostTensor],
                       codec: Codec, durability: Durability, keep_page_cache: bool = False,
                       progress: Callable[[], None] = lambda: None,
                       checksum: str = DEFAULT_CHECKSUM,
                       publishing: Optional[Callable[[os.stat_result, int, str], None]] = None,
                       temp_created: Optional[Callable[[str], None]] = None,
                       schema: Optional[str] = None, seal_payload: bool = False,
                       ) -> Tuple[int, str, Dict[str, float]]:
    """Encode ``tensors`` into ``<name>.capture.msgpack`` and publish it (``write_file``)."""
    try:
        return write_file(dirs.capture, name + FILE_SUFFIX, dirs.tmp, meta, tensors, codec, durability,
                          keep_page_cache, progress, checksum, publishing, temp_created, schema, seal_payload)
    except FileExistsError:
        raise FileExistsError(f"a capture file named {name!r} already exists") from None


def write_file(dir_fd: int, filename: str, tmp_dir_fd: int, meta: Mapping[str, Any],
               tensors: Mapping[str, HostTensor], codec: Codec, durability: Durability, keep_page_cache: bool = False,
               progress: Callable[[], None] = lambda: None, checksum: str = DEFAULT_CHECKSUM,
               publishing: Optional[Callable[[os.stat_result, int, str], None]] = None,
               temp_created: Optional[Callable[[str], None]] = None, schema: Optional[str] = None,
               seal_payload: bool = False) -> Tuple[int, str, Dict[str, float]]:
    """Encode ``tensors`` into ``filename`` (relative to ``dir_fd``; the temp file in ``tmp_dir_fd``,
    on the same filesystem) and publish it; returns its size, checksum and stage timings. Raises on
    failure (FileExistsError when the name is taken), leaving no file behind.

    Unless ``keep_page_cache``, the file's pages leave the page cache once on the disk: at 1.4 GB/s
    of captures the cache otherwise grows until the kernel must reclaim memory for every other
    allocation on the host, the server's included, and nothing reads these files back soon.

    ``progress`` is called after each write and each step of the file that reaches the disk: how
    the writer shows it is not hung. ``temp_created(name)`` says the temp file's name under
    ``.tmp/`` (the server side removes it if this process is killed mid-file), and
    ``publishing(stat, bytes, checksum)`` is called when the file is whole and flushed, just
    before its name appears: with it the server side can tell, if this process dies in the
    directory's flush, that the file under the name is this one and whole."""
    t0 = time.monotonic()
    encoded_at = [t0]

    def encode(f) -> Tuple[int, str]:
        behind = WriteBehind(f, progress, keep_page_cache)
        out = write_capture(behind, meta, tensors, codec, checksum, schema, seal_payload)
        behind.finish()
        encoded_at[0] = time.monotonic()
        return out

    def sync_data(fd: int) -> None:
        durability.sync_data(fd)
        if not keep_page_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the last pages go too
        progress()

    def before_link(fd: int, result: Tuple[int, str]) -> None:
        if publishing is not None:
            publishing(os.fstat(fd), *result)

    def sync_names(dir_fd: int) -> None:
        durability.sync_names(dir_fd)
        progress()

    nbytes, digest = publish_new(filename, encode, dir_fd=dir_fd, tmp_dir_fd=tmp_dir_fd, sync_data=sync_data,
                                 sync_names=sync_names, created=temp_created, before_link=before_link)
    return nbytes, digest, {"encode_write_s": encoded_at[0] - t0, "fsync_publish_s": time.monotonic() - encoded_at[0]}
