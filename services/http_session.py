"""The retrying `requests.Session` every HTTP client of ours talks through (the relay's, the reference
backends'): urllib3's `Retry` on a bounded pool of connections.

What is retried: connection errors, timeouts, and the answers a retry may fix (RETRY_STATUSES: a
server's own errors, an upstream's failure passed on as 502, a busy server's 503), for the `methods`
a client may send again.
Backoff is urllib3's: the first retry at once, the second after 2 * backoff seconds, each next one
after twice as long; an answer's Retry-After is waited for instead. Once the retries are spent the last
answer comes back (not an exception), so a client's error can quote what the server said.
"""

import requests
from requests.adapters import DEFAULT_POOLSIZE, HTTPAdapter
from urllib3.util.retry import Retry

RETRY_STATUSES = frozenset(range(500, 600))


def retrying_session(retries: int, backoff: float, methods: frozenset[str], pool_maxsize: int,
                     pool_connections: int = DEFAULT_POOLSIZE, bearer_token: str | None = None) -> requests.Session:
    """A session retrying `retries` times after the first attempt (see the module docstring), keeping up to
    `pool_maxsize` connections open per host (as many as the client sends requests at once) for
    `pool_connections` hosts, and sending `Authorization: Bearer <bearer_token>` with every request."""
    session = requests.Session()
    retry = Retry(total=retries, backoff_factor=backoff, status_forcelist=RETRY_STATUSES, allowed_methods=methods,
                  raise_on_status=False)
    adapter = HTTPAdapter(pool_connections=pool_connections, pool_maxsize=pool_maxsize, max_retries=retry)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    if bearer_token:
        session.headers["Authorization"] = f"Bearer {bearer_token}"
    return session
