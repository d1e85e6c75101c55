"""``lordo sample``, ``lordo export`` and ``lordo eval``: what a trained model is for, from a run's folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import ConfigError


def add_parsers(sub) -> None:
    s = sub.add_parser("sample", help="text from a run's model: greedy, or sampled at a temperature (seeded)",
                       description="Continue a prompt with a run's trained model (its model.pt, or a checkpoint).")
    s.add_argument("run", metavar="RUN_DIR", help="a folder lordo train wrote")
    s.add_argument("--prompt", default="", help="the text to continue (default: the start of a document)")
    s.add_argument("--tokens", type=int, default=60, help="new tokens (default 60)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy; > 0: sampled")
    s.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    s.add_argument("--seed", type=int, default=0, help="seed of the sampling (the same seed gives the same text)")
    e = sub.add_parser("export", help="write a run's model as a Hugging Face LlamaForCausalLM folder (transformers)",
                       description="Write config.json, model.safetensors and the tokenizer into a new folder, loadable "
                                   "with AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained.")
    e.add_argument("run", metavar="RUN_DIR", help="a folder lordo train wrote")
    e.add_argument("--hf", required=True, metavar="DIR", help="the folder to write (new or empty)")
    v = sub.add_parser("eval", help="score a run's model on lm-evaluation-harness tasks; scores into RUN_DIR/eval.json",
                       description="Run EleutherAI's lm-evaluation-harness (pip install 'lordo[eval]') on the run's model.")
    v.add_argument("run", metavar="RUN_DIR", help="a folder lordo train wrote")
    v.add_argument("--tasks", required=True, help="comma-separated task names, e.g. arc_easy,hellaswag,mmlu,piqa")
    v.add_argument("--include-path", metavar="DIR", help="a folder of task YAMLs of your own (local data)")
    v.add_argument("--limit", type=int, help="score only the first N examples of each task (a quick look)")
    v.add_argument("--batch-size", type=int, default=8, help="examples per forward pass (default 8)")
    v.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    for q in (s, e, v):
        q.add_argument("--checkpoint", metavar="STEP", help="a checkpoint (its step, or its folder name under "
                       "checkpoints/) instead of the final model; worker 0's model")
        q.add_argument("--data-dir", metavar="DIR", help="where the run's prepared corpus is, for a run folder "
                       "without its own tokenizer.json (default: the run's data.dir)")
    s.set_defaults(func=_sample)
    e.set_defaults(func=_export)
    v.set_defaults(func=_eval)


def _load(args: argparse.Namespace):
    from .model.export import load_trained

    return load_trained(args.run, args.checkpoint, args.data_dir)


def _sample(args: argparse.Namespace) -> int:
    from tokenizers import Tokenizer

    from .model.export import EOT, NO_TOKENIZER
    from .model.sample import SampleError, generate

    trained = _load(args)
    if trained.tokenizer_file is None:
        raise ConfigError(f"{args.run} {NO_TOKENIZER}: there is no text to sample")
    tokenizer = Tokenizer.from_file(str(trained.tokenizer_file))
    eot = tokenizer.token_to_id(EOT)
    ids = tokenizer.encode(args.prompt).ids if args.prompt else ([eot] if eot is not None else [])
    if args.prompt and tokenizer.decode(ids) != args.prompt:
        lost = sorted({c for c in args.prompt if c not in tokenizer.decode(ids)})
        raise SampleError(f"the run's tokenizer cannot write the prompt back as it is (it loses "
                          f"{''.join(lost)!r}): leave those characters out")
    if not ids:
        raise SampleError("give a --prompt: this tokenizer has no document separator to start from")
    out = generate(trained.model, ids, args.tokens, args.temperature, args.top_k, args.seed, stop=eot)
    text = tokenizer.decode([i for i in out if i != eot])
    print(f"{args.prompt}{text}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from .model.export import NO_TOKENIZER, export_hf

    trained = _load(args)
    folder = export_hf(trained, args.hf)
    note = "" if trained.tokenizer_file else f" without a tokenizer (the run {NO_TOKENIZER})"
    print(f"wrote {folder} from {trained.source} of {args.run}{note}", file=sys.stderr)
    return 0


def _check_device(device: str) -> None:
    """Refuse a device torch does not know or this build cannot use, before the harness's set-up."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {device!r}: not a device; use cpu or cuda (cuda:N for one GPU)") from None
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: lordo eval runs on cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device!r}: torch sees no CUDA GPU (this torch is {torch.__version__}); use cpu")


def _eval(args: argparse.Namespace) -> int:
    from .model.downstream import headline, held_scores, run_tasks, save_scores

    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks:
        raise ConfigError("--tasks must name at least one task")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    _check_device(args.device)
    held_scores(Path(args.run))  # a damaged eval.json or a folder it cannot go into: said before the scoring
    trained = _load(args)
    scores = run_tasks(trained, tasks, args.include_path, args.limit, args.batch_size, args.device)
    path = save_scores(Path(args.run), scores, trained.source, args.limit)
    for task, metrics in scores.items():
        value = headline(metrics)
        print(f"{task}: {value:.4f}" if value is not None else f"{task}: {metrics}")
    print(f"wrote {path}", file=sys.stderr)
    return 0
