import inspect
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("LORDO_TEST_DATA_DIR", ROOT / "data"))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real corpus, fetched by the set-up step (`make data`) and prepared once for the whole session."""
    from lordo.data import prepare

    prepare.ensure(DATA_DIR, 4096, 0.05, log=lambda _: None)
    return DATA_DIR


@pytest.fixture(scope="session")
def dataset(data_dir):
    from lordo.data import prepare

    return prepare.load(prepare.prepared_dir(data_dir, 4096, 0.05))


# Tests that start processes (gloo groups, torchrun, `lordo train` and other CLI runs, throttled links) are the
# slow tier: `pytest -m "not slow"` runs the rest in a fraction of the time; CI and `make test` run both.
MULTI_PROCESS = ("run_gloo(", "assert_simulator_equals_gloo(", "subprocess.", "Popen(", "launch_local(", "torchrun",
                 "run_cli(", "ThrottledLink(")


def pytest_collection_modifyitems(config, items):
    for item in items:
        function = getattr(item, "function", None)
        try:
            source = inspect.getsource(function) if function is not None else ""
        except (OSError, TypeError):
            source = ""
        if any(marker in source for marker in MULTI_PROCESS):
            item.add_marker(pytest.mark.slow)
