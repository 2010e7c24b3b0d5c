"""Regenerate the key tables of docs/config.md from the config schema's field docs.

    python scripts/config_docs.py          # rewrite docs/config.md in place
    python scripts/config_docs.py --check  # exit 1 if docs/config.md is out of date

tests/trainer/test_config_docs.py runs the check, so a new key cannot go undocumented.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainer.config import field_docs

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"
START, END = "## Keys\n", "\n## Data order and resume"


def _default(value) -> str:
    if value is None:
        return "`unset`"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value)}`"


def tables() -> str:
    out, section = [START], None
    for key, kind, default, help_ in field_docs():
        head, name = key.split(".", 1)
        if head != section:
            section = head
            out.append(f"\n### `[{head}]`\n\n| key | type | default | meaning |\n|---|---|---|---|\n")
        out.append(f"| `{name}` | {kind.replace('|', chr(92) + '|')} | {_default(default)} | "
                   f"{help_} |\n")
    return "".join(out)


def render(text: str) -> str:
    start, end = text.index(START), text.index(END)
    return text[:start] + tables() + text[end:]


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    new = render(text)
    if "--check" in argv:
        if new != text:
            print(f"{DOC} is out of date: run python scripts/config_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
