"""The capture state of one scheduler process: model facts, per-request state, the writer pool.

The instrumentor binds the one ``SchedulerCapture`` of its process to every scheduler hook. Everything here that runs on the
scheduler thread is bookkeeping only; rows go to the writer processes by reference.
"""
from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from sglang_capture import __version__
from sglang_capture.core import protocol
from sglang_capture.core.blocks import slot_start
from sglang_capture.core.capture_dir import index_path
from sglang_capture.core.config import CaptureConfig
from sglang_capture.core.final_state import META_KEY as FINAL_META_KEY
from sglang_capture.core.final_state import POST_NORM, PRE_NORM, carried_states, kept_states
from sglang_capture.core.final_state import TENSOR as FINAL_TENSOR
from sglang_capture.core.format import SCHEMA, SCHEMA_FP8, row_count
from sglang_capture.core.fp8 import FP8_DTYPE, packed_layout
from sglang_capture.core.layers import LAYER_CONVENTION, resolve_layers
from sglang_capture.core.names import FILE_SUFFIX
from sglang_capture.patches.version_gate import installed_sglang_version
from sglang_capture.server.answer_tail import KEPT, WHY_NOT, LaunchedStep, answer_tail
from sglang_capture.server.aux_capture import AUX_ATTR, AuxCapture
from sglang_capture.server.batch_rows import BatchRows, ResultRows
from sglang_capture.server.block_index import joined, prompt_ids
from sglang_capture.server.copy_counts import CopyCounts
from sglang_capture.server.decode_rows import DecodeRows, RowCopier
from sglang_capture.server.gc_pauses import GcPauses
from sglang_capture.server.host_pool import HostPool
from sglang_capture.server.ledger import HostMemoryLedger
from sglang_capture.server.node_budget import NodeBudget
from sglang_capture.server.pd_prefill import chunk_like_any_request, decode_rows_error, is_pd_prefill
from sglang_capture.server.pre_norm import PreNormCapture
from sglang_capture.server.request_capture import CAPTURE_ATTR, RequestCapture
from sglang_capture.server.seam_clock import SeamClock
from sglang_capture.server.shared_rows import SHARE_ATTR, SharedRows, holds_off, weights_identity
from sglang_capture.server.writer_pool import CaptureJob, WriterPool

logger = logging.getLogger(__name__)

EXTRA_KEY_TAG = "\x00sglang_capture:"


@dataclass(frozen=True)
class ModelInfo:
    """What the model loaded in this scheduler captures, recorded in every file."""

    model_path: str
    architecture: str
    model_class: str
    hidden_size: int
    num_layers: int
    layers: Tuple[int, ...]
    dtype: str
    finals: Tuple[str, ...] = (POST_NORM,)  # the final states a row carries after the aux layers (core/final_state.py)

    @property
    def aux_width(self) -> int:
        return len(self.layers) * self.hidden_size

    @property
    def row_width(self) -> int:
        """Columns of a captured row in the model's dtype: the aux layers, then the final hidden states."""
        return self.aux_width + len(self.finals) * self.hidden_size

    def final_columns(self, kind: str) -> Tuple[int, int]:
        """Where the final state ``kind`` (post-norm, pre-norm) lies in a captured row."""
        lo = self.aux_width + self.finals.index(kind) * self.hidden_size
        return lo, lo + self.hidden_size


def _model_facts(runner: Any) -> Tuple[str, int, int, str]:
    cfg = runner.model_config
    hf = cfg.hf_config
    arch = (getattr(hf, "architectures", None) or [type(runner.model).__name__])[0]
    text = getattr(cfg, "hf_text_config", hf)
    return arch, int(cfg.hidden_size), int(text.num_hidden_layers), str(cfg.dtype).replace("torch.", "")


