"""A CPU expert server's TCP data path in a process of its own, for the relayed link's kill
test (tests/test_tcp_relay.py): the real worker (tests/test_hostlink.py's two-layer int4
checkpoint), data listener and TcpServer. Reads a tcp Hello (hex, one line) on stdin, prints
the Ack (hex, one line), then serves until killed."""

from __future__ import annotations

import sys
import time


def main() -> None:
    from expertmesh.transport.handshake import Hello
    from expertmesh.transport.tcp_server import DataListener, TcpServer
    from tests.test_hostlink import make_worker

    worker = make_worker("int4")
    listener = DataListener("127.0.0.1", 0, None, on_drop=worker.metrics.dropped)
    print("ready", flush=True)
    hello = Hello.decode(bytes.fromhex(sys.stdin.readline().strip()))
    server = TcpServer(
        hello, listener, worker.slots.device, worker.forward, worker.data_path_error,
        forward_into=worker.forward_into, link=worker, relay_tally=worker.metrics.relays,
    )  # fmt: skip
    print(server.start().result(30).encode().hex(), flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
