"""Write docs/serving.md's option table from the options' declarations (app/settings.py, decoding/engine/config.py).

    .venv/bin/python scripts/options_table.py          # rewrite the table
    .venv/bin/python scripts/options_table.py --check  # exit 1 if it is not current
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.settings import options_table  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "serving.md"
BEGIN = "<!-- options table: written by scripts/options_table.py from the declarations -->\n"
END = "<!-- end of the options table -->\n"


def with_current_table(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + BEGIN + options_table() + END + tail


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    current = with_current_table(text)
    if "--check" in argv:
        if current != text:
            print("docs/serving.md's option table is out of date: run scripts/options_table.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(current)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
