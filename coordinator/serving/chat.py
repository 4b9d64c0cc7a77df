"""Chat templates: the checkpoint's own Jinja template turns chat messages into prompt text.

Where it comes from, as in transformers: ``chat_template.jinja`` in the checkpoint directory,
else ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of ``{"name",
"template"}`` of which the one named ``default`` is used). It is rendered in Jinja2's
``ImmutableSandboxedEnvironment`` (a template is data from the checkpoint and must not reach
Python internals) with the variables transformers passes: ``messages``,
``add_generation_prompt``, the special tokens of tokenizer_config.json (``bos_token``,
``eos_token``, ...), a ``raise_exception`` function and the ``tojson`` filter.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger("expertmesh.chat")
TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template failed on these messages (``raise_exception`` or a Jinja error)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template: line {e.lineno}: {e.message}") from None
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none or it does not parse (logged:
        completions are still served, chat requests get a 400 that says there is none)."""
        try:
            return cls._from_dir(Path(path))
        except ValueError as e:  # includes json.JSONDecodeError
            log.warning("%s: chat template not usable: %s", path, e)
            return None

    @classmethod
    def _from_dir(cls, d: Path) -> ChatTemplate | None:
        cfg: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        special = {k: _token_text(cfg[k]) for k in _SPECIAL if cfg.get(k) is not None}
        if (d / TEMPLATE_FILE).is_file():
            return cls((d / TEMPLATE_FILE).read_text(), special)
        source = cfg.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        return cls(source, special) if isinstance(source, str) and source else None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **extra
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # includes sandbox violations (SecurityError)
            raise ChatTemplateError(str(e)) from None


def _token_text(tok: Any) -> str:
    # tokenizer_config.json stores a special token as a string or as {"content": ...}
    return tok.get("content", "") if isinstance(tok, dict) else str(tok)
