"""What each patch does: one small module per seam family, wrapt wrappers only.

``patches/`` says which SGLang functions are wrapped and by which function here; a seam is named
after its hook function. Every hook takes its process's state as its first argument, bound by the
instrumentor: the scheduler process's ``SchedulerCapture``, or the ``CaptureConfig`` in the HTTP
process (admission.py, tokenize.py, response.py). The scheduler's hooks do no I/O: rows reach the
writer processes through the writer pool. The one file read is in the HTTP process:
``await_capture_file`` reads the writer's outcome record once inotify says it is there (outcome_watch.py). No
hook imports another (tests/test_boundaries.py): what two hooks share lives in ``server/`` or
``core/``.

The order in which SGLang calls the seams, for one batch on one scheduler (0.5.17 and 0.5.23):

0. ``admit_admin_key`` and ``refuse_unallowed_capture`` (``decide_request_auth``,
   ``TokenizerManager.generate_request``, HTTP process, admission.py): a client's capture request
   ``--capture-clients`` does not allow is refused before anything else happens.
   ``admit_capture_request`` (``TokenizerManager._create_tokenized_object``, HTTP process): the
   requests the server selects (``--capture-return-hidden-states``, ``--capture-fraction``) are marked like a
   client's capture request; on a PD prefill server a capture request sent without a router gets
   SGLang's no-decode-server bootstrap.
1. ``mark_capture_request`` (``Req.__init__``): a capture request is marked when the scheduler
   creates it.
2. ``run_batch`` (``Scheduler.run_batch``): the batch is launched. Its ``BatchRows``
   (``batch_rows.py``) becomes ``SchedulerCapture.launching`` for the duration of the call, and is then
   attached to the result object ``run_batch`` returns.
3. ``append_final_hidden`` (``LogitsProcessor._get_hidden_states_to_store``), inside the forward of
   step 2: the final hidden state joins the aux layers; in an eager forward only the capture
   requests' rows are kept, and ``launching`` records which.
3b. ``aux_for_draft`` (``EagleDraftExtendInput.__post_init__``, a server that speculates with
   EAGLE-3), inside step 2 after the target's forward: the draft-extend pass is handed the aux
   columns of the target's rows, without the final hidden state (hooks/draft.py).
4. ``copy_hidden_to_pool`` (``GenerationBatchResult.copy_to_cpu``): inside step 2 with overlap
   scheduling, or later for delayed sampling (grammars), or never (``--disable-overlap-schedule``:
   the rows then stay on the device). It finds the batch's state on the result object first.
5. ``batch_result_context`` (``Scheduler.process_batch_result``): with overlap, one iteration later,
   after the next batch was launched. Its ``ResultRows`` becomes ``SchedulerCapture.processing``.
6. ``take_prefill_rows`` / ``take_decode_rows`` (``_append_*_hidden_states``), inside step 5:
   rows are taken by absolute position through ``processing``. On a PD prefill server step 5
   calls ``process_batch_result_disagg_prefill`` instead, which reads no hidden states:
   ``take_pd_prefill_rows`` takes every chunk's rows before it runs.
7. ``seal_finished`` (``_stream_output_generation``), inside step 5: finished requests are sealed and
   handed to the writer; ``await_capture_file`` (HTTP process) waits for the writer's outcome, and
   ``openai_reference`` (``process_hidden_states_from_ret``) puts the reference in an OpenAI
   response's choice; ``chat_stream_reference`` and ``completion_stream_reference`` (SGLang's OpenAI
   stream generators) send a streamed response's references in one chunk after its choices' own.

No per-batch state lives in module globals: a batch's state is reached through its result
object, so it does not matter which batch runs while another's result is processed.
"""
