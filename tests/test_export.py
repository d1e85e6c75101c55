"""A trained model leaves lordo: the Hugging Face export against lordo's GPT (transformers' Llama as the independent
reference), the tokenizer's round trip, sampling, lm-eval on a local task, and the bad inputs."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from lordo.cli import main
from lordo.config import build_config
from lordo.model import build_model
from lordo.model.export import export_hf, load_trained
from lordo.model.sample import generate

transformers = pytest.importorskip("transformers")


def fake_run(folder, data_dir, dataset, preset: str, seed: int = 0):
    """A run folder as lordo train leaves it (config.json, model.pt, tokenizer.json), with a randomly initialised
    model of ``preset`` (the export does not care whether it was trained)."""
    cfg = build_config(overrides=[f'model.preset="{preset}"', f'data.dir="{data_dir}"', f"train.seed={seed}"])
    model = build_model(cfg, dataset.vocab_size)
    with torch.no_grad():  # norms away from 1, so that a mapped-wrong norm would show
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    torch.save(model.state_dict(), folder / "model.pt")
    shutil.copy(dataset.root / "tokenizer.json", folder / "tokenizer.json")
    return model


@pytest.mark.parametrize("preset", ["nano", "micro"])
def test_the_exported_model_gives_lordo_s_logits_in_transformers(tmp_path, data_dir, dataset, preset):
    model = fake_run(tmp_path / "run", data_dir, dataset, preset)
    export_hf(load_trained(tmp_path / "run"), tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.tie_word_embeddings
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # tied, as lordo's head is
    ids = torch.randint(0, dataset.vocab_size, (3, model.cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids)[0], hf(ids).logits
    assert (ours - theirs).abs().max() <= 1e-4 * ours.abs().max()


def test_the_exported_tokenizer_encodes_and_decodes_as_the_run_s(tmp_path, data_dir, dataset):
    fake_run(tmp_path / "run", data_dir, dataset, "nano")
    export_hf(load_trained(tmp_path / "run"), tmp_path / "hf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = dataset.tokenizer()
    text = "To be, or not to be: that is the question.\nAnd God said — «Ünïcödé» 漢字 3.14"
    assert theirs(text)["input_ids"] == ours.encode(text).ids
    assert theirs.decode(theirs(text)["input_ids"]) == text
    assert theirs.eos_token == "<|endoftext|>" and theirs.eos_token_id == ours.token_to_id("<|endoftext|>")


def test_greedy_sampling_is_transformers_greedy_decoding_and_a_seed_repeats_a_sample(tmp_path, data_dir, dataset):
    model = fake_run(tmp_path / "run", data_dir, dataset, "nano")
    export_hf(load_trained(tmp_path / "run"), tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    prompt = dataset.tokenizer().encode("The king").ids
    ours = generate(model, prompt, 12)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs
    a = generate(model, prompt, 20, temperature=1.0, top_k=50, seed=7)
    assert a == generate(model, prompt, 20, temperature=1.0, top_k=50, seed=7)
    assert a != generate(model, prompt, 20, temperature=1.0, top_k=50, seed=8)


def test_sample_and_export_from_the_command_line_and_their_refusals(tmp_path, data_dir, dataset, capsys):
    fake_run(tmp_path / "run", data_dir, dataset, "nano")
    assert main(["sample", str(tmp_path / "run"), "--prompt", "To be", "--tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("To be")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "full")]) == 2
    assert "already holds files" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]  # nothing written, nothing lost
    (tmp_path / "run" / "model.pt").unlink()
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "new")]) == 2
    assert "has no finished model (model.pt is written when training ends)" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    assert main(["sample", str(tmp_path / "run"), "--checkpoint", "40"]) == 2
    assert "has no checkpoint '40'" in capsys.readouterr().err


def test_a_model_of_another_shape_is_refused_by_name(tmp_path, data_dir, dataset, capsys):
    fake_run(tmp_path / "run", data_dir, dataset, "nano")
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    config["model"]["d_model"] = 64  # the config says 64 wide; model.pt is 32 wide
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "does not match the model its config.json describes" in err and "(32, 32)" in err and "(64, 64)" in err
    assert not (tmp_path / "hf").exists()


def test_a_prompt_the_tokenizer_cannot_write_is_refused(tmp_path, data_dir, dataset, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    fake_run(tmp_path / "run", data_dir, dataset, "nano")
    vocab = {"[UNK]": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(["to", "be", "or", "not"])}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "run" / "tokenizer.json"))  # a tokenizer without bytes: it cannot write everything
    assert main(["sample", str(tmp_path / "run"), "--prompt", "to be ☃", "--tokens", "2"]) == 2
    assert "cannot write the prompt back" in capsys.readouterr().err


def test_lordo_eval_scores_a_local_task_as_lordo_s_own_likelihoods_do(tmp_path, data_dir, dataset, monkeypatch, capsys):
    """lm-evaluation-harness's accuracy on a multiple-choice task written here equals the accuracy computed from
    lordo's GPT directly (the choice with the larger summed log-likelihood after the question)."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = fake_run(tmp_path / "run", data_dir, dataset, "nano", seed=3)
    docs = [{"question": q, "choices": c, "answer": 0} for q, c in [
        ("The cat sat on the", [" mat", " moon"]), ("To be or not to", [" be", " sea"]),
        ("The king of", [" Denmark", " bananas"]), ("And God said, Let there be", [" light", " cheese"]),
        ("My lord, the", [" queen", " river"]), ("Thou shalt not", [" kill", " sing"])]]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "tiny.yaml").write_text(
        "task: lordo_tiny\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tasks / 'tiny.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\ntarget_delimiter: \"\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    assert main(["eval", str(tmp_path / "run"), "--tasks", "lordo_tiny", "--include-path", str(tasks)]) == 0
    scores = json.loads((tmp_path / "run" / "eval.json").read_text())["tasks"]["lordo_tiny"]
    tok = dataset.tokenizer()

    def loglik(context: str, continuation: str) -> float:
        whole, head = tok.encode(context + continuation).ids, tok.encode(context).ids
        ids = torch.tensor([whole])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids)[0][0].double(), dim=-1)
        return sum(float(logp[i - 1, whole[i]]) for i in range(len(head), len(whole)))

    right = [max(range(2), key=lambda k, d=d: loglik(d["question"], d["choices"][k])) == d["answer"] for d in docs]
    assert scores["acc"] == pytest.approx(sum(right) / len(docs))
    assert math.isfinite(scores["acc_stderr"]) and scores["model"] == "model.pt"
    from lordo.experiments.report import write_report

    shutil.copytree(tmp_path / "run", tmp_path / "sweep" / "a")
    summary = {"val_ppl": 1.0, "val_loss": 0.0, "steps": 1, "comm_bytes_per_step": 0, "comm_bytes_total": 0,
               "comm_wire_bytes_total": 0, "ddp_comm_wire_bytes": 0, "optimizer_state_bytes": {}, "params": 1,
               "modeled_wall_s": {}, "workers": 1, "comm_by_collective": {}}
    (tmp_path / "sweep" / "a" / "summary.json").write_text(json.dumps(summary))
    table = write_report(tmp_path / "sweep").read_text()
    assert "| lordo_tiny |" in table and f"| {scores['acc']:.4f} |" in table  # lordo report: a column per task


