"""Helpers for the serving tests: a coordinator in a background thread, a tiny word tokenizer,
HF greedy references. (No tests here.)"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from coordinator.serving.server import CoordinatorConfig, CoordinatorServer, create_server

WORDS = [f"w{i}" for i in range(96)]  # one word per id of the tiny models' 96-token vocabulary


def write_word_tokenizer(model_dir: Path) -> None:
    """A WordLevel tokenizer whose id i is the word ``w{i}`` (text is space-separated words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model_dir / "tokenizer.json"))


class ServerThread:
    """A coordinator on a free loopback port, its event loop in a thread of this process."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.server: CoordinatorServer | None = None
        self.port = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        try:
            self.server = create_server(self.config)
            self.port = self.server.add_port("127.0.0.1:0")  # TLS when config.tls has a cert
            await self.server.start()
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        except BaseException as e:
            self._error = e
            raise
        finally:
            self._ready.set()
        await self._stop.wait()
        await self.server.stop(1.0)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(120)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def scheduler(self):
        assert self.server is not None
        return self.server.scheduler


def hf_greedy(hf, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy decode with its own KV cache: tokens and each step's log-softmax [steps, V]."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        past, logits = out.past_key_values, [out.logits[0, -1]]
        toks = [int(logits[-1].argmax())]
        for _ in range(steps - 1):
            out = hf(torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[0, -1])
            toks.append(int(logits[-1].argmax()))
    return toks, torch.log_softmax(torch.stack(logits).float(), dim=-1)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # NOTE: the engine's tiny matmuls are ~10x slower with 2 threads on a busy 2-core machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
