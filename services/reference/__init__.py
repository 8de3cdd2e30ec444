"""Greedy reference completions from a server: clients of SGLang / OpenAI-compatible servers, and a small server
of our own for tests and CPU users."""
