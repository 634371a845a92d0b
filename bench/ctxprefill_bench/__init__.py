"""Tools around the ctxprefill server, not part of it: ``ctxprefill bench`` (the fused and
the generic path timed side by side in one process, ``engine_bench``), ``ctxprefill demo``
in-process and against a running server (``demo``, ``remote_demo``), random requests
written into an engine's cache (``workload``) and the unchunked float64 answer that the
tests and the demos measure the chunked engine against (``reference64``). They import the
server package ``ctxprefill``; the server never imports them.
"""
