"""Near-duplicate normalization against a plain word-by-word reference written here."""

from __future__ import annotations

import random
import re

from quantpipe.calibrate.clean import normalize


def reference(text: str) -> str:
    """Lower case, digits as 0 (runs as one), mid-sentence capitalized words as N, single spaces."""
    out, prev = [], "."
    for w in text.translate(str.maketrans("123456789", "000000000")).split():
        if w[0].isupper() and not prev.endswith((".", "!", "?", ":")):
            out.append("N")
        else:
            out.append(re.sub("0+", "0", w.lower()))
        prev = w
    return " ".join(out)


def test_normalize_equals_the_word_by_word_reference():
    rng = random.Random(0)
    alphabet = [chr(i) for i in range(128)] + ["  ", " A", ". B", "x Cd", "00", "10 20", "\u00c9", " \u03a9",
                                               "\u0130", "\u00df", "\u2003", "\x00"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(20000)]
    texts += ["Hello World. Again Here: Yes", "a\x00 Bob", "We met Bob in 2019 and 2020 at 10:30.", ""]
    for t in texts:
        assert normalize(t) == reference(t), repr(t)
