"""The demo model's byte-level BPE tokenizer, trained on the demo corpus with ``tokenizers``.

Ids 0 and 1 are the special tokens ``<|bos|>`` and ``<|eos|>``. Encoding with special tokens
prepends ``<|bos|>`` (every training document starts with it); training documents end with
``<|eos|>`` so that the model learns to stop.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<|bos|>", "<|eos|>"
BOS_ID, EOS_ID = 0, 1
DEFAULT_VOCAB_SIZE = 1024


def train_tokenizer(docs: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Trains a byte-level BPE of at most ``vocab_size`` tokens on ``docs`` (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID, "special ids moved"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok


def encode_document(tok: Tokenizer, doc: str) -> list[int]:
    """``<|bos|> doc <|eos|>`` as training ids."""
    return tok.encode(doc).ids + [EOS_ID]
