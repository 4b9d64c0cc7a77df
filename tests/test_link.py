"""The device link's building blocks off the GPU (expertmesh/transport/link.py): area layouts,
the signal/wait kernels under the Triton interpreter (flag values, timeout, abort), the
LinkStep descriptor and the handshake's link offer. The GPU hand-over itself: test_link_gpu.py."""

from __future__ import annotations

import pytest
import torch

from expertmesh.transport import descriptor as dsc
from expertmesh.transport import link
from expertmesh.transport.handshake import CudaHello, HandshakeError, Hello


def _words():
    step = torch.tensor([5, 3], dtype=torch.int64)  # StepWord.dev: (step, rows)
    return step[0:1], torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)


def test_areas_are_disjoint_aligned_prefix_views():
    r, h, k, dt = 8, 96, 4, torch.bfloat16
    buf = link.new_area(link.request_bytes(r, h, k, dt), torch.device("cpu"))
    v = link.RequestViews.of(buf, r, h, k, dt)
    spans = []
    for t in (v.flag, v.x, v.ids, v.w):
        start = t.data_ptr() - buf.data_ptr()
        assert start % 8 == 0 and t.is_contiguous()
        spans.append((start, start + t.numel() * t.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= buf.numel()
    assert v.x[:3].is_contiguous() and v.ids[:3].is_contiguous()  # a bucket's prefix
    a = link.AnswerViews.of(link.new_area(link.answer_bytes(r, h, dt), torch.device("cpu")), r, h, dt)
    assert a.flag.data_ptr() != a.status.data_ptr() and a.out.shape == (r, h)
    assert int(a.flag) == 0 and int(v.flag) == 0  # no layer ever waits for 0


def test_signal_writes_the_layers_value():
    step, _, _ = _words()
    flag = torch.zeros(1, dtype=torch.int64)
    link.signal(flag, step, 7)
    assert int(flag) == 5 * link.STEP_SPAN + 7 + 1


def test_wait_returns_on_its_value_and_times_out_otherwise():
    step, abort, errors = _words()
    flag = torch.zeros(1, dtype=torch.int64)
    link.signal(flag, step, 2)
    link.wait(flag, step, 2, abort, errors, 1.0, max_polls=4)
    assert int(errors) == 0 and int(abort) == 0
    # another layer's (or an earlier step's) value is not this layer's: a timeout
    link.wait(flag, step, 3, abort, errors, 1.0, max_polls=4)
    assert int(errors) == link.ERR_TIMEOUT and int(abort) == 5


def test_an_at_least_wait_takes_a_later_layer_of_its_step_only():
    step, abort, errors = _words()
    flag = torch.zeros(1, dtype=torch.int64)
    link.signal(flag, step, 3)  # a micro-batched step published layer 3 before layer 2's wait looked
    link.wait(flag, step, 2, abort, errors, 1.0, max_polls=4, at_least=True)
    assert int(errors) == 0 and int(abort) == 0
    link.wait(flag, step, 2, abort, errors, 1.0, max_polls=4)  # the plain wait wants its own value
    assert int(errors) == link.ERR_TIMEOUT
    step2, abort2, errors2 = _words()
    link.wait(flag, step2, 4, abort2, errors2, 1.0, max_polls=4, at_least=True)  # not there yet
    assert int(errors2) == link.ERR_TIMEOUT
    step3, abort3, errors3 = _words()
    step3.fill_(4)  # an earlier step: the flag (step 5's) is past the whole step, no answer for it
    link.wait(flag, step3, 1, abort3, errors3, 1.0, max_polls=4, at_least=True)
    assert int(errors3) == link.ERR_TIMEOUT


def test_after_a_timeout_the_rest_of_the_step_runs_through():
    step, abort, errors = _words()
    flag = torch.zeros(1, dtype=torch.int64)
    link.wait(flag, step, 0, abort, errors, 1.0, max_polls=3)
    assert int(abort) == 5
    errors.zero_()
    link.wait(flag, step, 1, abort, errors, 1.0, max_polls=10**9)  # returns at once, no answer
    assert int(errors) == link.ERR_TIMEOUT
    errors.zero_()
    link.signal(flag, step, 1)  # an answer that is there is taken, aborted step or not
    link.wait(flag, step, 1, abort, errors, 1.0, max_polls=10**9)
    assert int(errors) == 0
    nxt = torch.tensor([6], dtype=torch.int64)  # the next step waits again
    link.wait(flag, nxt, 0, abort, errors, 1.0, max_polls=3)
    assert int(errors) == link.ERR_TIMEOUT and int(abort) == 6


def test_a_cancelled_step_reports_no_answer():
    step, abort, errors = _words()
    flag = torch.zeros(1, dtype=torch.int64)
    link.Canceller(abort)(5)  # e.g. the peer's stream ended before this step's graph ran
    link.wait(flag, step, 0, abort, errors, 1.0, max_polls=10**9)
    assert int(errors) == link.ERR_TIMEOUT and int(abort) == 5


def test_step_word_holds_step_and_rows():
    w = link.StepWord(torch.device("cpu"))
    w.set(9, 4)
    w.copy_in()
    w.replayed()
    assert w.step.tolist() == [9] and w.rows.tolist() == [4]


# ---------------------------------------------------------------------- LinkStep


def test_link_step_round_trip():
    s = dsc.LinkStep(seq=3, step=12, rows=5, bucket=8, generation=2, timeout_ms=30000)
    raw = s.pack()
    assert len(raw) == dsc.SIZE and dsc.is_link_step(raw) and not dsc.is_kick(raw)
    assert dsc.LinkStep.parse(raw) == s
    m = dsc.LinkStep(seq=4, step=13, rows=7, bucket=8, generation=2, timeout_ms=30000, micro=2)
    assert dsc.LinkStep.parse(m.pack()) == m


def test_a_link_step_without_micro_batches_reads_as_one():
    """A sender that predates micro-batches leaves the field in the sealed body's zero padding."""
    import struct
    import zlib

    old = struct.Struct("<4sH2xQQIIQI").pack(dsc.LINK_STEP_MAGIC, dsc.VERSION, 1, 2, 3, 4, 0, 100)
    body = old.ljust(dsc.SIZE - 4, b"\0")
    raw = body + struct.pack("<I", zlib.crc32(body))
    assert dsc.LinkStep.parse(raw) == dsc.LinkStep(1, 2, 3, 4, 0, 100, micro=1)


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda s: dsc.LinkStep(1, 1, 9, 8, 0, 1).pack(), "9 rows in a bucket of 8"),
        (lambda s: dsc.LinkStep(1, 1, 5, 8, 0, 1, micro=3).pack(), "3 micro-batches in a bucket of 8"),
        (lambda s: dsc.LinkStep(1, 1, 5, 16, 0, 1, micro=16).pack(), "16 micro-batches"),
        (lambda s: dsc.LinkStep(1, 1, 0, 8, 0, 1).pack(), "0 rows"),
        (lambda s: dsc.LinkStep(1, 2**53, 1, 1, 0, 1).pack(), "out of range"),
        (lambda s: s[:100], "truncated"),
        (lambda s: s[:9] + bytes([s[9] ^ 1]) + s[10:], "checksum"),
        (lambda s: b"EMRQ" + s[4:], "magic"),
    ],
)
def test_bad_link_step_is_rejected(mutate, words):
    raw = mutate(dsc.LinkStep(1, 1, 1, 1, 0, 1).pack())
    with pytest.raises(dsc.DescriptorError, match=words):
        dsc.LinkStep.parse(raw)


