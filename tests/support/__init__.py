"""Shared test helpers (real backends, tiny models, sandbox)."""