class SchedulerCapture:
    """Capture state for the scheduler process it lives in."""

    def __init__(self, config: CaptureConfig) -> None:
        self.config = config
        self.ledger = HostMemoryLedger(config.max_pending_bytes)
        self.writer = WriterPool(config, self.ledger)
        self.pool: Optional[HostPool] = None  # set up with the model, on the writer rank
        self.copies = CopyCounts()
        self.clock = SeamClock()
        self.gc_pauses = GcPauses()
        self.gc_watch_pending = False  # set on the writer rank: gc_pauses counts from the first batch result
        self.model: Optional[ModelInfo] = None
        self.aux: Optional[AuxCapture] = None  # set up with the model
        self.pre_norm: Optional[PreNormCapture] = None  # with the model, when the pre-norm final state is kept
        # the batch Scheduler.run_batch is launching, and the one whose result is being processed
        # (hooks/batch.py, hooks/results.py; batch_rows.py says why this is not on the tensors)
        self.launching: Optional[BatchRows] = None
        self.processing: Optional[ResultRows] = None
        self.launched: Optional[LaunchedStep] = None  # the batch launched last, with its result (answer_tail.py)
        self.answer_tails = dict.fromkeys((KEPT, *WHY_NOT), 0)  # sharing captures sealed, by what became of that row
        self.decode_rows: Optional[DecodeRows] = None  # with the pool: the decode rows of the result being processed
        self.copier: Optional[RowCopier] = None  # with the pool: copies decode rows off the scheduler thread
        self._is_writer: Optional[bool] = None
        self.pd_prefill = False  # a PD prefill server (pd_prefill.py), known once the model is loaded
        self.shared: Optional[SharedRows] = None  # --capture-prefix-sharing on: set up with the model (every rank)
        self._versions = {"sglang": installed_sglang_version(), "sglang_capture": __version__}

    @property
    def is_writer(self) -> bool:
        """Only the rank that owns the request outputs copies and writes (TP>1: one rank)."""
        if self._is_writer is None:
            from sglang.srt.runtime_context import get_parallel

            p = get_parallel()
            self._is_writer = p.pp_rank == 0 and p.attn_tp_rank == 0 and p.attn_cp_rank == 0
        return self._is_writer

    def configure_model(self, runner: Any) -> None:
        """Switch aux capture on for the target model, before its CUDA graphs are captured."""
        model = runner.model
        arch, hidden, num_layers, dtype = _model_facts(runner)
        layers = resolve_layers(self.config.layers, num_layers, arch)
        self.pd_prefill = is_pd_prefill(runner.server_args)
        self.aux = AuxCapture(runner, layers)
        self.aux.enable()
        finals = carried_states(self.config.final)
        if PRE_NORM in finals and self.pre_norm is None:
            self.pre_norm = PreNormCapture(self.aux.inner)
        self.model = ModelInfo(
            model_path=str(runner.server_args.model_path),
            architecture=arch,
            model_class=type(model).__name__,
            hidden_size=hidden,
            num_layers=num_layers,
            layers=tuple(layers),
            dtype=dtype,
            finals=finals,
        )
        logger.info("sglang_capture: capturing layers %s of %s (%s), final hidden state %s",
                    layers, arch, type(model).__name__,
                    self.config.final if self.config.keep_last_hidden else "dropped")
        if self.config.sharing and self.shared is None:
            no_holds = holds_off(runner.server_args)
            self.shared = SharedRows(may_hold=no_holds is None)
            if no_holds is not None and self.is_writer:
                logger.info("sglang_capture: with %s, captures sharing a new prompt do not wait for another capture to "
                            "store it: each computes it until its blocks are stored", no_holds)
            if self.is_writer:  # the group's other ranks take its layout from its first block event
                layout, why_not = self._layout(runner.server_args)
                self.shared.configure(layout, why_not)
                self.writer.blocks_outcome = self.shared.stored
                self.writer.job_queued, self.writer.job_settled = self.shared.in_flight, self.shared.settled
                if layout is not None:
                    logger.info("sglang_capture: prefix sharing on: capture requests reuse the stored (or queued) rows of "
                                "cached prefixes, and files reference rows stored once under %s/.blocks", self.config.capture_dir)
        if self.is_writer and self.pool is None:
            budget = NodeBudget.for_server(self.config, runner.server_args)
            logger.info("sglang_capture: %s", budget.describe())
            self.ledger.cap_bytes = budget.pending_bytes
            self._make_pool(budget.pending_bytes, pin=str(runner.device).startswith("cuda"))
            self.gc_watch_pending = True
            self.writer.start(self.pool, budget.writers, self.stats)

    def _layout(self, server_args: Any) -> Tuple[Optional[Dict[str, Any]], str]:
        """What captured rows depend on besides their tokens (core/blocks.layout_root; the storage
        dtype is added per request): rows of another layout are never reused. None, with the reason,
        when the weights cannot be told apart from others (server/shared_rows.weights_identity)."""
        weights, why_not = weights_identity(server_args)
        if weights is None:
            return None, why_not
        m = self.model
        return {"model": m.model_path, "architecture": m.architecture, "model_class": m.model_class,
                "hidden_size": m.hidden_size, "num_layers": m.num_layers, "layers": list(m.layers), "dtype": m.dtype,
                "layer_convention": LAYER_CONVENTION,
                "final": self.config.final if self.config.keep_last_hidden else None, "weights": weights,
                "quantization": getattr(server_args, "quantization", None),
                "kv_cache_dtype": str(getattr(server_args, "kv_cache_dtype", None))}, ""

    def _make_pool(self, size_bytes: int, pin: bool) -> None:
        """The host pool for capture batches, before the first request; without one (no memory to
        pin) capture still works, on SGLang's per-batch pinned buffers, only slower under load."""
        try:
            self.pool = HostPool(size_bytes, pin=pin)
        except (RuntimeError, MemoryError, OSError) as e:
            logger.warning("sglang_capture: no host pool for pending rows (%s); capture goes on with SGLang's own "
                           "buffers. Lower --capture-max-pending-mb to get one", e)
            return
        atexit.register(self.pool.close)
        self.copier = RowCopier(self.pool, self.copies)
        atexit.register(self.copier.close)  # atexit runs last-in first: the copier stops before the pool
        self.decode_rows = DecodeRows(self.pool, self.copies, self.copier)
        self.ledger.block_bytes = self.pool.block_bytes
        logger.info("sglang_capture: %d MiB of host memory for pending rows (%s, %.1f s)", self.pool.size_bytes >> 20,
                    "pinned" if self.pool.pinned else "not pinned", self.pool.setup_s)

    def watch_gc(self) -> None:
        """Once, at the first batch result: count the garbage collector's pauses from here on (the
        start-up's collections, around CUDA-graph capture, are SGLang's own: gc_pauses.py)."""
        self.gc_watch_pending = False
        self.gc_pauses.install()

    def stop(self) -> None:
        """Stop the garbage-collector watch and the row copier this capture started (``uninstrument``):
        rows flushed later are copied on the scheduler thread."""
        self.gc_watch_pending = False
        self.gc_pauses.uninstall()
        if self.pre_norm is not None:
            self.pre_norm.remove()
            self.pre_norm = None
        if self.copier is not None:
            self.copier.close()

    def stats(self) -> Dict[str, Any]:
        """This process's counters for the writer's stats file (core/capture_dir.py: StatsFile)."""
        return {"host_pool": self.pool.stats() if self.pool else None, "result_copy": self.copies.as_dict(),
                "aux_capture": self.aux.stats() if self.aux else None, "scheduler_thread": self.clock.stats(),
                "gc_pauses": self.gc_pauses.stats(),
                "prompt_holds": dict(self.shared.holds.counts) if self.shared is not None else None,
                "in_flight": dict(self.shared.in_flight_counts) if self.shared is not None else None,
                "answer_tail": dict(self.answer_tails) if self.shared is not None else None}

    def begin(self, req: Any) -> None:
        """Mark a new request for capture when its custom_params ask for it (all ranks alike)."""
        custom = protocol.custom_params(req.sampling_params)
        if not protocol.asks_capture(custom):
            return
        samples = getattr(req.sampling_params, "n", 1) or 1
        try:
            asked = protocol.parse_request(custom, rid=req.rid, prompt_len=len(req.origin_input_ids), samples=samples,
                                           default_dtype=self.config.capture_dtype,
                                           prefix_pass=samples > 1 and req.sampling_params.max_new_tokens == 0,
                                           beams=protocol.beam_width(req.sampling_params))
        except protocol.BadCaptureRequest as e:
            req.set_finish_with_abort(str(e))
            return
        if asked is None:
            return  # SGLang's prefix-caching pass before parallel samples, or a beam search the operator chose: no file
        if self.shared is None or not self.shared.mark(req, asked.dtype):
            # A private radix-cache namespace: a prefix hit would leave the cached positions without rows.
            req.extra_key = (req.extra_key or "") + EXTRA_KEY_TAG + req.rid
        setattr(req, AUX_ATTR, True)
        if self.pd_prefill:
            chunk_like_any_request(req)
        if not self.is_writer:
            req.return_hidden_states = False
            return
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        req.return_hidden_states = True
        req.return_hidden_states_mode = CaptureHiddenMode.FULL
        capture = RequestCapture(rid=req.rid, name=asked.name, ledger=self.ledger, loss_spans=asked.loss_spans,
                                 pool=self.pool, fp8_block=self.model.hidden_size if asked.dtype == "fp8" else None,
                                 counts=self.copies)
        setattr(req, CAPTURE_ATTR, capture)
        capture.finalizer = weakref.finalize(req, capture.release)  # dropped unfinished: free the rows
        why = decode_rows_error(req) if self.pd_prefill else None
        if why is not None:
            capture.fail(why)

    def columns(self) -> Dict[str, Tuple[int, int]]:
        """Column ranges of each tensor in a captured row, in the model's dtype: aux layers first,
        then the final hidden state (``stored_layout``: where they lie in the rows as stored)."""
        m = self.model
        out = {"aux_hidden_states": (0, m.aux_width)}
        if self.config.keep_last_hidden:
            out.update({FINAL_TENSOR[kind]: m.final_columns(kind) for kind in kept_states(self.config.final)})
        return out

    def stored_layout(self, columns: Dict[str, Tuple[int, int]], fp8: bool
                      ) -> Tuple[Dict[str, Tuple[int, int]], Dict[str, str]]:
        """Where the writer finds each stored tensor of ``columns`` in a captured row, and the dtype
        it stores it as when that is not the rows' own ({} unless the capture is FP8: packed rows)."""
        if not fp8:
            return columns, {}
        m = self.model
        return packed_layout(columns, m.hidden_size, m.row_width)

    def finish(self, req: Any, capture: RequestCapture) -> Dict[str, Any]:
        """Seal a finished request: hand its rows to the writer and return the response reference."""
        n_out = req.finished_len if req.finished_len is not None else len(req.output_ids)
        output_ids = req.output_ids[:n_out]  # a copy of SGLang's array (or list)
        input_ids = prompt_ids(req)
        n_rows = row_count(len(input_ids), len(output_ids))
        columns = self.columns()
        path = self._file_path(capture)
        fp8 = capture.is_fp8
        ref = protocol.reference(rid=req.rid, path=path, index=index_path(self.config.capture_dir, req.rid),
                                 rows=n_rows, layers=self.model.layers, dtype=self.model.dtype,
                                 shapes={k: (n_rows, hi - lo) for k, (lo, hi) in columns.items()}, fp8=fp8)
        reason = req.finished_reason.to_json() if req.finished_reason is not None else {}
        share = None
        if self.shared is not None and reason.get("type") != "abort" and capture.failure is None:
            share, why = self.shared.share_of(req, capture.first_position(), n_rows)
            if why is not None:
                capture.fail(why)
        if reason.get("type") == "abort" or capture.failure is not None:
            if capture.failure is not None:
                ref.update(status="error", error=f"capture failed in the scheduler: {capture.failure}")
            else:
                ref.update(status="aborted", error=str(reason.get("message", "request aborted")))
            self._no_file(req, capture, ref["status"], ref["error"])
            return ref
        meta = self._meta(req.rid, capture, len(input_ids), len(output_ids), reason)
        if share is not None:
            tail, why = answer_tail(self.launched, self.processing, req, capture, len(input_ids), len(output_ids))
            self.answer_tails[why] += 1
            if tail is not None:  # its blocks hold the last token's row too: the next turn's match reaches it
                capture.keep(tail.start, tail.rows, tail.ready)
                share["blocks_end"] = n_rows + 1
        capture.seal()
        stored, dtypes = self.stored_layout(columns, fp8)
        self.writer.submit(CaptureJob(capture, n_rows, stored, input_ids, output_ids, meta, dtypes=dtypes, share=share,
                                      hashes=_hashes(req)))
        ref["status"] = "pending"
        return ref

    def finish_answered(self, req: Any, capture: RequestCapture) -> None:
        """``finish`` for a capture whose answer is already sent (an operator's): nothing can carry an
        error to its client, so a failure to seal it fails only it, recorded as its outcome, and the
        scheduler goes on with the batch's other captures."""
        try:
            self.finish(req, capture)
        except Exception as e:  # noqa: BLE001 - after the answer: fail this capture, never the server
            why = f"capture could not be sealed: {type(e).__name__}: {e}"
            logger.exception("sglang_capture: %s (request %s)", why, req.rid)
            self._no_file(req, capture, "error", why)

    def _no_file(self, req: Any, capture: RequestCapture, status: str, error: str) -> None:
        """A capture that gets no file: its rows freed, and its outcome recorded where monitoring finds
        it (its client may be gone, or was answered already)."""
        capture.release()
        self.writer.submit_outcome(req.rid, {"rid": req.rid, "name": capture.name, "path": self._file_path(capture),
                                             "status": status, "error": error})

    def _file_path(self, capture: RequestCapture) -> str:
        return os.path.join(self.config.capture_dir, capture.name + FILE_SUFFIX)

    def _meta(self, rid: str, capture: RequestCapture, n_prompt: int, n_output: int, reason: Dict[str, Any]
              ) -> Dict[str, Any]:
        """What a capture file records about its request and where its rows come from."""
        m = self.model
        meta = {
            "rid": rid,
            "capture_name": capture.name,
            "model": m.model_path,
            "architecture": m.architecture,
            "model_class": m.model_class,
            "hidden_size": m.hidden_size,
            "num_layers": m.num_layers,
            "layers": list(m.layers),
            "layer_convention": LAYER_CONVENTION,
            FINAL_META_KEY: self.config.final if self.config.keep_last_hidden else None,
            "dtype": m.dtype,
            "num_prompt_tokens": n_prompt,
            "num_output_tokens": n_output,
            "finish_reason": reason,
            "sglang_version": self._versions["sglang"],
            "sglang_capture_version": self._versions["sglang_capture"],
            "schema": SCHEMA_FP8 if capture.is_fp8 else SCHEMA,
            "created": time.time(),
        }
        if capture.is_fp8:
            meta.update(storage_dtype=FP8_DTYPE, scale_block=m.hidden_size)
        return meta

    def store_ahead(self, req: Any, capture: RequestCapture, prompt_rows: int) -> None:
        """A sharing capture's prefill is done (its ``prompt_rows`` rows are in): have a writer store
        the blocks of its prompt's whole slots now, not when its answer is done, so that requests
        sharing the prompt (a system prompt many chats open with at once) reuse them meanwhile. Its
        rows stay its own: the job holds the chunks until a writer has read them."""
        share = self.shared.ahead_share(req, capture.first_position(), prompt_rows)
        if share is None:
            return
        rows = capture.rows_so_far()
        for chunk in rows:  # storages the request holds already: counted once more, never waited for
            self.ledger.hold(chunk.rows)
        n_rows = slot_start(prompt_rows)  # whole slots: the blocks its file's job would cut there
        ids = prompt_ids(req)
        input_ids = joined(ids, req.output_ids)[:n_rows]
        stored, dtypes = self.stored_layout(self.columns(), capture.is_fp8)
        meta = self._meta(req.rid, capture, len(ids), 0, {})
        job = CaptureJob(capture, n_rows, stored, input_ids, [], meta, dtypes=dtypes, share=share, ahead_rows=rows,
                         ahead_of=getattr(req, SHARE_ATTR), hashes=_hashes(req))
        job.ahead_of.ahead_done = job.done  # queued: it releases whom it holds (its blocks are in flight)
        self.writer.submit(job)


def _hashes(req: Any) -> Optional[List[bytes]]:
    """A sharing capture's slot hashes known so far (its blocks in flight are planned from them)."""
    share = getattr(req, SHARE_ATTR, None)
    return share.hashes if share is not None else None
