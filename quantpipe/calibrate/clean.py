"""Cleaning: PII scrubbed to typed placeholders, exact and near-duplicates found.

PII: emails, phone numbers (national and international groupings), card numbers (digit
runs that pass the Luhn check, so ids and timestamps stay), IPv4/IPv6 addresses (IPv6
compressed too), API keys and secrets (OpenAI, Anthropic, AWS, GitHub, GitLab, Slack
tokens and webhooks, Google, Stripe, Hugging Face shapes, JWTs, PEM private keys, and
`api_key = ...` / `client_secret: ...` assignments) and bearer tokens become <TYPE>
placeholders, counted per type.

Near-duplicates: texts are normalized (case, digits, capitalized words, whitespace),
cut into overlapping character 5-grams, and summarized by a 64-value MinHash signature;
signatures that agree on every row of any of 16 bands become candidate pairs, kept as
duplicates when their estimated Jaccard similarity reaches the threshold. So texts that
differ only in numbers, names or whitespace have identical signatures and count once.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re

import numpy as np

# The patterns; each only runs on texts (or spans) its cheap hint says may hold a match,
# since most calibration texts hold no PII at all and regexes cost ~50 ns per character.
_BEARER = re.compile(r"\b[Bb]earer\s+[A-Za-z0-9._~+/=-]{12,}")
_API_KEY = re.compile(
    r"\b(?:sk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}|AKIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{30,}|xox[abpr]-[A-Za-z0-9-]{10,}"
    r"|AIza[0-9A-Za-z_-]{35}|[sr]k_(?:live|test)_[A-Za-z0-9]{20,}|hf_[A-Za-z0-9]{30,}|glpat-[A-Za-z0-9_-]{20,}"
    r"|eyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,})"  # Stripe, Hugging Face, GitLab, JWTs
    r"\b|https://hooks\.slack\.com/services/[A-Za-z0-9/]{20,}"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.S)
# `api_key = "..."`: the value goes, the name stays (it tells the model what the line is).
_KEY_ASSIGN = re.compile(r"(?i)((?<![a-z0-9])(?:api[_-]?key|secret[_-]?key|secret[_-]?access[_-]?key|access[_-]?token|auth[_-]?token"
                         r"|client[_-]?secret)\b\s*[:=]\s*[\"']?)"
                         r"[A-Za-z0-9._/+-]{16,}")
_API_KEY_HINTS = ("sk-", "AKIA", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "xox", "AIza", "k_live_", "k_test_", "hf_",
                  "glpat-", "eyJ", "hooks.slack.com", "PRIVATE KEY")
_ASSIGN_HINTS = ("key", "KEY", "Key", "token", "TOKEN", "Token", "secret", "SECRET", "Secret")
# What every `api_key = ...` match contains; a charset-led pattern that re scans quickly,
# while the full pattern (case-insensitive alternation) costs ~45 us on a 1 KB text.
_ASSIGNED_VALUE = re.compile(r"[:=]\s*[\"']?[A-Za-z0-9._/+-]{16}")
_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
# IPv6 in any written form (full, `::`-compressed, with an IPv4 tail): candidates that
# ipaddress accepts and that hold at least three groups (so `x[::2]` and `a::b` stay).
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|(?:\d{1,3}\.){3}\d{1,3})?(?![\w:])")
# Runs of digits and separators long enough to be a card, an IPv4 address or a phone number.
_NUMBERISH = re.compile(r"[0-9][0-9 .:()+-]{5,}[0-9]")
_CARD = re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")
_IPV4 = re.compile(r"(?<![\d.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?![\d.])")
_PHONE = re.compile(r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]\d{3,4}(?![\w-])"
                    r"|(?<![\w+])\+\d{10,14}(?!\w)")
# International numbers written in other groupings (+33 1 42 68 53 00, +49 30 901820,
# +91 98765 43210): a country code, then groups, 8 to 15 digits in all (E.164's limit).
_INTL_PHONE = re.compile(r"(?<![\w+])\+\d{1,3}(?:[ .-]?\(?\d{1,5}\)?){2,6}(?![\w-])")
PII_TYPES = ("BEARER_TOKEN", "API_KEY", "EMAIL", "CARD", "IP", "PHONE")


def _luhn(digits: str) -> bool:
    total, alt = 0, False
    for ch in reversed(digits):
        d = ord(ch) - 48
        if alt:
            d *= 2
            if d > 9:
                d -= 9
        total += d
        alt = not alt
    return total % 10 == 0


def _sub(pattern: re.Pattern, name: str, text: str, counts: dict[str, int]) -> str:
    text, n = pattern.subn(f"<{name}>", text)
    if n:
        counts[name] = counts.get(name, 0) + n
    return text


def _counted(name: str, counts: dict[str, int], keep):
    def replace(m: re.Match) -> str:
        if not keep(m.group(0)):
            return m.group(0)
        counts[name] = counts.get(name, 0) + 1
        return f"<{name}>"
    return replace


def _is_ipv6(candidate: str) -> bool:
    if sum(1 for g in candidate.split(":") if g) < 3:
        return False
    try:
        ipaddress.IPv6Address(candidate)
    except ValueError:
        return False
    return True


def _numbers(span: str, counts: dict[str, int]) -> str:
    # a long number that fails the Luhn check is an id or a timestamp, not a card
    span = _CARD.sub(_counted("CARD", counts, lambda t: _luhn(re.sub(r"\D", "", t))), span)
    span = _sub(_IPV4, "IP", span, counts)
    span = _sub(_PHONE, "PHONE", span, counts)
    return _INTL_PHONE.sub(_counted("PHONE", counts, lambda t: 8 <= sum(c.isdigit() for c in t) <= 15), span)


def scrub(text: str, counts: dict[str, int]) -> str:
    """`text` with PII replaced by typed placeholders (<EMAIL>, ...); counts[TYPE] += hits.

    Most specific first: tokens and keys, emails, then numbers (cards before phones, so a
    card is never half-eaten by the phone pattern).
    """
    if "earer" in text:
        text = _sub(_BEARER, "BEARER_TOKEN", text, counts)
    if any(h in text for h in _API_KEY_HINTS):
        text = _sub(_API_KEY, "API_KEY", text, counts)
    if any(h in text for h in _ASSIGN_HINTS) and _ASSIGNED_VALUE.search(text):
        text, n = _KEY_ASSIGN.subn(r"\1<API_KEY>", text)
        if n:
            counts["API_KEY"] = counts.get("API_KEY", 0) + n
    if "@" in text:
        text = _sub(_EMAIL, "EMAIL", text, counts)
    if "::" in text or text.count(":") >= 7:
        text = _IPV6.sub(_counted("IP", counts, _is_ipv6), text)
    pieces, last = [], 0
    for m in _NUMBERISH.finditer(text):
        # Widen by two characters on the left: a phone's "+1 " or "(" sits before its first digit.
        s = max(last, m.start() - 2)
        e = min(len(text), m.end() + 1)
        pieces.append(text[last:s])
        pieces.append(_numbers(text[s:e], counts))
        last = e
    if not pieces:
        return text
    pieces.append(text[last:])
    return "".join(pieces)


def exact_key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


_DIGITS = str.maketrans("123456789", "000000000")
_SENTENCE_END = (".", "!", "?", ":", "\n")
_ZEROS = re.compile("0+")


def normalize(text: str) -> str:
    """What near-duplicate detection compares: no case, digits, mid-sentence names or spacing."""
    words = text.translate(_DIGITS).split()
    # A capitalized word inside a sentence is most likely a name: all names look alike.
    names = [i for i, w in enumerate(words) if w[0].isupper() and i and not words[i - 1].endswith(_SENTENCE_END)]
    if names and "\0" in text:  # NUL marks names below; a text that holds one takes the slow road
        marked = set(names)
        return " ".join("N" if i in marked else _ZEROS.sub("0", w.lower()) for i, w in enumerate(words))
    for i in names:
        words[i] = "\0"  # lower() leaves it alone
    out = " ".join(words).lower()
    if names:
        out = out.replace("\0", "N")
    return _ZEROS.sub("0", out) if "0" in out else out  # every number looks alike


NUM_PERM, BANDS = 32, 8  # 8 bands of 4 rows: a pair at Jaccard 0.8 becomes a candidate 98.5% of the time
_ROWS = NUM_PERM // BANDS
_rng = np.random.default_rng(0x5EED)  # fixed: signatures must not depend on the run
# Multiply-shift hashing: odd 64-bit multipliers, products taken mod 2^64, top 32 bits kept.
# (Without the wrap-around every "permutation" would order shingles the same way.)
_A = _rng.integers(0, 1 << 63, NUM_PERM, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
_B = _rng.integers(0, 1 << 63, NUM_PERM, dtype=np.uint64)
_WINDOW = 12  # characters hashed at each word start: a shingle spans about two words
_POW = np.array([pow(1099511628211, i, 1 << 64) for i in range(_WINDOW)], dtype=np.uint64)
_MAX_CHARS = 8192  # enough text to tell documents apart; bounds the cost of very long ones


def minhash(norm: str) -> np.ndarray:
    """32 MinHash values (uint32) of the shingles starting at each word of normalized text."""
    return minhash_batch([norm])[0]


def minhash_batch(norms: list[str]) -> np.ndarray:
    """[len(norms), 32] MinHash signatures, 64 texts to a few numpy calls.

    Groups of 64 keep the [shingles, 32] hash table in cache: 1,024 texts at once ran
    about 5x slower per text.
    """
    if len(norms) > _GROUP:
        return np.concatenate([_minhash_group(norms[i:i + _GROUP]) for i in range(0, len(norms), _GROUP)])
    return _minhash_group(norms)


_GROUP = 64


def _minhash_group(norms: list[str]) -> np.ndarray:
    """MinHash signatures of a few texts.

    The texts are laid end to end (separated by a window of spaces, so no shingle spans
    two texts); shingles start at word starts; each text's minimum is taken with reduceat.
    """
    pieces, offsets, pos = [], [], 0
    for norm in norms:
        data = norm[:_MAX_CHARS].encode("utf-8") or b"_"
        offsets.append(pos)
        pieces.append(data)
        pieces.append(b" " * _WINDOW)
        pos += len(data) + _WINDOW
    b = np.frombuffer(b"".join(pieces), dtype=np.uint8).astype(np.uint64)
    n = len(b) - _WINDOW + 1
    starts = np.flatnonzero(b[:n] != 32)
    starts = starts[(starts == 0) | (b[np.maximum(starts - 1, 0)] == 32)]  # word starts
    h = np.zeros(len(starts), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(_WINDOW):
            h += b[starts + i] * _POW[i]
        vals = (np.multiply.outer(h, _A) + _B) >> np.uint64(32)
    # Every text has at least one word start (empty texts were given a placeholder).
    first = np.searchsorted(starts, np.array(offsets, dtype=np.int64))
    return np.minimum.reduceat(vals, first, axis=0).astype(np.uint32)


def near_dup_groups(signatures: np.ndarray, threshold: float) -> np.ndarray:
    """For each row, the index of the earliest row in its near-duplicate group (itself if none).

    Candidate pairs share all rows of some band; a pair is linked when the share of equal
    MinHash values (the Jaccard estimate) reaches `threshold`. Groups are the connected
    components, so the earliest text of each group is the one kept.
    """
    n = len(signatures)
    parent = np.arange(n)

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    need = int(np.ceil(threshold * NUM_PERM - 1e-9))
    for band in range(BANDS):
        keys = np.ascontiguousarray(signatures[:, band * _ROWS:(band + 1) * _ROWS]).view(
            np.dtype((np.void, 4 * _ROWS))).ravel()
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        same = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1])
        for k in same:  # consecutive equal keys: link each to the first of its run
            i, j = order[k], order[k + 1]
            if np.count_nonzero(signatures[i] == signatures[j]) >= need:
                ri, rj = find(i), find(j)
                if ri != rj:
                    parent[max(ri, rj)] = min(ri, rj)
    return np.array([find(i) for i in range(n)])
