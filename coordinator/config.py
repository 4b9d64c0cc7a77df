"""``CoordinatorConfig``: the coordinator's settings, frozen and validated (errors, not
asserts). The command line becomes one in coordinator/main.py only; the expert tier's part is
:class:`~coordinator.experts.cluster_config.ClusterConfig`."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

import torch

from coordinator.eplb.plan import EplbConfig
from coordinator.experts.cluster_config import ClusterConfig
from expertmesh.tls import TLSConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"256MiB"``, ``"1.5GB"``, ``"4096"`` -> bytes (K/M/G/T are powers of 1024 either way)."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1048576)")
    unit = (m.group(2) or "b")[0].lower()
    return int(float(m.group(1)) * 1024 ** "bkmgt".index(unit))


@dataclass(frozen=True)
class InputLimits:
    """Caps on what one request may ask of the coordinator (``--max-prompt-bytes`` etc.)."""

    max_prompt_bytes: int = 1 << 20  # ~250k tokens of English: more than a 128k context holds
    max_stop_strings: int = 16
    max_stop_bytes: int = 256  # per stop string, UTF-8
    max_stop_token_ids: int = 64
    max_request_id_bytes: int = 256  # echoed in every streamed chunk
    # HTTP API: a whole request body (JSON escapes a prompt's non-ASCII up to 6 bytes a character)
    max_body_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("per-request input limits (INVALID_ARGUMENT beyond them)")
        d = InputLimits()
        g.add_argument("--max-prompt-bytes", type=int, default=d.max_prompt_bytes, help="prompt text, UTF-8")
        g.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings)
        g.add_argument("--max-stop-bytes", type=int, default=d.max_stop_bytes, help="per stop string")
        g.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids)
        g.add_argument("--max-request-id-bytes", type=int, default=d.max_request_id_bytes)
        g.add_argument(
            "--max-http-body-bytes", type=int, default=d.max_body_bytes, help="HTTP request body (413 beyond)"
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> InputLimits:
        return cls(
            max_prompt_bytes=args.max_prompt_bytes,
            max_stop_strings=args.max_stop_strings,
            max_stop_bytes=args.max_stop_bytes,
            max_stop_token_ids=args.max_stop_token_ids,
            max_request_id_bytes=args.max_request_id_bytes,
            max_body_bytes=args.max_http_body_bytes,
        )


@dataclass(frozen=True)
class CoordinatorConfig:
    model_dir: str
    dtype: str = "float32"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = a free port
    page_size: int = 16  # tokens per KV page
    kv_memory_bytes: int = 256 << 20  # KV cache budget; sets the number of pages
    prefix_cache: bool = True  # requests sharing a prompt prefix share its full KV pages
    max_batch_tokens: int = 512  # tokens per forward step (decodes + prefill chunks)
    max_running: int = 64  # requests holding KV pages at once
    # bounded queue (RESOURCE_EXHAUSTED / HTTP 429 beyond) and a server-side deadline
    max_queued_requests: int = 1024  # submitted, not yet admitted
    max_queued_tokens: int = 1 << 20  # their prompt tokens
    request_timeout_s: float | None = None  # caps every request's deadline; None = the client's only
    max_context: int | None = None  # prompt + generated tokens; default: the model's limit
    default_max_new_tokens: int = 64
    max_message_mb: int = 64
    connect_timeout_s: float = 10.0  # one attempt to (re)connect the expert servers
    cluster: ClusterConfig | None = None  # None or no servers: experts in process
    http_port: int | None = None  # OpenAI-compatible HTTP + /metrics on host:http_port; None = off
    input_limits: InputLimits = InputLimits()  # per-request caps (checked in coordinator/serving/requests.py)
    eplb: EplbConfig = EplbConfig()  # periodic expert re-placement; off by default

    lora_dirs: tuple[str, ...] = ()  # MoE LoRA: adapter paths must lie under one of these
    max_loras: int = 4  # MoE LoRA adapters loaded at once
    # a decode step of 2+ sequences runs as up to N micro-batches whose attention overlaps the
    # other micro-batches' remote experts (CausalLM.forward_micro: inside the linked decode graph
    # over a relayed TCP link that takes them, eagerly when the step cannot link); 1 = off;
    # None (auto) = two inside linked steps of 4-16 rows, where they paid (remote_graphs.auto_micro)
    micro_batches: int | None = None
    # decode steps queued one ahead on the device where decode graphs are captured (Scheduler.overlap)
    step_overlap: bool = True
    # Admin needs it when set; unset: Admin answers loopback peers only (expertmesh/auth.py)
    admin_token: str | None = field(default=None, repr=False)
    tls: TLSConfig | None = None  # the public port serves TLS only with a certificate
    # SIGTERM: admit nothing new, finish running requests for at most this long
    drain_timeout_s: float = 30.0
    # re-place the experts of a server down this long over the others (None = off)
    degraded_replace_after_s: float | None = None

    def __post_init__(self) -> None:
        if self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")
        if self.degraded_replace_after_s is not None and self.degraded_replace_after_s <= 0:
            raise ValueError(f"--degraded-replace-after must be > 0, got {self.degraded_replace_after_s}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {sorted(DTYPES)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} outside 0..65535")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http port {self.http_port} outside 0..65535")
        for name in ("page_size", "kv_memory_bytes", "max_batch_tokens", "max_running", "max_message_mb",
                     "max_queued_requests", "max_queued_tokens"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context {self.max_context} leaves no room for a prompt and a token")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        if self.micro_batches is not None and not 1 <= self.micro_batches <= 8:
            raise ValueError(f"--micro-batches must be auto or in [1, 8], got {self.micro_batches}")
        if self.max_loras <= 0:
            raise ValueError(f"max_loras must be positive, got {self.max_loras}")
        if self.default_max_new_tokens <= 0:
            raise ValueError(f"default_max_new_tokens must be positive, got {self.default_max_new_tokens}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device}: CUDA is not available on this machine")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def remote(self) -> bool:
        return self.cluster is not None and bool(self.cluster.servers)
