"""Chat templates against transformers' ``apply_chat_template`` (the reference), where they come
from, and the sandbox."""

from __future__ import annotations

import json
import shutil

import pytest

from coordinator.serving.chat import ChatTemplate, ChatTemplateError
from expertmesh.demo import WEIGHTS_DIR

MESSAGES = [
    {"role": "system", "content": "Pip and you meet at the shop."},
    {"role": "user", "content": "Good morning, Pip!"},
    {"role": "assistant", "content": "Hello! What would you like?"},
    {"role": "user", "content": "A red apple, please."},
]
# a ChatML template of the usual shape (loops, conditionals, whitespace control, a filter)
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def demo_copy(tmp_path):
    d = tmp_path / "demo"
    shutil.copytree(WEIGHTS_DIR, d, ignore=shutil.ignore_patterns("*.safetensors"))
    return d


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_demo_template_matches_transformers(tmp_path, generation_prompt):
    from transformers import AutoTokenizer

    d = demo_copy(tmp_path)
    ref = AutoTokenizer.from_pretrained(d).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=generation_prompt
    )
    ours = ChatTemplate.from_dir(d)
    assert ours is not None
    assert ours.render(MESSAGES, add_generation_prompt=generation_prompt) == ref
    assert ref.startswith("<|bos|>")


@pytest.mark.parametrize("form", ["string", "list"])
def test_tokenizer_config_template_matches_transformers(tmp_path, form):
    from transformers import AutoTokenizer

    d = demo_copy(tmp_path)
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML if form == "string" else [{"name": "default", "template": CHATML}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ref = AutoTokenizer.from_pretrained(d).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    ours = ChatTemplate.from_dir(d)
    assert ours is not None and ours.render(MESSAGES) == ref
    assert ref.endswith("<|im_start|>assistant\n")


def test_no_template_and_broken_template(tmp_path):
    d = demo_copy(tmp_path)
    (d / "chat_template.jinja").unlink()
    assert ChatTemplate.from_dir(d) is None
    (d / "chat_template.jinja").write_text("{% for m in messages %}")  # never closed
    assert ChatTemplate.from_dir(d) is None


def test_sandbox_and_raise_exception():
    t = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        t.render(MESSAGES)
    t = ChatTemplate("{{ messages.append(1) }}")  # immutable sandbox: no mutating calls
    with pytest.raises(ChatTemplateError):
        t.render(MESSAGES)
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        t.render(MESSAGES)
