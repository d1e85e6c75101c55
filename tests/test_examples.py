"""The examples run end to end: two gloo processes under torchrun, as the docs tell users to run them."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script, data_dir, *args, processes=2):
    env = {**os.environ, "LORDO_DATA_DIR": str(data_dir), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
           str(ROOT / "examples" / script), "--steps", "20", "--sync-every", "8", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def check_final_lines(out):
    assert "DistributedOptimizer(strategy='lordo', workers=2, hosted=1, rank=8, sync_every=8" in out
    val = float(re.search(r"val loss ([0-9.]+)", out).group(1))
    assert math.isfinite(val) and val < math.log(4096)  # learned something: below a uniform guess
    saved = float(re.search(r"([0-9.]+)x less than DDP", out).group(1))
    assert saved > 3  # 20 steps, K = 8: two synchronisations (plus the initial broadcast) against 20 all-reduces
    assert out.count("(synced)") == 2


@pytest.fixture(scope="module")
def plain_loop(data_dir):
    return torchrun("plain_loop.py", data_dir)


def state_bytes(out):
    return int(re.search(r"optimizer state ([0-9,]+) bytes", out).group(1).replace(",", ""))


def test_plain_loop_example_on_two_gloo_processes(plain_loop):
    check_final_lines(plain_loop)


def test_plain_loop_example_with_workers_sharded_by_fsdp2(data_dir, plain_loop):
    out = torchrun("plain_loop.py", data_dir, "--ranks-per-worker", "2", "--fsdp", processes=4)
    check_final_lines(out)  # 2 workers of 2 ranks
    assert state_bytes(out) < 0.6 * state_bytes(plain_loop)  # a rank holds its shards (and whole bases)


def test_hf_llama_example_on_two_gloo_processes_and_its_saved_model(data_dir, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    out = torchrun("hf_llama.py", data_dir, "--save", str(tmp_path / "hf"))
    check_final_lines(out)
    # the saved folder is what from_pretrained (and lm_eval's hf model) reads: the same model, the same val loss
    import torch

    from lordo.data import prepare

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    data = prepare.load(prepare.prepared_dir(data_dir, 4096, 0.05))
    val = torch.from_numpy(data.val[: 8 * 65].astype("int64")).view(8, 65)
    with torch.no_grad():
        loss = model(input_ids=val, labels=val).loss.item()
    assert loss == pytest.approx(float(re.search(r"val loss ([0-9.]+)", out).group(1)), abs=1e-3)
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.decode(tokenizer("To be")["input_ids"]) == "To be"
