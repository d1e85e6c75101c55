"""Downstream tasks through EleutherAI's lm-evaluation-harness (``lm-eval``, the ``eval`` extra): the run's model
is exported as a Hugging Face folder (model/export.py) and scored by the harness's ``hf`` model, as
``lm_eval --model hf --model_args pretrained=DIR --tasks ...`` would; the scores go into the run's folder as
``eval.json`` (one entry per task: its metrics), which ``lordo report`` shows as columns.

The public tasks (arc_easy, hellaswag, mmlu, piqa, ...) download their data from the Hugging Face hub the first
time; a machine without internet access can run a task of its own from local files (``include_path``: a folder of
task YAMLs, docs/training.md shows one).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..files import write_json
from .export import NO_TOKENIZER, TrainedModel, export_hf


def _lm_eval():
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise ConfigError(f"lordo eval runs EleutherAI's lm-evaluation-harness: pip install 'lordo[eval]' ({exc})") from None
    return lm_eval, TaskManager


def run_tasks(trained: TrainedModel, tasks: list[str], include_path: str | None = None, limit: int | None = None,
              batch_size: int = 8, device: str = "cpu") -> dict[str, dict[str, float]]:
    """Each task's metrics (numbers only) for ``trained``, scored by the harness on its exported Hugging Face form."""
    lm_eval, task_manager = _lm_eval()
    if trained.tokenizer_file is None:
        raise ConfigError(f"the run {NO_TOKENIZER}; the harness needs one to read its tasks")
    manager = task_manager(include_path=include_path) if include_path else task_manager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {include_path}" if include_path else ""
        raise ConfigError(f"unknown task(s) {', '.join(unknown)}: not among lm-eval's tasks{where} (lm_eval --tasks list "
                          "lists them)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_hf(trained, Path(tmp) / "model")
        try:
            results = lm_eval.simple_evaluate(
                model="hf", model_args=f"pretrained={folder},dtype=float32", tasks=tasks, task_manager=manager,
                limit=limit, batch_size=batch_size, device=device, log_samples=False)
        except (ConnectionError, OSError) as exc:  # a task's data set on the Hub, which cannot be reached
            cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"lm-eval stopped on a network or file error while scoring {', '.join(tasks)} ({cause}). A "
                              "public task's data comes from the Hugging Face Hub: without internet, score a task whose "
                              "data is on disk: --include-path DIR with a task YAML (docs/training.md)") from None
    scores: dict[str, dict[str, float]] = {}
    for task, metrics in results["results"].items():
        numbers = {k.replace(",none", ""): float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
                   and not k.startswith("sample")}
        scores[task] = numbers
    return scores


def held_scores(run: Path) -> dict[str, Any]:
    """What ``run/eval.json`` holds ({} if there is none). Called before scoring: a damaged file is refused by name
    (never replaced without a word), and a folder that cannot take the file is said before the minutes of scoring."""
    path = run / "eval.json"
    if not run.is_dir():
        raise ConfigError(f"{run}: no such run folder")
    if not os.access(run, os.W_OK):
        raise ConfigError(f"{run} cannot be written to: the scores go into {path}; make it writable (or copy the run)")
    if not path.exists():
        return {}
    try:
        held = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read ({exc}); move it away and score again (it would be replaced)") from None
    if not isinstance(held, dict) or not isinstance(held.get("tasks", {}), dict):
        raise ConfigError(f"{path} is not lordo eval's file (an object with \"tasks\"); move it away and score again")
    return held


def save_scores(run: Path, scores: dict[str, dict[str, float]], source: str, limit: int | None) -> Path:
    """Merge ``scores`` into ``run/eval.json`` (tasks scored before keep their entries unless scored again)."""
    path = run / "eval.json"
    held = held_scores(run)
    tasks = dict(held.get("tasks", {}))
    for task, metrics in scores.items():
        tasks[task] = {**metrics, "model": source, "limit": limit}
    write_json(path, {"tasks": tasks})
    return path


def headline(metrics: dict[str, Any]) -> float | None:
    """The number a table shows for a task: its normalised accuracy, else its accuracy, else its first metric."""
    for key in ("acc_norm", "acc", "exact_match", "f1"):
        if key in metrics:
            return float(metrics[key])
    numbers = [v for k, v in metrics.items() if isinstance(v, (int, float)) and not k.endswith("stderr") and k != "limit"]
    return float(numbers[0]) if numbers else None