# ---------------------------------------------------------------------- handshake


def _cuda_hello(link_offer) -> Hello:
    cuda = CudaHello("GPU-1", {"handle": "00" * 64, "offset": 0, "nbytes": 64}, "00", "local", link_offer)
    seg = f"expertmesh-1-2-{'ab' * 8}"
    return Hello("cuda_ipc", seg, 4096 + 8192, 4096, 8192, "0" * 32, cuda)


def test_hello_carries_the_link_offer():
    offer = {"area": {"handle": "11" * 64, "offset": 0, "nbytes": 4096}, "rows": 64, "top_k": 8}
    h = _cuda_hello(offer)
    assert Hello.decode(h.encode()) == h
    assert Hello.decode(_cuda_hello(None).encode()).cuda.link is None


@pytest.mark.parametrize(
    "offer",
    [
        {"rows": 64, "top_k": 8},
        {"area": {}, "rows": 0, "top_k": 8},
        {"area": {}, "rows": 64, "top_k": True},
        {"area": {}, "rows": 1 << 20, "top_k": 8},
        [1, 2],
    ],
)
def test_bad_link_offer_is_rejected(offer):
    with pytest.raises(HandshakeError, match="link offer"):
        Hello.decode(_cuda_hello(offer).encode())


@pytest.mark.parametrize("first", [0, 2])  # 2: a micro-batch's rows, counted from its first row
def test_send_writes_the_request_and_its_flag_in_one_kernel(first):
    """link.send against the plain writes it replaces: x in the area's dtype, each routed
    expert's server slot from the table (-1 for rows at or past the step's real rows, and for
    the table's -1), the weights as float32, then the layer's flag."""
    r, h, k, e, n = 8, 40, 3, 6, 3
    req = link.RequestViews.of(link.new_area(link.request_bytes(r, h, k, torch.float32), torch.device("cpu")),
                               r, h, k, torch.float32)  # fmt: skip
    g = torch.Generator().manual_seed(first)
    x = torch.randn(n, h, generator=g).to(torch.bfloat16)
    topk = torch.randint(0, e, (n, k), generator=g)
    w = torch.rand(n, k, generator=g).to(torch.bfloat16)
    table = torch.tensor([4, -1, 0, 7, 2, 5], dtype=torch.int32)  # -1: an expert held elsewhere
    word = torch.tensor([9, first + 2], dtype=torch.int64)  # step 9; rows past first + 2 are padding
    link.send(req, slice(first, first + n), x, topk, w, table, word, 5)
    rows = slice(first, first + n)
    assert torch.equal(req.x[rows], x.float())
    want = table[topk].clone()
    want[2:] = -1  # the third row is padding
    assert torch.equal(req.ids[rows], want), (req.ids[rows], want)
    assert torch.equal(req.w[rows], w.float())
    assert int(req.flag) == 9 * link.STEP_SPAN + 5 + 1
    assert float(req.x[:first].abs().sum()) == 0 and float(req.x[first + n :].abs().sum()) == 0


@pytest.mark.parametrize("add", [False, True])
def test_take_copies_the_answer_adds_the_local_share_and_ors_the_status(add):
    r, h = 4, 24
    ans = link.AnswerViews.of(link.new_area(link.answer_bytes(r, h, torch.float32), torch.device("cpu")), r, h,
                              torch.float32)  # fmt: skip
    ans.out.copy_(torch.randn(r, h, generator=torch.Generator().manual_seed(1)))
    ans.status.fill_(link.ERR_BAD_SLOT)
    errors = torch.tensor([link.ERR_TIMEOUT], dtype=torch.int64)
    mine = torch.randn(3, h, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16) if add else None
    got = link.take(ans, slice(1, 4), errors, torch.bfloat16, mine)
    want = ans.out[1:4] + (mine.float() if mine is not None else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (3, h)
    # NOTE: within one bf16 step: the interpreter rounds float32 to bf16 its own way (the GPU
    # rounds to nearest); the sum is taken in float32 and rounded once
    assert torch.allclose(got.float(), want, rtol=2**-7, atol=0), (got.float() - want).abs().max()
    assert int(errors) == link.ERR_TIMEOUT | link.ERR_BAD_SLOT
