"""Streaming text deltas that never show a client part of a stop string.

The engine checks stop strings on the cumulative text and, when one completes, cuts
the text before it. While streaming, the tail of the text may be the start of a stop
string that the next token completes; that tail is held back until it either becomes
a full stop string (then cut by the engine and never sent) or stops matching. Because
the text only grows by appending, everything sent stays a prefix of the final text.
"""

from __future__ import annotations


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s), len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextDeltas:
    def __init__(self, stops: list[str]):
        self.stops = stops
        self.sent = 0  # characters of the cumulative text already sent

    def delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished or not self.stops else len(text) - held_back(text, self.stops)
        if end <= self.sent:
            return ""
        piece = text[self.sent:end]
        self.sent = end
        return piece
