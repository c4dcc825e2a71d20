"""Prefix caching on the real server (on by default): a repeated prompt is served from the cache, counted by
vllm:prefix_cache_queries / _hits in prompt tokens, and answers what the offline engine answers."""
from __future__ import annotations

import time

ADAPTER = "doctests"
BLOCK = 16                  # --block-size's default
PROMPT = ("A prefix cache keeps the keys and values of whole blocks of a prompt, so that the next request "
          "which begins with the same words under the same adapter skips recomputing them entirely.")


def counters(server) -> tuple[float, float]:
    return server.metric("vllm:prefix_cache_queries_total"), server.metric("vllm:prefix_cache_hits_total")


def counters_after(server, before: tuple[float, float], timeout_s: float = 5.0) -> tuple[float, float]:
    """The counters once the worker's Stats after the request reached the gateway (they trail its output)."""
    deadline = time.monotonic() + timeout_s
    while (now := counters(server)) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def test_repeated_prompt_hits_the_cache_and_the_counters_move(server, reference):
    num_prompt = len(reference.encode(PROMPT))
    assert num_prompt > 2 * BLOCK
    answers, moves = [], []
    for _ in range(2):
        before = counters(server)
        answer = server.openai.completions.create(model=ADAPTER, prompt=PROMPT, temperature=0.0, max_tokens=4,
                                                  extra_body={"ignore_eos": True})
        after = counters_after(server, before)
        answers.append(answer.choices[0].text)
        moves.append((after[0] - before[0], after[1] - before[1]))
    assert moves == [(num_prompt, 0), (num_prompt, (num_prompt - 1) // BLOCK * BLOCK)]
    assert answers[0] == answers[1]
