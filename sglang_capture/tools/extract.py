"""``sglang-capture extract``: a JSONL of conversations in, one verified sample file each out.

Flow per sample: chat-template and tokenize (client side, so the loss mask is exact), send one
prefill-only capture request that carries the mask, move the published file to
``OUT/<id>.capture.msgpack`` without ever overwriting, then append the manifest line. Each
attempt uses a fresh capture name (``<id>.try-<run>-<nonce>``) so a retry never collides with a
late file from an earlier attempt; leftovers of attempts are removed, other live runs' attempts
kept (tools/attempts.py). A re-run reads the manifest and skips what is done, so an interrupted
run resumes without duplicates or half samples.
"""
from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import queue
import shutil
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

import requests

from sglang_capture.core import checksum
from sglang_capture.core.blocks import BLOCKS_DIR, GC_LOCK, block_relpath
from sglang_capture.core.durable import LockTimeout, fsync_dir, held_lock, publish_new
from sglang_capture.core.format import CaptureFileError
from sglang_capture.core.fp8 import CAPTURE_DTYPES
from sglang_capture.core.loss_mask import spans_from_mask
from sglang_capture.core.names import FILE_SUFFIX
from sglang_capture.core.reader import block_names, blocks_dir, load, read_meta
from sglang_capture.tools.attempts import RunLocks
from sglang_capture.tools.client import ServerError, ServerInfo, capture_prefill, discover_servers
from sglang_capture.tools.conversations import BadLine, Sample, read_samples
from sglang_capture.tools.manifest import Entry, ManifestWriter, read_manifest, rewrite_manifest
from sglang_capture.tools.templating import ChatEncoder, Encoded, TemplateError, load_tokenizer

LOCK_FILE = ".extract.lock"
WORKERS_PER_REQUEST = 2  # workers per request in flight: one waits for its answer while the other publishes


class ExtractError(RuntimeError):
    """The run cannot start (bad input file, servers, tokenizer, output dir); one line."""


class _NotSent(Exception):
    """A run stopped (``stop``) while this sample's worker waited for a request slot."""


@dataclass
class Failure:
    id: str
    line: int
    reason: str


@dataclass
class ExtractReport:
    total: int = 0
    skipped: int = 0
    recovered: int = 0
    written: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    bad_lines: List[BadLine] = field(default_factory=list)
    failures: List[Failure] = field(default_factory=list)


def sample_path(out: str, sample_id: str) -> str:
    return os.path.join(out, sample_id + FILE_SUFFIX)


def link_blocks(src: str, out: str, names: Sequence[str]) -> None:
    """Bring the shared blocks ``names`` that the capture file ``src`` references (schema v3) from
    beside it into ``out/.blocks``, and touch each there (``gc`` keeps it): linked on one filesystem
    (no bytes copied; the server's ``gc`` then only drops its own name for them), else copied, each
    whole or absent. A block already there stays: any block of a name holds the same rows
    (core/blocks.py). Call under ``out``'s gc lock (``move_to_sample``)."""
    here, there = blocks_dir(src), os.path.join(out, BLOCKS_DIR)
    linked, new_dirs = set(), False
    for name in names:
        rel = block_relpath(name)
        dst = os.path.join(there, rel)
        sub = os.path.dirname(dst)
        if not os.path.isdir(sub):
            os.makedirs(sub, mode=0o750, exist_ok=True)
            new_dirs = True
        try:
            os.link(os.path.join(here, rel), dst)
            linked.add(sub)
        except FileExistsError:
            pass
        except OSError:  # another filesystem: a flushed copy, linked into place
            with open(os.path.join(here, rel), "rb") as fi:
                try:
                    publish_new(dst, lambda fo: shutil.copyfileobj(fi, fo, 1 << 22))
                    linked.add(sub)
                except FileExistsError:
                    pass
        os.utime(dst)
    for sub in linked:
        fsync_dir(sub)
    if new_dirs:
        fsync_dir(there)


