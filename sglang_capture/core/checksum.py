"""Checksums of whole files: how they are computed and how they are written down.

A checksum is written ``<algorithm>:<hex>`` (capture references, outcome records, manifests), so
a reader verifies each file with the algorithm it was written with, whichever the writer uses now.

- ``xxh3_128`` (default): XXH3's 128-bit hash, about 9 GB/s on one core. It guards against
  accidental damage (a truncated copy, a flipped bit on disk), which is what these files need:
  the zstd frames inside carry their own checksums too.
- ``sha256``: a cryptographic digest, about 1.4 GB/s, where a file's identity must hold against
  tampering (``--capture-checksum sha256``). Files written before the default changed carry it.

The seam table's fingerprints of SGLang's functions stay sha256 (patches/version_gate.checksum_tag).
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict

import xxhash

CHECKSUMS = ("xxh3_128", "sha256")
DEFAULT_CHECKSUM = "xxh3_128"
_NEW: Dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}


class UnknownChecksum(ValueError):
    """A checksum written with an algorithm this version does not know."""


def new_hasher(algorithm: str = DEFAULT_CHECKSUM) -> Any:
    """An empty hasher (``update``, ``hexdigest``) of ``algorithm``."""
    try:
        return _NEW[algorithm]()
    except KeyError:
        raise UnknownChecksum(f"unknown checksum algorithm {algorithm!r}; this version knows {', '.join(CHECKSUMS)}") from None


def tag(algorithm: str, hasher: Any) -> str:
    """``<algorithm>:<hex>`` of what ``hasher`` has seen."""
    return f"{algorithm}:{hasher.hexdigest()}"


def algorithm_of(checksum: str) -> str:
    """The algorithm a written checksum names (raises UnknownChecksum)."""
    algorithm = checksum.split(":", 1)[0] if ":" in checksum else ""
    if algorithm not in _NEW:
        raise UnknownChecksum(f"checksum {checksum[:40]!r} names no known algorithm ({', '.join(CHECKSUMS)})")
    return algorithm


def of_bytes(buf: bytes, algorithm: str = DEFAULT_CHECKSUM) -> str:
    """The checksum of bytes in memory."""
    h = new_hasher(algorithm)
    h.update(buf)
    return tag(algorithm, h)


def of_file(path: str, algorithm: str = DEFAULT_CHECKSUM) -> str:
    """The checksum of a file's bytes, read in blocks."""
    h = new_hasher(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return tag(algorithm, h)


def matches(buf: bytes, checksum: str) -> bool:
    """Whether ``buf`` has ``checksum``, computed with the algorithm it names (raises UnknownChecksum)."""
    return of_bytes(buf, algorithm_of(checksum)) == checksum
