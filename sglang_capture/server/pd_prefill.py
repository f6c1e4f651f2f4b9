"""Capture on a PD prefill server (``--disaggregation-mode prefill``): what differs per request.

A prefill server computes the prompt's forward, samples one token and hands the KV cache to a
decode server, which computes every later token. So the prompt's rows are all a prefill server
can capture (hooks/results.py takes them), which is what ``sglang-capture extract`` asks for
(``max_new_tokens`` 1). Two rules follow:

- A capture request that asks for more new tokens needs rows the decode server computes: its
  capture fails with a message saying so, and the request itself goes on (a router's request
  still decodes on the decode server), since SGLang resets every request on a prefill server to
  one new token.
- A capture request sent straight to the prefill server, without the bootstrap fields a PD
  router adds, has no decode server waiting for its KV (and SGLang's scheduler would refuse it).
  The HTTP process marks it the way SGLang marks its own warm-up and health requests
  (``FAKE_BOOTSTRAP_HOST``): prefilled, its KV handed to no one, answered at once. Capture
  clients then work against prefill servers unchanged.
"""
from __future__ import annotations

import random
from typing import Any, Optional


def is_pd_prefill(server_args: Any) -> bool:
    return getattr(server_args, "disaggregation_mode", None) == "prefill"


def decode_rows_error(req: Any) -> Optional[str]:
    """Why ``req``'s capture cannot be complete on a prefill server, or None when it can."""
    wanted = req.sampling_params.max_new_tokens
    if wanted is None or wanted <= 1:
        return None
    return (f"this is a PD prefill server (--disaggregation-mode prefill): it captures the prompt's rows only, and "
            f"this request asks for {wanted} new tokens, whose rows the decode server computes; send capture "
            f"requests with max_new_tokens 1")


def prefill_only_without_router(tokenized: Any) -> None:
    """A tokenized capture request with no bootstrap fields runs as SGLang's fake-transfer requests.
    The room is random: under DP SGLang sends a request to the DP rank its room names."""
    if tokenized.bootstrap_host is not None or tokenized.bootstrap_room is not None:
        return
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    tokenized.bootstrap_host = FAKE_BOOTSTRAP_HOST
    tokenized.bootstrap_room = random.getrandbits(63)


def chunk_like_any_request(req: Any) -> None:
    """Undo SGLang's ``skip_radix_cache_insert`` for a fake-bootstrap capture request (scheduler).

    SGLang sets it for that host so that its warm-up requests leave nothing in the radix cache; but
    it also skips ``cache_unfinished_req`` between prefill chunks, which is what advances a chunked
    request's prefix, so a prompt longer than one chunk ran its first chunk again and again until
    the KV pool was full (SGLang's own such requests are a few tokens long). A capture request has
    its own radix-cache namespace (its ``extra_key``), so caching its chunks matches nobody else's.
    """
    req.skip_radix_cache_insert = False
