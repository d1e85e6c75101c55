"""A trained model out of lordo: its weights from a run (the final model or a checkpoint), as lordo's GPT or as a
Hugging Face ``LlamaForCausalLM`` folder.

lordo's GPT is Llama's architecture (RMSNorm, SwiGLU, rotary positions, tied embedding, no biases) with one
difference of layout: it rotates each consecutive pair of a head's channels (2i, 2i+1) where Llama's code rotates
channel i with channel i + head_dim/2. Rotating a permutation of the channels is the same attention if the query
and key weights' rows are permuted alike, so the export permutes each head's q and k rows to Llama's order
(:func:`llama_state`); everything else is renamed. The written folder holds ``config.json``, ``model.safetensors``
and the run's tokenizer as a fast tokenizer (``tokenizer.json`` with its config), and loads with
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, LordoError
from .gpt import GPT, GPTConfig

EOT = "<|endoftext|>"
NO_TOKENIZER = ("has no tokenizer: neither its folder's tokenizer.json nor its prepared corpus's was found (--data-dir "
                "names where the corpus is prepared; a run on token files has none)")


class ExportError(LordoError):
    """A run's model cannot be read or written out."""


@dataclass
class TrainedModel:
    """A run's model: its GPT (evaluation mode, float32) and where its tokenizer is (None: the run trained on token
    files without one)."""

    model: GPT
    tokenizer_file: Path | None
    source: str  # what was read: "model.pt" or the checkpoint's folder name


def gpt_config(config: dict[str, Any], vocab_size: int) -> GPTConfig:
    m = config["model"]
    return GPTConfig(vocab_size=vocab_size, d_model=m["d_model"], n_layers=m["n_layers"], n_heads=m["n_heads"],
                     seq_len=m["seq_len"], ffn_hidden=m.get("ffn_hidden", 0), rope_theta=m.get("rope_theta", 10000.0),
                     norm_eps=m.get("norm_eps", 1e-5), init_std=m.get("init_std", 0.02))


def _run_config(run: Path) -> dict[str, Any]:
    if not run.is_dir():
        raise ExportError(f"{run}: no such run folder")
    path = run / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ExportError(f"{path} is missing or damaged ({exc}); is {run} a folder `lordo train` wrote?") from None


ARCHITECTURE = ("preset", "d_model", "n_layers", "n_heads", "seq_len", "ffn_hidden", "rope_theta", "norm_eps")


def _check_model_config(run: Path, config: dict[str, Any], checkpoint: str | None) -> None:
    """The model section of ``config.json`` against the one the run trained with (its newest complete checkpoint's
    meta.json, or the named checkpoint's): a changed head count reshapes nothing, so the weights would load into
    another architecture without a word."""
    from ..train.checkpoint import Checkpointer, CheckpointError

    root = run / "checkpoints"
    names = sorted(p.name for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".partial")) \
        if root.is_dir() else []
    if checkpoint is not None:
        names = [f"step-{int(checkpoint):08d}" if checkpoint.isdigit() else checkpoint]
    for name in reversed(names):
        try:
            trained = (Checkpointer.read_meta(root / name)["config"].get("model") or {})
        except CheckpointError:
            continue
        ours = config.get("model") or {}
        differ = [k for k in ARCHITECTURE if k in trained and k in ours and trained[k] != ours[k]]
        if differ:
            raise ExportError(f"{run}/config.json describes another model than the one trained (checkpoints/{name}): "
                              + ", ".join(f"model.{k} {ours[k]!r} there, {trained[k]!r} in training" for k in differ))
        return


def _checkpoint_weights(run: Path, checkpoint: str) -> dict[str, torch.Tensor]:
    """Worker 0's model in a checkpoint (``checkpoint``: a step number or a folder name under checkpoints/); a model
    sharded over its worker's ranks is gathered from the shard files."""
    from ..train.checkpoint import Checkpointer, CheckpointError, read_tensor_file

    root = run / "checkpoints"
    name = f"step-{int(checkpoint):08d}" if checkpoint.isdigit() else checkpoint
    folder = root / name
    found = sorted(p.name for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".partial")) if root.is_dir() else []
    if name.endswith(".partial"):
        raise ExportError(f"{folder} is a checkpoint whose save never finished (a .partial folder is renamed when every "
                          f"process has written it); {run} has: {', '.join(found) or 'none'}")
    if not folder.is_dir():
        raise ExportError(f"{run} has no checkpoint {checkpoint!r}; it has: {', '.join(found) or 'none'}")
    try:
        Checkpointer.read_meta(folder)
        whole = folder / "worker-00000.pt"
        if whole.exists():
            return dict(read_tensor_file(whole)["model"])
        shards = sorted(folder.glob("worker-00000-shard-*.pt"))
        if not shards:
            raise ExportError(f"{folder} holds no model of worker 0")
        return {"__shards__": [read_tensor_file(s)["model"] for s in shards]}  # type: ignore[dict-item]
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None


