"""Stop strings matched by an automaton built once per request: the same text and stop as searching every stop
string in the held text, however the text arrives, at a per-token cost that does not grow with their number."""
import random
import time

import pytest

from fake_worker_client import build_tokenizer
from gateway.stop_strings import StopStrings
from gateway.tokenizer import IncrementalDetokenizer
from worker.ipc.messages import RequestOutput

TOKENIZER = build_tokenizer()


def reference_release(held: str, text: str, stops: list[str], final: bool) -> tuple[str, str, str | None]:
    """(held after, text released, stop) by searching every stop string, as the detokenizer did."""
    buffer = held + text
    matches = [(i, s) for s in stops if (i := buffer.find(s)) >= 0]
    if matches:
        start, stop = min(matches, key=lambda m: m[0])
        return "", buffer[:start], stop
    keep = 0
    if not final:
        keep = next((n for n in range(min(len(buffer), max(map(len, stops)) - 1), 0, -1)
                     if any(s.startswith(buffer[-n:]) for s in stops)), 0)
    return buffer[len(buffer) - keep:], buffer[:len(buffer) - keep], None


@pytest.mark.parametrize("seed", range(40))
def test_the_automaton_releases_and_stops_as_searching_every_stop_string(seed):
    rng = random.Random(seed)
    alphabet = "abc" if seed % 2 else "abcdé"
    stops = list(dict.fromkeys("".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in range(rng.randint(1, 8))))
    text = "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    automaton, state, held = StopStrings(tuple(stops)), 0, ""
    for i, chunk in enumerate(chunks):
        final = i == len(chunks) - 1
        expected_held, released, stop = reference_release(held, chunk, stops, final)
        state, ended = automaton.advance(state, chunk)
        assert ended == (stop is not None)
        if stop is None:
            assert final or automaton.held_length(state) == len(expected_held)
        held = expected_held
        if stop is not None:
            break


def _detokenizer_seconds_per_token(stops: list[str], ids: list[int]) -> float:
    best = float("inf")
    for _ in range(5):
        detokenizer = IncrementalDetokenizer(TOKENIZER, [], stop=stops)     # built outside the timed steps
        start = time.perf_counter()
        for token in ids:
            detokenizer.update(RequestOutput("r", [token]))
        best = min(best, time.perf_counter() - start)
    return best / len(ids)


def test_a_token_with_20000_stop_strings_costs_what_one_with_a_single_stop_string_does():
    """Searching every stop string per token made the ratio about 1,000; the automaton reads the new text alone."""
    ids = TOKENIZER.encode("hello world, hello there " * 8)
    many = [f"zz{i}q" for i in range(20_000)] + ["hello x"]
    one = ["hello x"]
    many_seconds = _detokenizer_seconds_per_token(many, ids)
    one_seconds = _detokenizer_seconds_per_token(one, ids)
    assert many_seconds < 4 * one_seconds
