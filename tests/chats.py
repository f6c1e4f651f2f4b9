"""Chat traffic on a test server: a chat's turns, each re-sending the one before with its answer."""
from __future__ import annotations

import random
from typing import Any, Dict, Optional, Tuple

PROMPT = 300  # tokens of a chat's first turn
ANSWER = 12  # the most tokens of each answer
USER = 40  # tokens the second turn adds after the first's answer
# Answers end on one of these (as a chat's answer ends on its end-of-turn token), not at their length:
# SGLang 0.5.22 on leaves a request its length ends out of the decode step launched after its last
# token, while a token-ended answer is fed to that step on every release (server/answer_tail.py).
STOP_IDS = list(range(10, 1000, 3))


def _release(v: str) -> tuple:
    return tuple(int(x) for x in v.split("."))


def length_ended_last_row() -> int:
    """1 where the installed SGLang feeds an answer its *length* ends to the step after it, so the radix
    cache holds its last token and a capture keeps that row (``rows_for_next_turn``); 0 from 0.5.22,
    which leaves such a request out of that step (``Scheduler._reqs_finishing_inflight``)."""
    from sglang_capture.patches.version_gate import installed_sglang_version

    return int(_release(installed_sglang_version()) < (0, 5, 22))


def chat_turns(server: Any, seed: int, capture_name: Optional[str] = None, **routing: Any
               ) -> Tuple[int, Dict[str, Any], Dict[str, Any]]:
    """A chat's two turns on ``server`` (plain requests, or captures named ``capture_name-1`` and
    ``-2``; ``routing``: more request fields, SGLang's ``routed_dp_rank`` say), each answer ended by a
    stop token: the first turn's tokens (prompt and answer: what the radix cache may hold of it) and
    both responses."""
    rng = random.Random(seed)
    prompt = [rng.randrange(10, 1000) for _ in range(PROMPT)]

    def turn(ids, t):
        params: Dict[str, Any] = {"max_new_tokens": ANSWER, "temperature": 0, "stop_token_ids": STOP_IDS}
        if capture_name is not None:
            params["custom_params"] = {"capture": True, "capture_name": f"{capture_name}-{t}"}
        r = server.generate({"input_ids": ids, "sampling_params": params, **routing})
        assert r.status_code == 200, r.text
        return r.json()

    one = turn(prompt, 1)
    # a stop token ended it, before its length would have (where 0.5.22 on would leave it out of the next step)
    assert one["meta_info"]["finish_reason"]["type"] == "stop" and len(one["output_ids"]) < ANSWER, one["meta_info"]
    history = prompt + one["output_ids"]
    return len(history), one, turn(history + [rng.randrange(10, 1000) for _ in range(USER)], 2)
