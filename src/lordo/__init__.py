"""lordo: LoRDO, distributed low-rank optimization with infrequent communication, for PyTorch.

The public surface (stable within a minor version) is what ``__all__`` lists:

- :func:`distributed` / :class:`DistributedOptimizer`: LoRDO or a baseline strategy in your training loop;
  :func:`worker_mesh`: the ranks of this process's worker, to shard the model over them with FSDP2;
- :class:`LowRankQHAdam`: the single-worker low-rank QH-Adam optimizer (``torch.optim.Optimizer``), and
  :func:`param_groups`, its parameter groups built from a model (GaLore's / Hugging Face's target modules);
- :class:`Config`, :func:`build_config`: the configuration behind ``lordo train`` (the trainer itself is
  ``lordo.train.loop.train``); :func:`load_trained`: a run's trained model (and its tokenizer) in Python;
- :data:`STRATEGY_NAMES`; the errors :class:`LordoError`, :class:`ConfigError`, :class:`DataError`,
  :class:`NonFiniteError`, :class:`CommError`.
"""

from .api import DistributedOptimizer, distributed, worker_mesh
from .comm.torch_dist import CommError
from .config import STRATEGY_NAMES, Config, build_config
from .errors import ConfigError, DataError, LordoError, NonFiniteError
from .model.export import load_trained
from .model.params import param_groups
from .optim import LowRankQHAdam

__version__ = "0.1.0"


__all__ = [
    "CommError",
    "Config",
    "ConfigError",
    "DataError",
    "DistributedOptimizer",
    "LordoError",
    "LowRankQHAdam",
    "NonFiniteError",
    "STRATEGY_NAMES",
    "__version__",
    "build_config",
    "distributed",
    "load_trained",
    "param_groups",
    "worker_mesh",
]
