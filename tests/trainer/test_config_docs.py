"""docs/config.md lists every config key, as the schema defines it (scripts/config_docs.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_config_docs_are_generated_from_the_schema():
    out = subprocess.run([sys.executable, "scripts/config_docs.py", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_check_fails_on_a_missing_key(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import config_docs
    finally:
        sys.path.pop(0)
    text = config_docs.DOC.read_text()
    broken = text.replace("| `keep_last` |", "| `keep_lost` |")
    assert broken != text and config_docs.render(broken) == text
