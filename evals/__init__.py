"""Eval suites, metrics and gate policies."""
