"""Moving a stream whose replica died to another replica of its pool, so that the client never notices.

progress.py (what the client was sent, per choice: token ids, text, finish), continuation.py (whether a request
can move, and the /v1/completions request that continues one choice), straddle.py (a stop string that begins
before the break and ends after it), relay.py (the continuation's chunks as the client's stream goes on). Pure
logic; the I/O is router/http/migrate.py.
"""
