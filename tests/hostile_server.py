"""An expert server that answers badly, for tests/test_bad_answer.py: the real server command
with one patch chosen by the first argument (no flag of the product misbehaves on purpose).

    python tests/hostile_server.py shape LAYER cpu-server --model DIR ...
        gRPC answers to MoE layer LAYER lose their last row (a wrong shape for the rows sent)
    python tests/hostile_server.py bytes cpu-server --model DIR ...
        every gRPC answer's tensor lacks its last byte (it does not decode)
    python tests/hostile_server.py descriptor cpu-server --model DIR ...
        every successful fast-path answer carries a corrupted response descriptor
    python tests/hostile_server.py seq cpu-server --model DIR ...
        every successful fast-path answer names a sequence number that was never sent
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from expertmesh import cli, wire  # noqa: E402
from expertmesh.transport import descriptor as dsc  # noqa: E402
from expertmesh.worker.core import ExpertWorker  # noqa: E402


def _short_answers(layer: int) -> None:
    compute, try_compute = ExpertWorker.compute, ExpertWorker.try_compute

    def bad_compute(self, req, to_host=True):
        out = compute(self, req, to_host)
        return out[:-1] if req.layer == layer else out  # [T - 1, H]

    def bad_try_compute(self, req):
        out = try_compute(self, req)
        return out[:-1] if out is not None and req.layer == layer else out

    ExpertWorker.compute = bad_compute  # type: ignore[method-assign]
    ExpertWorker.try_compute = bad_try_compute  # type: ignore[method-assign]


def _truncated_tensors() -> None:
    encode = wire.encode

    def bad_encode(t):
        msg = encode(t)
        msg.data = msg.data[:-1]
        return msg

    wire.encode = bad_encode  # the servicer encodes its answers (and only those) with it


def _corrupt_descriptors() -> None:
    pack = dsc.Response.pack

    def bad_pack(self):
        raw = pack(self)
        return raw if self.code else raw[:-1] + bytes([raw[-1] ^ 0xFF])  # the checksum's last byte

    dsc.Response.pack = bad_pack  # type: ignore[method-assign]


def _wrong_seqs() -> None:
    pack = dsc.Response.pack

    def bad_pack(self):
        return pack(self if self.code else dataclasses.replace(self, seq=self.seq + (1 << 20)))

    dsc.Response.pack = bad_pack  # type: ignore[method-assign]


def main() -> int:
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "shape":
        _short_answers(int(rest[0]))
        rest = rest[1:]
    elif mode == "bytes":
        _truncated_tensors()
    elif mode == "descriptor":
        _corrupt_descriptors()
    elif mode == "seq":
        _wrong_seqs()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main())