def _gather_shards(shards: list[dict[str, torch.Tensor]], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Each tensor whole from its ranks' shards (FSDP2 shards one dimension: the one whose sizes add up)."""
    out = {}
    for key, shape in shapes.items():
        parts = [s[key] for s in shards]
        if tuple(parts[0].shape) == tuple(shape):
            out[key] = parts[0]
            continue
        dim = next((d for d in range(len(shape)) if sum(p.shape[d] for p in parts) >= shape[d]
                    and any(p.shape[d] != shape[d] for p in parts)), None)
        if dim is None:
            raise ExportError(f"cannot put {key} {tuple(shape)} together from shards {[tuple(p.shape) for p in parts]}")
        out[key] = torch.cat(parts, dim=dim).narrow(dim, 0, shape[dim])
    return out


def load_trained(run: str | Path, checkpoint: str | None = None, data_dir: str | Path | None = None) -> TrainedModel:
    """The model of run folder ``run`` (what ``lordo train --out RUN`` wrote): its final ``model.pt``, or checkpoint
    ``checkpoint`` (a step or a folder name; worker 0's model, which between synchronisations is its own, not the
    average). Returns a ``TrainedModel``: ``.model`` lordo's GPT in evaluation mode (float32, CPU; ``.model(ids)``
    gives ``(logits, loss)`` for a ``(batch, tokens)`` LongTensor), ``.tokenizer_file`` the run's tokenizer
    (``tokenizers.Tokenizer.from_file``; the copy in the run folder, else the prepared corpus's, ``data_dir``: where
    that corpus is, default the run's; None if neither is found) and ``.source`` what was read. ::

        trained = lordo.load_trained("runs/demo")
        tokenizer = tokenizers.Tokenizer.from_file(str(trained.tokenizer_file))
        logits, _ = trained.model(torch.tensor([tokenizer.encode("KING HENRY:").ids]))

    A bad folder, a missing model or a shape its config.json does not describe raises ``ExportError`` (a
    :class:`LordoError`) naming the file."""
    run = Path(run)
    config = _run_config(run)
    _check_model_config(run, config, checkpoint)
    if checkpoint is None:
        path = run / "model.pt"
        if not path.is_file():
            have = sorted(p.name for p in (run / "checkpoints").glob("step-*") if not p.name.endswith(".partial")) \
                if (run / "checkpoints").is_dir() else []
            hint = f"; export a checkpoint instead: --checkpoint {have[-1]}" if have else ""
            raise ExportError(f"{run} has no finished model (model.pt is written when training ends){hint}")
        try:
            weights = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as exc:  # noqa: BLE001 - a damaged file, whatever torch says about it
            raise ExportError(f"{path} cannot be read: {type(exc).__name__}: {exc}") from None
        source = "model.pt"
    else:
        weights = _checkpoint_weights(run, checkpoint)
        source = f"checkpoints/{checkpoint}"
    vocab = _vocab_size(weights)
    model = GPT(gpt_config(config, vocab))
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    if "__shards__" in weights:
        weights = _gather_shards(weights["__shards__"], shapes)
    got = {k: tuple(v.shape) for k, v in weights.items()}
    if got != {k: tuple(s) for k, s in shapes.items()}:
        differ = sorted(k for k in set(got) | set(shapes) if got.get(k) != tuple(shapes.get(k, ())))
        raise ExportError(f"{source} of {run} does not match the model its config.json describes ({differ[:3]}: "
                          f"{[got.get(k) for k in differ[:3]]} against {[tuple(shapes[k]) for k in differ[:3] if k in shapes]})")
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    model.eval()
    return TrainedModel(model, _tokenizer_file(run, config, data_dir), source)


def _vocab_size(weights: dict[str, Any]) -> int:
    if "__shards__" in weights:
        return int(sum(s["tok_emb.weight"].shape[0] for s in weights["__shards__"]))
    if "tok_emb.weight" not in weights:
        raise ExportError("the weights hold no tok_emb.weight: not a model lordo's GPT wrote")
    return int(weights["tok_emb.weight"].shape[0])


def _tokenizer_file(run: Path, config: dict[str, Any], data_dir: str | Path | None) -> Path | None:
    """The run's tokenizer: its copy in the run folder, else the prepared corpus's (runs written before the copy)."""
    own = run / "tokenizer.json"
    if own.is_file():
        return own
    from ..config import build_config
    from ..data import prepare as data_prep

    try:
        cfg = build_config(tree={"data": {**config["data"], **({"dir": str(data_dir)} if data_dir else {})}})
    except ConfigError:
        return None
    if cfg.data.tokens:
        return None
    path = data_prep.corpus_dir(cfg.data.dir, data_prep.CorpusSpec.of(cfg.data)) / "tokenizer.json"
    return path if path.is_file() else None


# --- Llama's layout ----------------------------------------------------------------------------------------

_RENAMES = [
    (r"tok_emb\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"blocks\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blocks\.(\d+)\.mlp_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blocks\.(\d+)\.attn\.(q|k|v|o)\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"blocks\.(\d+)\.mlp\.(gate|up|down)\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
]


def rotary_permutation(head_dim: int) -> torch.Tensor:
    """Row order that takes a head's channels from interleaved pairs (2i, 2i+1) to Llama's halves (i, i + d/2)."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def llama_state(model: GPT) -> dict[str, torch.Tensor]:
    """The model's weights under Llama's names and rotary layout (contiguous float32 copies)."""
    cfg = model.cfg
    order = rotary_permutation(cfg.head_dim)
    out = {}
    for key, value in model.state_dict().items():
        for pattern, name in _RENAMES:
            if re.fullmatch(pattern, key):
                new = re.sub(pattern, name, key)
                break
        else:
            raise ExportError(f"no Llama name for {key}")
        value = value.detach().float()
        if new.endswith(("q_proj.weight", "k_proj.weight")):
            value = value.view(cfg.n_heads, cfg.head_dim, cfg.d_model)[:, order].reshape(cfg.d_model, cfg.d_model)
        out[new] = value.contiguous().clone()
    return out


def llama_config(cfg: GPTConfig, eot_id: int | None) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.hidden, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "initializer_range": cfg.init_std, "torch_dtype": "float32", "use_cache": True,
        "bos_token_id": eot_id, "eos_token_id": eot_id,
    }


def export_hf(trained: TrainedModel, out: str | Path) -> Path:
    """Write ``trained`` as a Hugging Face LlamaForCausalLM folder ``out`` (refused if it already holds files). The
    files are written into a staging folder beside ``out`` and moved into place whole: a failed export (a full disk,
    an interrupted process) leaves no ``out``, so the same command can be run again."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ExportError("writing safetensors needs the safetensors package: pip install 'lordo[hf]'") from None
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already holds files; export into a new or empty folder (nothing was overwritten)")
    eot_id = None
    tokenizer = None
    if trained.tokenizer_file is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(trained.tokenizer_file))
        eot_id = tokenizer.token_to_id(EOT)
    stage = out.parent / f".{out.name}.export-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir()
        _write_llama(trained, stage, tokenizer, eot_id, save_file)
        if out.exists():
            out.rmdir()  # empty (checked above): rename cannot replace it on every platform
        stage.rename(out)
    except OSError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        where = f" ({exc.filename})" if exc.filename else ""
        raise ExportError(f"could not export to {out}{where}: {exc.strerror or exc}; nothing was left there") from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out


def _write_llama(trained: TrainedModel, out: Path, tokenizer: Any, eot_id: int | None, save_file: Any) -> None:
    cfg = trained.model.cfg
    (out / "config.json").write_text(json.dumps(llama_config(cfg, eot_id), indent=2))
    state = llama_state(trained.model)
    state.pop("lm_head.weight", None)  # tied: the embedding is the head
    _library_write(lambda path: save_file(state, path, metadata={"format": "pt"}), out / "model.safetensors")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eot_id, "eos_token_id": eot_id}, indent=2))
    if tokenizer is not None:
        _library_write(tokenizer.save, out / "tokenizer.json")
        special = {"eos_token": EOT, "bos_token": EOT, "unk_token": EOT} if eot_id is not None else {}
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.seq_len, "clean_up_tokenization_spaces": False,
            **special}, indent=2))
        (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def _library_write(write: Any, path: Path) -> None:
    """``write(str(path))`` by safetensors or tokenizers, whose failed writes (a full disk) come as their own error
    types: as an ``OSError`` naming the file."""
    try:
        write(str(path))
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - the libraries' Rust errors have no common Python base
        raise OSError(errno.EIO, str(exc).splitlines()[0] if str(exc) else type(exc).__name__, str(path)) from None
