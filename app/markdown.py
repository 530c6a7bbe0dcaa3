"""Splitting a (possibly still streaming) markdown answer into prose and fenced code blocks.

Prose goes to a QTextBrowser as markdown; each code block gets its own monospace view with a Copy button.
A fence that is still open while tokens stream in counts as code up to the end of the text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")


@dataclass
class Block:
    kind: str  # "text" or "code"
    text: str
    language: str = ""
    closed: bool = True  # False for a code block whose closing fence has not arrived yet


def split_blocks(markdown: str) -> list[Block]:
    blocks: list[Block] = []
    prose: list[str] = []
    code: list[str] | None = None
    fence, language = "", ""
    for line in markdown.split("\n"):
        m = _FENCE.match(line)
        if code is None:
            if m:
                if prose:
                    blocks.append(Block("text", "\n".join(prose)))
                    prose = []
                code, fence, language = [], m["fence"], m["info"].strip().split(" ")[0]
            else:
                prose.append(line)
        elif m and m["fence"][0] == fence[0] and len(m["fence"]) >= len(fence) and not m["info"].strip():
            blocks.append(Block("code", "\n".join(code), language))
            code = None
        else:
            code.append(line)
    if code is not None:
        blocks.append(Block("code", "\n".join(code), language, closed=False))
    elif prose and "\n".join(prose).strip():
        blocks.append(Block("text", "\n".join(prose)))
    return [b for b in blocks if b.kind == "code" or b.text.strip()]
