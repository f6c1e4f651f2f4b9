"""What each patch does: one small module per seam family, wrapt wrappers only, no I/O.

``patches/`` says which SGLang functions are wrapped and by which function here. Every hook
takes its process's state as its first argument, bound by the instrumentor: the scheduler
process's ``SchedulerCapture``, or the ``CaptureConfig`` in the HTTP process (``admission``,
``tokenize``, ``response``).

The order in which SGLang calls the seams, for one batch on one scheduler (0.5.17 and 0.5.23):

0. ``auth`` and ``generate`` (``decide_request_auth``, ``TokenizerManager.generate_request``, HTTP
   process, admission.py): a client's capture request ``--capture-clients`` does not allow is
   refused before anything else happens.
   ``tokenize`` (``TokenizerManager._create_tokenized_object``, HTTP process): the requests the
   server selects (``--capture-return-hidden-states``, ``--capture-fraction``) are marked like a
   client's capture request; on a PD prefill server a capture request sent without a router gets
   SGLang's no-decode-server bootstrap.
1. ``request`` (``Req.__init__``): a capture request is marked when the scheduler creates it.
2. ``batch_run`` (``Scheduler.run_batch``): the batch is launched. Its ``BatchRows``
   (``batch_rows.py``) becomes ``SchedulerCapture.launching`` for the duration of the call, and is then
   attached to the result object ``run_batch`` returns.
3. ``final_hidden`` (``LogitsProcessor._get_hidden_states_to_store``), inside the forward of
   step 2: the final hidden state joins the aux layers; in an eager forward only the capture
   requests' rows are kept, and ``launching`` records which.
4. ``result_copy`` (``GenerationBatchResult.copy_to_cpu``): inside step 2 with overlap
   scheduling, or later for delayed sampling (grammars), or never (``--disable-overlap-schedule``:
   the rows then stay on the device). It finds the batch's state on the result object first.
5. ``batch_result`` (``Scheduler.process_batch_result``): with overlap, one iteration later,
   after the next batch was launched. Its ``ResultRows`` becomes ``SchedulerCapture.processing``.
6. ``prefill_rows`` / ``decode_rows`` (``_append_*_hidden_states``), inside step 5: rows are
   taken by absolute position through ``processing``. On a PD prefill server step 5 calls
   ``process_batch_result_disagg_prefill`` instead, which reads no hidden states: ``pd_prefill_rows``
   takes every chunk's rows before it runs.
7. ``finish`` (``_stream_output_generation``), inside step 5: finished requests are sealed and
   handed to the writer; ``response`` (HTTP process) waits for the writer's outcome, and
   ``openai_reference`` (``process_hidden_states_from_ret``) puts the reference in an OpenAI
   response's choice.

No per-batch state lives in module globals: a batch's state is reached through its result
object, so it does not matter which batch runs while another's result is processed.
"""