def move_to_sample(src: str, dst: str, keep_source: bool = False) -> None:
    """Move (``keep_source``: link) a server's file to its sample name, its shared blocks first:
    never overwrite, never expose a partial copy or a file whose blocks are not there yet. The
    blocks come and the file appears under the output's gc lock, held shared, as a writer publishes
    (writer/blocks.py): a ``gc`` of the output never takes a block between the two."""
    out = os.path.dirname(os.path.abspath(dst))
    names = block_names(read_meta(src), src)
    there = os.path.join(out, BLOCKS_DIR)
    elsewhere = bool(names) and not (os.path.isdir(there) and os.path.samefile(blocks_dir(src), there))
    if elsewhere:
        os.makedirs(there, mode=0o750, exist_ok=True)
    # within one directory too: a gc listing it between the link and the unlink sees neither name, and keeps
    # the blocks only because they were touched after it started
    held = (held_lock(os.path.join(there, GC_LOCK), None, os.path.join(there, GC_LOCK), shared=True, max_delay_s=0.01)
            if names else contextlib.nullcontext())
    with held:
        if elsewhere:
            link_blocks(src, out, names)
        else:
            for name in names:
                os.utime(os.path.join(there, block_relpath(name)))
        try:
            try:
                os.link(src, dst)
            except FileExistsError:
                raise
            except OSError:  # another filesystem: publish a copy (flushed, then linked into place)
                with open(src, "rb") as fi:
                    publish_new(dst, lambda fo: shutil.copyfileobj(fi, fo, 1 << 22))
            else:
                fsync_dir(out)
        except FileExistsError:
            raise FileExistsError(f"{dst} already exists; another extract may be writing to this directory") from None
    if not keep_source:
        os.unlink(src)


