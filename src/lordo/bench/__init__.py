"""Benchmarks: ``lordo bench step|basis|wire|memory|runs|link``. Not part of the test suite.

Every benchmark measures the things it compares side by side in one process, interleaved round by round
(this matters on a shared, noisy machine), prints a table of medians, spreads and ratios, and writes the
numbers to a JSON file. Peers (``galore-torch``, ``pytorch-optimizer``) are optional: install
``lordo[bench]``; a missing peer is reported and skipped.
"""

from .cli import main, make_parser

__all__ = ["main", "make_parser"]
