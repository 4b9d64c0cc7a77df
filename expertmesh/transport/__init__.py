"""Fast paths between the coordinator and an expert server: on the same host (and GPU) through
shared memory, across hosts through a TCP connection of their own (:mod:`.tcp`: binary frames
of the descriptors below and raw tensor bytes; :mod:`.tcp_server`, :mod:`.tcp_client`, and a
loopback latency proxy to measure it, :mod:`.delay_proxy`).

The plain path puts every tensor inside the gRPC messages of one bidirectional ``Forward``
stream per server. When both sides share the host, that stream stays (it carries the
handshake, payloads too big for the ring, and the liveness of the peer), but the payloads go
through shared memory:

- ``shm``: one segment per stream in ``/dev/shm``, created by the coordinator, holding a byte
  ring for request payloads and the room for their answers (:mod:`.ring`; all allocation is
  coordinator-side). Per request a 256-byte descriptor (:mod:`.descriptor`) goes through a
  FIFO and the answer's descriptor comes back through another, and a counter in the segment
  lets the waiting side poll briefly before it sleeps (:mod:`.spin`): the fastest of the
  options measured from Python (benchmarks/bench_doorbell.py, benchmarks/RESULTS.md).
- ``cuda_ipc``: as ``shm``, but hidden states stay in the coordinator's GPU memory and
  outputs in the server's, each side's ring mapped once by the other through CUDA IPC
  (:mod:`.cuda_ipc`), ordered by interprocess events: no device-to-host copy on the data path.

Which path a pair uses is decided by :mod:`.negotiate` from ``Describe`` and proven by the
handshake (:mod:`.handshake`): the server must open the coordinator's segment and find the
token it was told. Names and crash clean-up are in :mod:`.segment`. The coordinator's end is
:mod:`.client`, the server's :mod:`.server`.
"""
