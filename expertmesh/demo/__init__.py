"""The demo model: a tiny trained Qwen3-MoE checkpoint shipped with the package.

``write_demo_model(out_dir)`` copies the shipped files into ``out_dir``: no network, no training,
the same bytes every time. How the files were made is in ``expertmesh/demo/README.md``
(corpus.py -> corpus.txt, tokenizer.py, train.py -> weights/).
"""

from __future__ import annotations

import shutil
from pathlib import Path

WEIGHTS_DIR = Path(__file__).with_name("weights")
# config.json and model.safetensors make the checkpoint, tokenizer.json its tokenizer
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
OPTIONAL_FILES = ("generation_config.json", "tokenizer_config.json", "chat_template.jinja")


class DemoModelMissing(FileNotFoundError):
    """The package was installed without the demo model's weights."""


def write_demo_model(out_dir: str | Path) -> Path:
    """Writes the demo checkpoint into ``out_dir`` (created if needed) and returns its path.

    Files already in ``out_dir`` with the same names are overwritten; others are left alone.
    """
    missing = [f for f in REQUIRED_FILES if not (WEIGHTS_DIR / f).is_file()]
    if missing:
        raise DemoModelMissing(
            f"demo model files {missing} are missing from {WEIGHTS_DIR}; this installation lacks the "
            "package data (reinstall expertmesh) or, in a checkout, rebuild them with "
            "`python -m expertmesh.demo.train --out expertmesh/demo/weights`"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in REQUIRED_FILES + OPTIONAL_FILES:
        src = WEIGHTS_DIR / name
        if src.is_file():
            shutil.copyfile(src, out / name)
    return out
