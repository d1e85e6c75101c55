"""Write docs/cli.md and docs/api.md from the code (argparse help, config descriptions, docstrings), and the results
tables from the runs: results/strategies.md (`lordo report --table results/strategies.toml`) and its two tables in
README.md (the results table) and docs/results.md (the verdicts at two scales).

    python tools/gen_docs.py            # rewrite them
    python tools/gen_docs.py --check    # exit 1 if any file differs from what the code and the runs say

The test suite runs the check, so the references cannot drift from the code, nor the tables from the runs.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli_reference() -> str:
    from lordo.cli import make_parser

    parser = make_parser()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    out = [
        "# Command-line reference",
        "",
        "Generated from the code by `python tools/gen_docs.py`; do not edit by hand.",
        "Every `lordo` command prints the same text with `--help`.",
        "",
        "```text",
        _help(parser),
        "```",
    ]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        out += ["", f"## lordo {name}", "", "```text", _help(p), "```"]
        nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        for action in nested:
            for sub_name, sp in action.choices.items():
                out += ["", f"### lordo {name} {sub_name}", "", "```text", _help(sp), "```"]
    return "\n".join(out) + "\n"


def _help(parser: argparse.ArgumentParser) -> str:
    import os

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "110"  # the same wrapping on every terminal
    try:
        return parser.format_help().rstrip()
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


def api_reference() -> str:
    import lordo

    out = [
        "# API reference",
        "",
        "Generated from the docstrings by `python tools/gen_docs.py`; do not edit by hand.",
        "The public names are those in `lordo.__all__`; everything else may change between versions.",
        "",
        "```python",
        "import lordo",
        f"lordo.__all__ == {sorted(lordo.__all__)!r}",
        "```",
    ]
    order = ["distributed", "DistributedOptimizer", "worker_mesh", "LowRankQHAdam", "param_groups", "Config",
             "build_config", "load_trained", "STRATEGY_NAMES", "LordoError", "ConfigError", "DataError", "NonFiniteError", "CommError"]
    missing = set(lordo.__all__) - set(order) - {"__version__"}
    if missing:
        raise SystemExit(f"tools/gen_docs.py: add {sorted(missing)} to the order of the API reference")
    for name in order:
        obj = getattr(lordo, name)
        if isinstance(obj, tuple):
            out += ["", f"## `lordo.{name}`", "", f"`{obj!r}`"]
            continue
        kind = "class" if inspect.isclass(obj) else "function"
        out += ["", f"## `lordo.{name}{_signature(obj)}`", "", f"*{kind}*", "", _doc(obj)]
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            own = [c for c in obj.__mro__ if c.__module__.startswith("lordo")]  # the class and lordo's mixins
            for member_name, member in inspect.getmembers(obj):
                if member_name.startswith("_") or not any(member_name in vars(c) for c in own):
                    continue
                if name == "LowRankQHAdam" or name == "Config":
                    if not (member.__doc__ and member.__qualname__.split(".")[0] in {c.__name__ for c in own}):
                        continue
                if isinstance(member, property):
                    out += ["", f"### `{name}.{member_name}` (property)", "", _doc(member)]
                elif callable(member):
                    out += ["", f"### `{name}.{member_name}{_signature(member)}`", "", _doc(member)]
    return "\n".join(out).rstrip() + "\n"


def _signature(obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    params = [p for p in sig.parameters.values() if p.name != "self"]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _doc(obj) -> str:
    doc = inspect.getdoc(obj)
    return doc if doc else "(no docstring)"


SPEC = "results/strategies.toml"
TABLES = {"README.md": "| strategy |", "docs/results.md": "| claim |"}  # page -> the first cell of its table


def results_tables() -> dict[Path, str]:
    """results/strategies.md as `lordo report --table` writes it, and README.md and docs/results.md with their copy
    of its table (the block of lines starting with the table's header) replaced."""
    from lordo.experiments.tables import Spec, render

    generated = "\n".join(render(Spec(ROOT / SPEC), f"lordo report --table {SPEC} --out results/strategies.md")) + "\n"
    out = {ROOT / "results" / "strategies.md": generated}
    for page, head in TABLES.items():
        text = (ROOT / page).read_text()
        out[ROOT / page] = _replace_block(text, _block(generated, head), head)
    return out


def _block(text: str, head: str) -> str:
    start = text.index("\n" + head) + 1
    end = text.find("\n\n", start)
    return text[start:end if end >= 0 else len(text)].rstrip("\n")


def _replace_block(text: str, block: str, head: str) -> str:
    old = _block(text, head)
    return text.replace(old, block, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = ap.parse_args()
    stale = []
    files = {ROOT / "docs" / "cli.md": cli_reference(), ROOT / "docs" / "api.md": api_reference(), **results_tables()}
    for path, text in files.items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python tools/gen_docs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
