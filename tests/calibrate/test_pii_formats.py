"""PII in shapes the synthetic-log generator never plants: each is scrubbed to its type, and
look-alikes that are not PII (slices, times, versions, MAC addresses, plain numbers) stay."""

import pytest

from quantpipe.calibrate.clean import scrub

PII = [
    ("ping 2001:db8::1 now", "2001:db8::1", "IP"),
    ("link-local fe80::1ff:fe23:4567:890a here", "fe80::1ff:fe23:4567:890a", "IP"),
    ("full 2001:0db8:85a3:0000:0000:8a2e:0370:7334 form", "2001:0db8:85a3:0000:0000:8a2e:0370:7334", "IP"),
    ("mon numéro: +33 1 42 68 53 00", "+33 1 42 68 53 00", "PHONE"),
    ("Tel. +49 30 901820", "+49 30 901820", "PHONE"),
    ("whatsapp +91 98765 43210 pls", "+91 98765 43210", "PHONE"),
    ("UK +44 20 7946 0958 office", "+44 20 7946 0958", "PHONE"),
    ("Tokyo 03-1234-5678 desk", "03-1234-5678", "PHONE"),
    ("key sk-ant-api03-abcdefghijklmnopqrstuvwxyz0123456789ABCD", "sk-ant-api03-abcdefghij", "API_KEY"),
    ("stripe sk_live_51H8abcdefghijklmnopqrstuvwx", "sk_live_51H8abcdefghij", "API_KEY"),
    ("token hf_abcdefghijklmnopqrstuvwxyzABCDEFGH ok", "hf_abcdefghijklmnop", "API_KEY"),
    ("gitlab glpat-abcdefghij1234567890 ok", "glpat-abcdefghij1234567890", "API_KEY"),
    ("post to https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX",
     "hooks.slack.com/services/T00000000", "API_KEY"),
    ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "wJalrXUtnFEMI", "API_KEY"),
    ('client_secret: "0123456789abcdef0123"', "0123456789abcdef0123", "API_KEY"),
    ("jwt eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
     "eyJhbGciOiJIUzI1NiIs", "API_KEY"),
    ("key:\n-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA1234\n-----END RSA PRIVATE KEY-----\nthanks",
     "MIIEpAIBAAKCAQEA1234", "API_KEY"),
    ("write to first.last@mail.eng.example.co.uk now", "first.last@mail.eng.example.co.uk", "EMAIL"),
    ("alice+newsletter@example.com", "alice+newsletter", "EMAIL"),
]


@pytest.mark.parametrize("text, secret, kind", PII, ids=[f"{k}-{i}" for i, (_, _, k) in enumerate(PII)])
def test_pii_the_generator_does_not_plant_is_scrubbed(text, secret, kind):
    counts: dict[str, int] = {}
    out = scrub(text, counts)
    assert secret not in out and f"<{kind}>" in out, out
    assert counts.get(kind, 0) >= 1


@pytest.mark.parametrize("text", [
    "use x[::2] and y[1::3] and a::b in C++ std::vector",
    "at 2026-12-05 10:30:00 the job 12:30:45 ran",
    "torch 2.13.0 and python 3.11.7",
    "compute 3 + 4 * (5 - 2) = 12",
    "score +12 points, total +1000",
    "mac de:ad:be:ef:00:01",
    "the answer is 1234567890123",
    "the monkey = bananabananabanana12",
])
def test_look_alikes_stay(text):
    counts: dict[str, int] = {}
    assert scrub(text, counts) == text and counts == {}
