"""StopStrings: a request's stop strings as an Aho-Corasick automaton, built once per request (its choices share
it), so that text is matched at a cost per character that does not grow with the number of stop strings.

A state is the longest tail of the text read so far that begins some stop string; its depth is that tail's
length, the text a detokenizer must hold back. Running example: stop strings ["abc", "bd"], text "xab": the state
is "ab" (depth 2); then "d": no stop string continues "abd", the fail link of "ab" is "b", which "d" extends to
"bd", a whole stop string: a match ends here.
"""
from __future__ import annotations

from collections import deque
from functools import lru_cache


class StopStrings:
    def __init__(self, strings: tuple[str, ...]):
        self.strings = strings
        self._next: list[dict[str, int]] = [{}]     # state -> character -> state
        self._depth = [0]                           # state -> length of its tail
        self._ends = [False]                        # state -> some stop string is a tail of its text
        for s in strings:
            self._insert(s)
        self._fail = self._link()

    @staticmethod
    @lru_cache(maxsize=8)
    def of(strings: tuple[str, ...]) -> StopStrings:
        """The automaton of `strings`, built once for the consecutive choices of one request."""
        return StopStrings(strings)

    def advance(self, state: int, text: str) -> tuple[int, bool]:
        """(the state after reading `text` from `state`, whether a stop string ends in `text` or at `state`)."""
        ended = self._ends[state]
        nexts, fail = self._next, self._fail
        for char in text:
            while state and char not in nexts[state]:
                state = fail[state]
            state = nexts[state].get(char, 0)
            ended = ended or self._ends[state]
        return state, ended

    def held_length(self, state: int) -> int:
        """Characters at the end of the text read that could begin a stop string."""
        return self._depth[state]

    def _insert(self, s: str) -> None:
        state = 0
        for char in s:
            if char not in self._next[state]:
                self._next[state][char] = len(self._next)
                self._next.append({})
                self._depth.append(self._depth[state] + 1)
                self._ends.append(False)
            state = self._next[state][char]
        self._ends[state] = True

    def _link(self) -> list[int]:
        """Fail links, breadth first: a state's longest proper tail that is also a state; `_ends` is closed
        under them (a state ends a stop string when its fail link does)."""
        fail = [0] * len(self._next)
        queue = deque(self._next[0].values())
        while queue:
            state = queue.popleft()
            for char, child in self._next[state].items():
                link = fail[state]
                while link and char not in self._next[link]:
                    link = fail[link]
                fail[child] = self._next[link].get(char, 0)
                self._ends[child] = self._ends[child] or self._ends[fail[child]]
                queue.append(child)
        return fail
