"""Sampler, incremental detokenizer and stop strings, against plain references."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from coordinator.serving.sampler import SamplingParams, make_generator, sample
from coordinator.serving.tokenizer import StopMatcher, TextTokenizer

V = 50


def logits_rows(b: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3


def draw(logits: torch.Tensor, p: SamplingParams, n: int) -> list[int]:
    g = make_generator(p, torch.device("cpu"))
    return [int(sample(logits[None], [p], [g])[0][0]) for _ in range(n)]


def test_greedy_and_logprobs_of_raw_logits():
    lg = logits_rows(4)
    params = [SamplingParams(), SamplingParams(top_k=1, temperature=5.0)] * 2
    toks, lps = sample(lg, params, [make_generator(p, torch.device("cpu")) for p in params])
    assert toks.tolist() == lg.argmax(-1).tolist()
    ref = torch.log_softmax(lg.double(), -1).gather(1, toks[:, None]).squeeze(1)
    assert (lps.double() - ref).abs().max() < 1e-6


def test_logprobs_are_before_temperature():
    lg = logits_rows(1)
    p = SamplingParams(temperature=2.5, seed=1)
    tok, lp = sample(lg, [p], [make_generator(p, torch.device("cpu"))])
    assert abs(lp.item() - torch.log_softmax(lg[0], -1)[tok.item()].item()) < 1e-6


def test_seeded_sampling_reproducible_and_batch_independent():
    lg = logits_rows(3)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=1234)
    alone = draw(lg[1], p, 30)
    assert draw(lg[1], p, 30) == alone
    # same request inside a batch of others: its own generator gives the same draws
    others = [SamplingParams(temperature=0.7, seed=5), SamplingParams()]
    params = [others[0], p, others[1]]
    gens = [make_generator(q, torch.device("cpu")) for q in params]
    batched = [int(sample(lg, params, gens)[0][1]) for _ in range(30)]
    assert batched == alone
    assert draw(lg[1], SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=99), 30) != alone


def test_top_k_and_top_p_limit_the_support():
    lg = logits_rows(1, seed=3)[0]
    order = lg.argsort(descending=True).tolist()
    got = set(draw(lg, SamplingParams(temperature=3.0, top_k=3, seed=0), 200))
    assert got <= set(order[:3]) and len(got) == 3
    probs = torch.softmax(lg / 3.0, -1)[order]
    keep = int((torch.cumsum(probs, 0) < 0.6).sum()) + 1  # smallest prefix reaching 0.6
    got = set(draw(lg, SamplingParams(temperature=3.0, top_p=0.6, seed=0), 400))
    assert got <= set(order[:keep]) and len(got) == keep


def test_sampling_follows_the_distribution():
    lg = torch.tensor([2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4))
    n = 4000
    draws = torch.tensor(draw(lg, SamplingParams(temperature=1.0, seed=7), n))
    freq = torch.bincount(draws, minlength=V)[:4].float() / n
    want = torch.softmax(lg, -1)[:4]
    assert (freq - want).abs().max() < 0.03, (freq, want)


def test_params_validation():
    for bad in (
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(max_new_tokens=0),
    ):
        with pytest.raises(AssertionError):
            SamplingParams(**bad)


# ---------------------------------------------------------------------- text


@pytest.fixture(scope="module")
def bpe() -> TextTokenizer:
    docs = ["héllo wörld, naïve café ☕ déjà vu", "the quick brown fox 🦊 jumps", "über straße"] * 3
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return TextTokenizer(tok)


@pytest.mark.parametrize("text", ["naïve café ☕ and 🦊 über", "déjà vu, the fox"])
def test_incremental_detokenizer_matches_full_decode(bpe, text):
    ids = bpe.encode(text)
    prompt, gen = ids[:3], ids[3:]
    d = bpe.detokenizer(prompt)
    pieces = [d.push(t) for t in gen] + [d.flush()]
    assert "".join(pieces) == bpe.decode(ids)[len(bpe.decode(prompt)) :]
    assert all("\ufffd" not in p for p in pieces)  # no half characters were streamed


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(("STOP", "xy"))
    out = []
    for piece in ["ab", "cS", "T", "O", "zzx", "q"]:
        text, hit = m.feed(piece)
        out.append(text)
        assert not hit
    assert "".join(out) + m.flush() == "abcSTOzzxq"
    m = StopMatcher(("STOP",))
    assert m.feed("abST") == ("ab", False)
    assert m.feed("OPtail") == ("", True)
    m = StopMatcher(("a", "bc"))
    assert m.feed("xxb") == ("xx", False)
    assert m.feed("ca") == ("", True)
