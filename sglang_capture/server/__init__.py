"""What runs inside SGLang's processes: the HTTP (main) process and every scheduler process.

The launcher (``launch``) validates options and starts SGLang; the plugin entry point
(``plugin``) reaches SGLang's spawned processes, where the instrumentor (``instrumentor``)
wraps the seams that ``patches/`` names with the hooks in ``hooks/``. Per process, one
``SchedulerCapture`` (``scheduler_capture``) holds the model facts, the per-request state
(``request_capture``), the host pool (``host_pool``) and the link to the writer supervisor process
(``writer_pool``). Everything on the scheduler thread is bookkeeping: tensors are handed off.
"""
