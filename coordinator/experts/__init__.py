"""The expert tier as the coordinator sees it: the cluster of expert servers (``cluster.py``,
``cluster_config.py``), one connection per server with its gRPC stream and negotiated fast path
(``expert_conn.py``), the remote ``Dispatcher`` that routes, splits, sends, awaits, merges and
fails over (``remote.py``), and the per-(layer, expert) load recorder that EPLB reads
(``load_recorder.py``).

May import: ``expertmesh`` and ``coordinator.model`` (the ``Dispatcher`` interface it implements,
the decode buckets). Nothing here knows about requests, HTTP or EPLB policies.
"""
