"""README.md's "Training with hopperkern" guide: every ```python block of the section runs, in order, in one
namespace (as a reader would paste them into one session), and every block checks its result with an assert.

Blocks are compiled with README.md's own line numbers, so a traceback points at the README line that failed.
"""

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## Training with hopperkern"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)


def guide():
    """(section text, [(first README line of the code, code), ...]) of the guide section."""
    text = README.read_text()
    start = text.index(SECTION + "\n")
    end = text.find("\n## ", start + len(SECTION))
    blocks = []
    for m in BLOCK.finditer(text, start, end if end != -1 else len(text)):
        first_line = text.count("\n", 0, m.start(1)) + 1
        blocks.append((first_line, m.group(1)))
    return text[start:end], blocks


def test_guide_follows_the_api_tour():
    text = README.read_text()
    headings = re.findall(r"^## .*$", text, re.M)
    assert headings.index(SECTION) == headings.index("## API tour") + 1
    assert len(guide()[1]) >= 6


def test_every_block_asserts():
    for line, code in guide()[1]:
        assert re.search(r"^\s*assert\b", code, re.M), f"README.md:{line}: the block checks nothing"


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_guide_runs(fresh_dynamo):
    namespace = {"__name__": "readme_guide"}
    for line, code in guide()[1]:
        # Leading newlines put the block's first line on its README line number in tracebacks.
        exec(compile("\n" * (line - 1) + code, str(README), "exec"), namespace)  # noqa: S102
