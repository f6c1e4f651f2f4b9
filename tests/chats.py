"""Chat traffic on a test server: a chat's turns, each re-sending the one before with its answer."""
from __future__ import annotations

import random
from typing import Any, Dict, Optional, Tuple

PROMPT = 300  # tokens of a chat's first turn
ANSWER = 12  # tokens of each answer
USER = 40  # tokens the second turn adds after the first's answer


def chat_turns(server: Any, seed: int, capture_name: Optional[str] = None, **routing: Any
               ) -> Tuple[int, Dict[str, Any], Dict[str, Any]]:
    """A chat's two turns on ``server`` (plain requests, or captures named ``capture_name-1`` and
    ``-2``; ``routing``: more request fields, SGLang's ``routed_dp_rank`` say): the first turn's prompt
    length and both responses."""
    rng = random.Random(seed)
    prompt = [rng.randrange(10, 1000) for _ in range(PROMPT)]

    def turn(ids, t):
        params: Dict[str, Any] = {"max_new_tokens": ANSWER, "temperature": 0, "ignore_eos": True}
        if capture_name is not None:
            params["custom_params"] = {"capture": True, "capture_name": f"{capture_name}-{t}"}
        r = server.generate({"input_ids": ids, "sampling_params": params, **routing})
        assert r.status_code == 200, r.text
        return r.json()

    one = turn(prompt, 1)
    return len(prompt), one, turn(prompt + one["output_ids"] + [rng.randrange(10, 1000) for _ in range(USER)], 2)
