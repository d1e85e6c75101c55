"""``lordo bench throughput``: tokens/s of training on this machine in each numeric setting, side by side.

Short ``lordo train`` runs (child processes) of one model shape and strategy in every setting: float32 eager,
bfloat16 autocast (``train.precision = "bf16-mixed"``: on a CPU with AVX-512 BF16 or AMX, oneDNN's bfloat16 GEMMs),
``torch.compile`` of the model (``train.compile``), the two together, and float32 with the lean optimizer state
(``strategy.memory = "lean"``: what its 8-bit storage costs a step; ``lean-fp8``: the same with every compact
entry in e4m3 and its codec compiled, ``optim.compile_codec``); each at one and two intra-op threads. The
settings run round-robin, ``repeats`` times, so that drift in the machine's speed hits all alike; tokens/s is
measured from the run's own clock between the first logged step past ``warmup`` (compiling, the first allocations)
and the last, and reported as the median over repeats and as a ratio to float32 eager at one thread. Which setting
keeps perplexity is another question: docs/performance.md answers it with runs.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from .runs import run_child
from .timing import machine

# key (for --settings), label, overrides; fp32 first: the reference of every ratio
SETTINGS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("fp32", "fp32", ('train.precision="fp32"',)),
    ("bf16", "bf16-mixed", ('train.precision="bf16-mixed"',)),
    ("fp32-compiled", "fp32, compiled", ('train.precision="fp32"', "train.compile=true")),
    ("bf16-compiled", "bf16-mixed, compiled", ('train.precision="bf16-mixed"', "train.compile=true")),
    ("lean", "fp32, lean state", ('train.precision="fp32"', 'strategy.memory="lean"')),
    ("lean-fp8", "fp32, lean state in fp8, codec compiled",
     ('train.precision="fp32"', 'strategy.memory="lean"', 'strategy.error_feedback_dtype="fp8"',
      'strategy.moments_dtype="fp8"', 'strategy.lowrank_moments_dtype="fp8"', "optim.compile_codec=true")),
)
SETTING_KEYS = tuple(key for key, _, _ in SETTINGS)


def measured_tokens_per_s(out: Path, warmup: int) -> float:
    """Tokens per second of training time between the first metrics row past ``warmup`` and the last."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in rows if "train_s" in r and "tokens" in r and r["step"] > 0]
    first = next(r for r in timed if r["step"] > warmup)
    last = timed[-1]
    return (last["tokens"] - first["tokens"]) / (last["train_s"] - first["train_s"])


def throughput_benchmark(preset: str, strategy: str, steps: int, warmup: int, threads: tuple[int, ...], repeats: int,
                         extra: tuple[str, ...] = (), settings: tuple[str, ...] = SETTING_KEYS) -> dict[str, Any]:
    """``settings``: the keys of :data:`SETTINGS` to run (fp32 among them: every ratio is to it)."""
    cases = [(f"{label}, {n} thread{'s' if n > 1 else ''}", (*overrides, f"train.threads={n}"))
             for n in threads for key, label, overrides in SETTINGS if key in settings]
    measured: dict[str, list[float]] = {name: [] for name, _ in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(repeats):
            for i, (name, overrides) in enumerate(cases):
                out = Path(tmp) / f"{i}-{rep}"
                args = ["--model", preset, "--strategy", strategy, "--steps", str(steps), *extra,
                        "--set", "train.log_every=5", "--set", "train.eval_every=100000", "--set", "train.eval_batches=1",
                        "--set", "train.checkpoint_every=0", "--set", f"schedule.warmup_steps={max(1, steps // 10)}"]
                for o in overrides:
                    args += ["--set", o]
                run_child(args, out)
                measured[name].append(measured_tokens_per_s(out, warmup))
    reference = statistics.median(measured[cases[0][0]])
    rows = [{"name": name, "tokens_per_s": statistics.median(values), "tokens_per_s_all": values,
             "ratio": statistics.median(values) / reference} for name, values in measured.items()]
    return {"machine": machine(), "preset": preset, "strategy": strategy, "steps": steps, "warmup": warmup,
            "repeats": repeats, "rows": rows}