def test_a_failed_export_leaves_nothing_and_the_retry_works(tmp_path, data_dir, dataset, monkeypatch, capsys):
    """A full disk in the middle of the export left DIR/config.json and a safetensors traceback, and the retry was
    refused because DIR already held files. Now one line names the file and the cause, DIR is not there, and the
    same command then exports."""
    import errno

    import safetensors.torch

    fake_run(tmp_path / "run", data_dir, dataset, "nano")
    real = safetensors.torch.save_file

    def disk_full(state, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)  # what got written before the disk filled
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    command = ["export", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]
    assert main(command) != 0
    err = capsys.readouterr().err
    assert "No space left on device" in err and "model.safetensors" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists() and list(tmp_path.iterdir()) == [tmp_path / "run"]
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert main(command) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "nan"], "temperature must be a finite number >= 0"),
    (["--temperature", "inf"], "temperature must be a finite number >= 0"),
    (["--seed", str(10**20)], "seed must be an integer from"),
    (["--top-k", "40"], "give a temperature > 0, or leave top_k at 0"),
])
def test_sampling_settings_torch_cannot_take_are_refused_in_one_line(tmp_path, data_dir, dataset, capsys, flags, message):
    fake_run(tmp_path / "run", data_dir, dataset, "nano")
    assert main(["sample", str(tmp_path / "run"), "--prompt", "To be", "--tokens", "3", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_tiny_temperature_samples_the_most_likely_token(tmp_path, data_dir, dataset):
    """1e-45 divided the logits into inf and the softmax into NaN (torch.multinomial's traceback); the limit of a
    temperature going to 0 is the greedy choice, and that is what it now gives."""
    model = fake_run(tmp_path / "run", data_dir, dataset, "nano")
    prompt = dataset.tokenizer().encode("To be").ids
    assert generate(model, prompt, 8, temperature=1e-45, seed=3) == generate(model, prompt, 8, temperature=0.0)


@pytest.mark.parametrize("flags, message", [
    (["--device", "toaster"], "--device 'toaster': not a device"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "mps"], "--device"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
])
def test_eval_refuses_bad_settings_before_the_harness_starts(tmp_path, data_dir, dataset, capsys, flags, message):
    fake_run(tmp_path / "run", data_dir, dataset, "nano")
    assert main(["eval", str(tmp_path / "run"), "--tasks", "piqa", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_eval_refuses_a_damaged_scores_file_before_scoring(tmp_path, data_dir, dataset, capsys):
    fake_run(tmp_path / "run", data_dir, dataset, "nano")
    (tmp_path / "run" / "eval.json").write_text('{"tasks": {"piqa": {"acc": 0.5')
    assert main(["eval", str(tmp_path / "run"), "--tasks", "piqa"]) == 2
    assert "eval.json cannot be read" in capsys.readouterr().err
    assert (tmp_path / "run" / "eval.json").read_text() == '{"tasks": {"piqa": {"acc": 0.5'  # left as it was


def test_eval_without_internet_names_the_local_task_route(tmp_path, data_dir, dataset, monkeypatch, capsys):
    lm_eval = pytest.importorskip("lm_eval")
    fake_run(tmp_path / "run", data_dir, dataset, "nano")

    def offline(**_):
        raise ConnectionError("Couldn't reach 'baber/piqa' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(lm_eval, "simple_evaluate", offline)
    assert main(["eval", str(tmp_path / "run"), "--tasks", "piqa"]) == 2
    err = capsys.readouterr().err
    assert "Couldn't reach 'baber/piqa'" in err and "--include-path" in err and "Traceback" not in err


def test_a_checkpoint_whose_save_never_finished_is_neither_offered_nor_exported(tmp_path, data_dir, dataset, capsys):
    fake_run(tmp_path / "run", data_dir, dataset, "nano")
    (tmp_path / "run" / "checkpoints" / "step-00000040.partial").mkdir(parents=True)
    assert main(["export", str(tmp_path / "run"), "--checkpoint", "step-00000040.partial", "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "whose save never finished" in err and "has: none" in err and not (tmp_path / "hf").exists()
    assert main(["sample", str(tmp_path / "run"), "--checkpoint", "50"]) == 2
    assert "it has: none" in capsys.readouterr().err  # the .partial folder is not offered


def test_the_closing_line_does_not_call_ddp_s_own_bytes_less():
    from lordo.cli import _against_ddp

    assert _against_ddp(1.0) == "1.000x of what ddp sends (ddp itself)"
    assert _against_ddp(0.037) == "0.037x of what ddp sends (27.0x less)"


def test_load_trained_is_public_and_gives_the_run_s_model_and_tokenizer(tmp_path, data_dir, dataset):
    import lordo

    model = fake_run(tmp_path / "run", data_dir, dataset, "nano")
    trained = lordo.load_trained(tmp_path / "run")
    ids = torch.randint(0, dataset.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(trained.model(ids)[0], model(ids)[0])
    assert trained.source == "model.pt" and trained.tokenizer_file == tmp_path / "run" / "tokenizer.json"
    assert "load_trained" in lordo.__all__


def test_a_config_whose_head_count_changed_after_training_is_refused(tmp_path, data_dir, dataset, capsys):
    """n_heads reshapes no weight, so a config.json edited after training exported the weights into another
    architecture without a word; the run's checkpoints record the config it trained with, and the export checks it."""
    fake_run(tmp_path / "run", data_dir, dataset, "nano")
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    step = tmp_path / "run" / "checkpoints" / "step-00000010"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"format": 1, "step": 10, "world_size": 1, "config": config}))
    heads = config["model"]["n_heads"]
    config["model"]["n_heads"] = heads // 2
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"model.n_heads {heads // 2} there, {heads} in training" in err and not (tmp_path / "hf").exists()
