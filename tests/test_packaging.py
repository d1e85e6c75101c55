"""`pip install .` gets a wheel with the whole package, its type marker, the CLI entry point and the extras."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_holds_the_package_the_entry_point_and_the_extras(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path), "-q"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("lordo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {str(p.relative_to(ROOT / "src")) for p in (ROOT / "src" / "lordo").rglob("*.py")}
    assert sources <= names
    assert "lordo/py.typed" in names
    info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "lordo = lordo.cli:main" in zipfile.ZipFile(wheel).read(info).decode()
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for extra in ("report", "tb", "hf", "lightning", "bench", "dev"):
        assert f"Provides-Extra: {extra}" in meta
    assert "License-Expression: Apache-2.0" in meta


def test_python_dash_m_lordo_is_the_cli():
    import lordo

    done = subprocess.run([sys.executable, "-m", "lordo", "--version"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert lordo.__version__ in done.stdout + done.stderr


# torch APIs lordo calls that are younger than torch 2.0, with the first release that has them
YOUNGEST_TORCH_APIS = {
    "torch.nn.utils.get_total_norm": (2, 6),
    "torch.amp.GradScaler": (2, 3),
}


def test_the_torch_floor_covers_every_api_lordo_uses():
    import re

    import torch

    floor = re.search(r'"torch>=(\d+)\.(\d+)', (ROOT / "pyproject.toml").read_text())
    assert floor, "pyproject.toml must state a torch floor"
    assert (int(floor[1]), int(floor[2])) >= max(YOUNGEST_TORCH_APIS.values())
    sources = "\n".join(p.read_text() for p in (ROOT / "src" / "lordo").rglob("*.py"))
    for api in YOUNGEST_TORCH_APIS:
        module, _, name = api.rpartition(".")
        assert name in sources, f"{api} is no longer used: drop it from the table"
        obj = torch
        for part in module.split(".")[1:]:
            obj = getattr(obj, part)
        assert hasattr(obj, name), f"{api} is missing in this torch ({torch.__version__})"