class _Rates:
    """Totals behind the progress bar's samples/s, tokens/s and MB/s."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.tokens = 0
        self.bytes = 0

    def add(self, tokens: int, nbytes: int) -> Dict[str, str]:
        self.tokens += tokens
        self.bytes += nbytes
        dt = max(time.monotonic() - self.t0, 1e-9)
        return {"tok/s": f"{self.tokens / dt:,.0f}", "MB/s": f"{self.bytes / dt / 1e6:,.1f}"}


class Extractor:
    """One extract run. Construct, then ``run()``; see the module docstring for the flow."""

    def __init__(self, input_path: str, server_urls: Sequence[str], out: str, tokenizer: Optional[str] = None,
                 concurrency: int = 8, retries: int = 3, timeout: float = 600.0, progress: bool = True,
                 capture_dtype: Optional[str] = None, api_key: Optional[str] = None,
                 say: Optional[Callable[[str], None]] = None) -> None:
        if concurrency < 1:
            raise ExtractError(f"--concurrency must be at least 1, got {concurrency}")
        if retries < 0:
            raise ExtractError(f"--retries must be zero or more, got {retries}")
        if not server_urls:
            raise ExtractError("give at least one --server URL of a capture server")
        if capture_dtype is not None and capture_dtype not in CAPTURE_DTYPES:
            raise ExtractError(f"--capture-dtype must be one of {', '.join(CAPTURE_DTYPES)}, got {capture_dtype!r}")
        self.capture_dtype = capture_dtype
        self.input_path, self.out, self.concurrency = input_path, os.path.abspath(out), concurrency
        self.retries, self.timeout, self.progress = retries, timeout, progress
        self.server_urls = list(server_urls)
        self.api_key, self.say = api_key, say
        self._server_count = len(self.server_urls)  # a router URL becomes its workers' (run)
        self.tokenizer_path = tokenizer
        self.report = ExtractReport()
        self._runs = RunLocks()
        self._sessions: List[requests.Session] = []

    def _prepare_out(self) -> None:
        try:
            os.makedirs(self.out, exist_ok=True)
        except OSError as e:
            raise ExtractError(f"cannot create --out {self.out}: {e.strerror}") from None
        if not os.access(self.out, os.W_OK | os.X_OK):
            raise ExtractError(f"--out {self.out} is not writable")
        self._lock_fd = os.open(os.path.join(self.out, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ExtractError(f"another extract is writing to {self.out}; wait for it or use another --out") from None

    def _check_capture_dirs(self, servers: List[ServerInfo]) -> None:
        for s in servers:
            if not os.path.isdir(s.capture_dir):
                raise ExtractError(
                    f"{s.url} writes to {s.capture_dir}, which this machine cannot see; start it with a "
                    f"--capture-dir on storage shared with this machine (e.g. --capture-dir {self.out})")

    def _resume(self, samples: List[Sample], encoder: ChatEncoder) -> List[Sample]:
        """Keep manifest entries whose file is intact; adopt complete files the manifest missed."""
        entries, _ = read_manifest(self.out)
        by_id = {s.id: s for s in samples}
        keep: Dict[str, Entry] = {}
        for e in entries:
            path = os.path.join(self.out, e.file)
            if e.id in by_id and e.id not in keep and os.path.isfile(path) and os.path.getsize(path) == e.bytes:
                keep[e.id] = e
        for s in samples:
            path = sample_path(self.out, s.id)
            if s.id in keep or not os.path.exists(path):
                continue
            entry = self._adopt(s, path, encoder)
            if entry is None:
                os.unlink(path)  # not this sample's data: redo it
            else:
                keep[s.id] = entry
                self.report.recovered += 1
        rewrite_manifest(self.out, [keep[s.id] for s in samples if s.id in keep])
        self.report.skipped = len(keep)
        return [s for s in samples if s.id not in keep]

    def _adopt(self, sample: Sample, path: str, encoder: ChatEncoder) -> Optional[Entry]:
        try:
            enc = encoder.encode(sample)
            d = load(path, tensors=("input_ids", "loss_mask"))
        except (CaptureFileError, TemplateError):
            return None
        if d["input_ids"].tolist() != enc.input_ids or d.get("loss_mask") is None \
                or d["loss_mask"].tolist() != enc.loss_mask:
            return None
        return Entry(sample.id, os.path.basename(path), len(enc.input_ids), os.path.getsize(path),
                     checksum.of_file(path), sample.line)

    def run(self) -> ExtractReport:
        t0 = time.monotonic()
        try:
            read = read_samples(self.input_path)
        except OSError as e:
            raise ExtractError(f"cannot read {self.input_path}: {e.strerror}") from None
        except ValueError as e:
            raise ExtractError(str(e)) from None
        self.report.bad_lines = read.bad
        self.report.total = len(read.samples)
        try:
            servers = discover_servers(self.server_urls, api_key=self.api_key, say=self.say)
            self._server_count = len(servers)
        except ServerError as e:
            raise ExtractError(str(e)) from None
        self._prepare_out()
        try:
            self._run_locked(read.samples, servers)
        finally:
            os.close(self._lock_fd)  # releases the lock: the next run in this process may start
            self.report.seconds = time.monotonic() - t0
        return self.report

    def _run_locked(self, samples: List[Sample], servers: List[ServerInfo]) -> None:
        self._check_capture_dirs(servers)
        source = self.tokenizer_path or servers[0].model_path
        try:
            encoder = ChatEncoder(load_tokenizer(source), source)
        except TemplateError as e:
            raise ExtractError(f"{e}; pass --tokenizer PATH" if not self.tokenizer_path else str(e)) from None
        if any(s.messages for s in samples) and not getattr(encoder.tok, "chat_template", None):
            raise ExtractError(f"the tokenizer at {source!r} has no chat template, needed for conversations; "
                               "pass --tokenizer with one, or give samples as {\"text\": ...}")
        capture_dirs = [s.capture_dir for s in servers]
        try:
            for d in capture_dirs:
                try:
                    self._runs.acquire(d)
                except LockTimeout as e:
                    raise ExtractError(f"cannot mark this run in {d}: {e.strerror}") from None
                except OSError as e:
                    raise ExtractError(f"cannot mark this run in {d} ({e.strerror}); extract needs write access to "
                                       "the servers' capture dirs") from None
            self._runs.remove_leftovers([self.out, *capture_dirs])
            todo = self._resume(samples, encoder)
            manifest = ManifestWriter(self.out)
            try:
                try:
                    self._work(todo, servers, encoder, manifest)
                except BaseException:
                    try:
                        manifest.close()
                    except OSError:  # the run's own error is the one to tell; a re-run adopts the files
                        pass
                    raise
                try:
                    manifest.close()  # every line on disk
                except OSError as e:
                    raise ExtractError(f"{e}; the samples' files are whole: a re-run adopts them") from None
            finally:
                self._runs.remove_leftovers([self.out, *capture_dirs], own=True)
        finally:
            self._runs.release()

    def _work(self, todo: List[Sample], servers: List[ServerInfo], encoder: ChatEncoder,
              manifest: ManifestWriter) -> None:
        from tqdm import tqdm

        rates = _Rates()
        order = itertools.count()
        bar = tqdm(total=len(todo), unit="sample", disable=None if self.progress else True, dynamic_ncols=True)

        stop: List[str] = []  # set once: a server refuses every request alike (tools/client.py: fatal)
        # --concurrency counts requests in flight: a request holds one of that many sessions (one
        # kept-alive connection per server each). Its worker then publishes the file (links, directory
        # fsyncs: about as long as the request at 256 in flight, r106) while another worker's request
        # takes the session, so there are twice as many workers as sessions.
        self._sessions = [self._new_session() for _ in range(self.concurrency)]
        slots: "queue.Queue[requests.Session]" = queue.Queue()
        for session in self._sessions:
            slots.put(session)

        def one(sample: Sample) -> Union[Entry, Failure]:
            if stop:
                return Failure(sample.id, sample.line, f"not sent: {stop[0]}")
            first = next(order) % len(servers)  # spread samples over servers, fail over in turn
            try:
                enc = encoder.encode(sample)
            except TemplateError as e:
                return Failure(sample.id, sample.line, str(e))
            if not enc.input_ids:
                return Failure(sample.id, sample.line, "the sample tokenizes to no tokens")
            reason = ""
            for attempt in range(self.retries + 1):
                if stop:
                    reason = reason or f"not sent: {stop[0]}"
                    break
                server = servers[(first + attempt) % len(servers)]
                try:
                    entry = self._capture(sample, enc, server, slots, stop)
                except _NotSent:
                    reason = reason or f"not sent: {stop[0]}"
                    break
                except ServerError as e:
                    reason = str(e)
                    if e.fatal:
                        stop.append(reason)
                    if not e.retryable:
                        break
                except OSError as e:
                    reason = f"cannot publish the file: {e}"
                except CaptureFileError as e:  # the server's file, read for the blocks it names
                    reason = f"the server's file is unreadable: {e}"
                    break
                else:
                    try:
                        manifest.append(entry)
                    except OSError as e:  # the manifest cannot be written: a re-run adopts the file
                        stop.append(str(e))
                        return Failure(sample.id, sample.line, f"not in the manifest: {e}")
                    return entry
                time.sleep(min(0.5 * 2 ** attempt, 10.0))
            return Failure(sample.id, sample.line, reason)

        try:
            with ThreadPoolExecutor(WORKERS_PER_REQUEST * self.concurrency) as pool:
                futures = [pool.submit(one, s) for s in todo]
                for f in as_completed(futures):
                    result = f.result()
                    if isinstance(result, Failure):
                        self.report.failures.append(result)
                    else:
                        self.report.written += 1
                        self.report.tokens += result.tokens
                        self.report.bytes += result.bytes
                        bar.set_postfix(rates.add(result.tokens, result.bytes), refresh=False)
                    bar.update(1)
        finally:
            bar.close()
            for session in self._sessions:
                session.close()
            self._sessions.clear()
        self.report.failures.sort(key=lambda x: x.line)
        if stop:
            raise ExtractError(f"{stop[0]} (stopped: {len(self.report.failures)} samples not captured; "
                               "re-run once that is fixed)")

    def _new_session(self) -> requests.Session:
        """A request slot's session: one kept-alive connection per server."""
        session = requests.Session()
        # a pool per server (requests keeps 10 by default: with more --server URLs each request
        # would evict one and open a new connection), one connection each: this slot's
        adapter = requests.adapters.HTTPAdapter(pool_connections=max(self._server_count, 1), pool_maxsize=1)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        return session

    def _capture(self, sample: Sample, enc: Encoded, server: ServerInfo, slots: "queue.Queue[requests.Session]",
                 stop: List[str]) -> Entry:
        name = self._runs.attempt_name(sample.id)
        session = slots.get()
        try:
            if stop:  # set while this worker waited for a slot
                raise _NotSent
            ref = capture_prefill(server, enc.input_ids, name, spans_from_mask(enc.loss_mask), self.timeout,
                                  self.capture_dtype, session)
        finally:
            slots.put(session)
        if int(ref.get("rows", -1)) != len(enc.input_ids):
            raise ServerError(f"{server.url}: the capture has {ref.get('rows')} rows for {len(enc.input_ids)} tokens")
        dst = sample_path(self.out, sample.id)
        move_to_sample(ref["path"], dst)
        return Entry(sample.id, os.path.basename(dst), len(enc.input_ids), int(ref["bytes"]), str(ref["checksum"]),
                     sample.line)
