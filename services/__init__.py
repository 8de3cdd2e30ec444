"""What crosses HTTP: the servers dflash-eval ships (the checkpoint relay, a reference server, the report server) on
one bounded background-server base, and the clients of the servers it talks to (the relay, SGLang and
OpenAI-compatible reference servers) on one retrying session. No Prefect."""
