"""The README's Python examples run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README should show at least one Python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})


def test_readme_names_only_existing_config_keys():
    from lordo.config import SECTIONS
    from dataclasses import fields

    known = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in fields(cls)}
    mentioned = set(re.findall(r"`((?:model|data|optim|schedule|train|strategy|dist|comm)\.[a-z_]+)", README.read_text()))
    assert mentioned and mentioned <= known, mentioned - known
