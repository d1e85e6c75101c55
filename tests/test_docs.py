"""The README and docs/ cannot rot: their Python blocks run, their `lordo` commands run (shortened to a few
steps), their torchrun commands parse, the config keys they name exist, and the generated references match
the code."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# set-up commands: run by `make` (and so by CI) before the tests, not again here
SETUP = ("make ", "python3 -m venv", ".venv/bin/pip install", "pip install", "python tools/gen_docs.py", "git worktree add ")


def blocks(page: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", page.read_text(), flags=re.S)


def commands(block: str) -> list[str]:
    """Logical command lines of a shell block: continuations joined, comments dropped."""
    out, current = [], ""
    for line in block.splitlines():
        line = re.sub(r"\s+#.*$", "", line) if not line.lstrip().startswith("#") else ""
        if not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        out.append((current + line).strip())
        current = ""
    return out


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_blocks_run(page):
    for code in blocks(page, "python"):
        if code.startswith("import lordo\nlordo.__all__ =="):  # the API reference's listing: an assertion
            import lordo

            listed = eval(code.split("\n", 1)[1].split("==", 1)[1])
            assert listed == sorted(lordo.__all__), "docs/api.md lists other public names; run tools/gen_docs.py"
            continue
        exec(compile(code, str(page), "exec"), {"__name__": "docs"})


FILE_SUFFIX = r"(?:pt|json|jsonl|toml|md|png|bin|safetensors)`"  # model.pt is a file, not a key
KEY = re.compile(rf"`((?:model|data|optim|schedule|train|strategy|dist|comm)\.(?!{FILE_SUFFIX})[a-z_]+)(?=[`\s=])")


def test_pages_name_only_existing_config_keys():
    from lordo.config import SECTIONS

    known = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in fields(cls)}
    for page in PAGES:
        mentioned = set(KEY.findall(page.read_text()))
        assert mentioned <= known, (page_id(page), mentioned - known)


def test_generated_references_match_the_code():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_docs.py"), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_pages_link_to_files_that_exist():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), (page_id(page), target)


def _shortened_train(argv: list[str], data_dir: Path) -> list[str]:
    """A documented `lordo train` command, cut to 2 steps and 1 evaluation batch."""
    argv = list(argv)
    if "--steps" in argv:
        i = argv.index("--steps")
        del argv[i : i + 2]
    while any(a.startswith("train.steps=") for a in argv):  # --set wins over --steps: the page's own goes too
        i = next(i for i, a in enumerate(argv) if a.startswith("train.steps="))
        del argv[i - 1 : i + 1]
    argv += ["--steps", "2"]
    if "--resume" not in argv:
        if "--data-dir" not in argv:
            argv += ["--data-dir", str(data_dir)]
        argv += ["--set", "schedule.warmup_steps=1", "--set", "train.eval_batches=1", "--set", "train.batch_size=2"]
    return argv


def _validate_train(args: list[str]) -> None:
    """The configuration a documented ``lordo train`` command asks for must be valid as written."""
    from lordo.cli import make_parser
    from lordo.config import build_config

    parsed = make_parser().parse_args(["train", *args])
    if parsed.resume:
        return  # the settings come from the run being resumed
    overrides = list(parsed.set or [])
    for flag, key in {"model": "model.preset", "strategy": "strategy.name", "backend": "dist.backend", "log": "train.log"}.items():
        if getattr(parsed, flag) is not None:
            overrides.append(f"{key}={json.dumps(getattr(parsed, flag))}")
    for flag, key in {"steps": "train.steps", "workers": "dist.workers", "sync_every": "strategy.sync_every",
                      "rank": "strategy.rank", "omega": "strategy.omega"}.items():
        if getattr(parsed, flag) is not None:
            overrides.append(f"{key}={getattr(parsed, flag)}")
    build_config(ROOT / parsed.config if parsed.config else None, overrides)  # raises ConfigError


def _check_torchrun(argv: list[str], page: str) -> None:
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv[1:])
    if args.module:
        assert args.training_script == "lordo.cli", (page, argv)
        assert args.training_script_args[0] == "train", (page, argv)
        _validate_train(args.training_script_args[1:])
    else:
        _check_script([args.training_script, *args.training_script_args], page)


def _check_script(argv: list[str], page: str) -> None:
    """A documented script exists and has the options the command gives it."""
    script = ROOT / argv[0]
    assert script.exists(), (page, argv)
    source = script.read_text()
    for sibling in re.findall(r"^from (\w+) import", source, flags=re.M):  # options a script takes from its neighbours
        if (script.parent / f"{sibling}.py").exists():
            source += (script.parent / f"{sibling}.py").read_text()
    for token in argv[1:]:
        if token.startswith("--"):
            assert f'"{token}"' in source, (page, f"{script.name} has no option {token}")


def _in_process(argv: list[str], cwd: Path, env: dict[str, str], monkeypatch) -> subprocess.CompletedProcess:
    """``lordo ARGV`` through lordo.cli.main in this process, in ``cwd`` with ``env``: its exit code and output."""
    import contextlib
    import io

    import torch

    from lordo.cli import main

    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()  # a run may set its own (train.threads)
    with monkeypatch.context() as patch:
        patch.chdir(cwd)
        for key, value in env.items():
            patch.setenv(key, value)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(argv)
        finally:
            torch.set_num_threads(threads)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def _one_process(argv: list[str]) -> bool:
    """A documented ``lordo train`` whose workers all live in the calling process (the sim backend): it may run
    through ``lordo.cli.main`` here instead of a process of its own."""
    text = " ".join(argv)
    if "--config" in argv:
        text += (ROOT / argv[argv.index("--config") + 1]).read_text()
    return argv[1] == "train" and not any(word in text for word in ("gloo", "nccl", "torchft", "--help"))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_shell_commands_run_or_parse(page, data_dir, tmp_path, monkeypatch):
    """Each page's commands run in order in a scratch copy of the repository's inputs, so that a command
    may use what an earlier one wrote (a resumed run, a plotted run). ``lordo sweep --dry-run``, ``report``,
    ``plot`` and ``train`` on simulated workers run in this process (the console script's own ``main``; a
    process start, torch's import, is most of each); the others in a process of their own."""
    for name in ("configs", "sweeps", "examples", "results", "docs", "benchmarks"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("checkpoints", "model.pt"))
    env = {**os.environ, "LORDO_DATA_DIR": str(data_dir), "OMP_NUM_THREADS": "1"}
    bin_dir = Path(sys.executable).parent
    for block in blocks(page, "bash"):
        for line in commands(block):
            if line.startswith(SETUP):
                continue
            argv = shlex.split(line)
            while re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # VAR=value prefixes: the environment of the command
                argv = argv[1:]
            exe = argv[0].removeprefix(".venv/bin/")
            if exe == "torchft_lighthouse":  # a server that runs until stopped: it must be installed
                assert (bin_dir / exe).exists(), f"{page_id(page)}: {exe} is not installed (the ft extra)"
                continue
            if exe == "python" and argv[1].startswith(("examples/", "benchmarks/")):  # a worker of a run the page
                # describes, or a benchmark (tests/test_bench.py runs them small)
                _check_script(argv[1:], page_id(page))
                continue
            if exe == "torchrun":
                _check_torchrun(argv, page_id(page))
                continue
            if argv[:2] == ["bash", "benchmarks/gpu.sh"]:  # needs a GPU; tests/test_bench.py checks its commands
                assert (ROOT / argv[1]).exists()
                continue
            assert exe == "lordo", f"{page_id(page)}: teach tests/test_docs.py about this command: {line}"
            sub = argv[1]
            if sub == "bench":  # minutes each: the arguments must parse; tests/test_bench.py runs them small
                from lordo.bench import make_parser

                make_parser().parse_args(argv[2:])
                continue
            if sub == "train":
                if "--help" not in argv:
                    _validate_train(argv[2:])
                if "torchft" in argv:  # a worker of a run that needs a Lighthouse: tests/test_ft.py runs one
                    continue
                argv = _shortened_train(argv, data_dir)
            elif sub == "sweep":
                argv += ["--dry-run"]  # the sweeps themselves take an hour each
            elif sub == "data" and "large" in argv:  # 67 MB from Debian's mirrors and minutes: the arguments must parse
                from lordo.cli import make_parser

                make_parser().parse_args(argv[1:])
                continue
            elif sub == "data":
                argv += ["--data-dir", str(data_dir)]
            if sub in ("sweep", "report", "plot") or _one_process(argv):
                done = _in_process(argv[1:], tmp_path, env, monkeypatch)
            else:
                done = subprocess.run([str(bin_dir / "lordo"), *argv[1:]], cwd=tmp_path, env=env,
                                      capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"{page_id(page)}: {line}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def test_every_bench_option_says_what_it_does():
    """lordo bench step --help and the others: no option without a help text."""
    import argparse

    from lordo.bench import make_parser

    parser = make_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [f"{name} {' / '.join(action.option_strings)}" for name, bench in sub.choices.items()
               for action in bench._actions if action.option_strings and action.help in (None, "")]
    assert not missing, missing

