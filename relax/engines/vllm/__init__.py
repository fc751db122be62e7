"""vLLM as a Relax engine: a front of Relax's own between the rollout and a vLLM server.

Relax's engine client speaks one contract, SGLang's (``/generate`` with cumulative streamed chunks and per-token
weight versions, ``/pause_generation`` modes, two keys). vLLM 0.32 speaks another (a token route, delta chunks,
``/pause`` query modes) and guards only its generation routes with ``--api-key``: ``/pause``, ``/resume``, the
weight routes and ``/collective_rpc`` stay open. So vLLM listens on a Unix socket in a directory only its user
can enter, and the front owns the engine's TCP port: it checks the run's two keys by the rules the built-in
engine and SGLang follow (``relax.engines.keys``) and translates each route (``translate``, pure; ``front``,
the server). Nothing else of the pool branches on the backend.
"""
