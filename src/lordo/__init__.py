"""lordo: LoRDO, distributed low-rank optimization with infrequent communication, for PyTorch."""

__version__ = "0.1.0.dev0"
