"""The shared-memory client reads an answer that already arrived even when the caller's
deadline has passed (the remote dispatcher shares one deadline per layer across servers: a
healthy server collected after a hung one must not be declared timed out)."""

from __future__ import annotations

import time

import torch

from expertmesh.transport import segment
from expertmesh.transport.client import ShmClient
from expertmesh.transport.handshake import Hello
from expertmesh.transport.server import ShmServer
from expertmesh.worker_api import ExpertRequest


def test_an_arrived_answer_is_read_after_the_deadline():
    assert segment.available(), "no writable /dev/shm: the shared-memory fast path cannot be tested"
    done: list[int] = []

    def forward(r: ExpertRequest) -> torch.Tensor:
        done.append(r.seq)
        return r.hidden * 2

    client = ShmClient("shm", 1 << 16, torch.device("cpu"), spin_us=0)
    server = ShmServer(Hello.decode(client.hello()), torch.device("cpu"), forward, spin_us=0)
    try:
        client.accept(server.start().result(10))
        x = torch.randn(2, 8)
        req = ExpertRequest(1, 0, 0, x, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1))
        reply = client.send(req, torch.float32)
        assert reply is not None
        deadline = time.monotonic() + 10
        while not client._answered() and time.monotonic() < deadline:  # the answer is in the FIFO
            time.sleep(0.01)
        assert done == [1]
        out = reply.result(timeout=0.0)  # the deadline has passed: the answer is there anyway
        assert torch.equal(out, x * 2)
        reply.release()
    finally:
        server.close()
        client.close()
