"""The 8-bit floating-point block formats of the compact state (optim/compact.py): e4m3 codes
(``torch.float8_e4m3fn``) with one float32 scale per block of 256, by arithmetic alone (no table, no search).

- ``fp8``: each block divided by its largest magnitude / 448 and converted to e4m3 by torch's own conversion
  (round to nearest even): first moments and error feedback.
- ``ufp8``: the same on the square root of a non-negative entry (second moments: the root halves their dynamic
  range), rounded *stochastically* to one of its two e4m3 neighbours: √v moves by 0.05 % a step (β2 = 0.999), far
  below e4m3's relative step (2⁻³), which rounding to the nearest would freeze. The rounding is
  ``floor(y / s + u) · s``, s the e4m3 spacing at y (2^(e − 3) in binade [2^e, 2^(e+1)), subnormals' 2⁻⁹ below
  2⁻⁶), u in [0, 1) on a 2⁻²⁰ grid: a Weyl sequence over the element index offset by a hash of the seed
  (:func:`_draws`), so each element's draws over the steps are uniform. Reproducible from the seed alone (a
  resumed run rounds as the uninterrupted one), and the same whether or not the codec is compiled: integer
  arithmetic that never overflows, float32 operations exact but for the one addition y / s + u, and the square
  root correctly rounded both ways (tests/test_float8.py checks the codes bit for bit).

Each is a handful of elementwise passes that ``torch.compile`` fuses into one loop over a block
(:func:`use_compiled`, process-wide, off by default: compiling takes tens of seconds once per process, less from
its on-disk cache); compiled or not, the codes are the same (tests/test_float8.py).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

BLOCK = 256
FP8_MAX = 448.0  # e4m3fn's largest finite value
TINY = torch.finfo(torch.float32).tiny
M31 = (1 << 31) - 1
HASH = (0x5BD1E995, 0x27D4EB2F, 0x165667B1)  # odd 31-bit multipliers (the seed's hash, in Python)
WEYL = 1327217885  # round(2^31·(golden ratio − 1)), odd: index·WEYL stays below 2^62
NOISE_BITS = 20


def _blocks(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = (-flat.numel()) % BLOCK
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, BLOCK)


def uniform(n: int, seed: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """n float32 draws in [0, 1) on a 2⁻²⁰ grid for elements ``offset`` … ``offset + n − 1`` under ``seed``."""
    return _draws(n, *_keys(seed, offset, device))


@functools.cache
def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(448, offset 0, key 0) as tensors on ``device``: what a rounding to the nearest passes."""
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return torch.tensor(FP8_MAX, device=device), zero, zero


def _keys(seed: int, offset: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(offset, the seed's hash) as 0-d int64 tensors: passed to the compiled code as Python ints, they made
    Inductor's CPU code generator (torch 2.13) emit the integer arithmetic on them as float32 vector code that does
    not compile."""
    h = int(seed) & M31
    for c in HASH:
        h = ((h * c) ^ ((h * c) >> 31)) & M31
    return (torch.tensor(int(offset), dtype=torch.int64, device=device),
            torch.tensor(h, dtype=torch.int64, device=device))


def _draws(n: int, offset: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """u_i = frac((i·a + key) / 2³¹) for i = offset … offset + n − 1, a = 2³¹·(golden ratio − 1) (a Weyl sequence,
    one multiplication per element): over the steps (a new key each) each element's draws are uniform, which is
    all that unbiased rounding needs; within a step neighbouring draws are evenly spread, not independent."""
    index = (torch.arange(n, device=key.device) + offset) & M31
    return (((index * WEYL + key) & M31) >> (31 - NOISE_BITS)).to(torch.float32) * 2.0 ** -NOISE_BITS


def _spacing(y: torch.Tensor) -> torch.Tensor:
    """The e4m3 spacing at each y >= 0 (2^(e − 3) in binade [2^e, 2^(e+1)), the subnormals' 2⁻⁹ below 2⁻⁶), by
    comparisons (compiled, one vector select each)."""
    spacing = torch.full_like(y, 2.0 ** -9)
    for e in range(-6, 9):
        spacing = torch.where(y >= 2.0 ** e, 2.0 ** (e - 3), spacing)
    return spacing


def _root(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root: the CPU's vector instruction where compiled, through float64 in
    eager mode (ATen's float32 sqrt rounds otherwise in about one element in five)."""
    if torch.compiler.is_compiling():
        return x.clamp(min=0).sqrt()
    return x.double().clamp(min=0).sqrt().float()


def _encode(x: torch.Tensor, offset: torch.Tensor, key: torch.Tensor, limit: torch.Tensor, root: bool,
            stochastic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    if root:
        x = _root(x)
    rows = _blocks(x)
    scale = rows.abs().amax(dim=1) / limit  # limit = 448 as a tensor: Inductor turns a division by a number into a
    # product with its reciprocal, rounded otherwise
    y = rows / scale.clamp(min=TINY)[:, None]
    if stochastic:  # y >= 0 here: floor(y / s + u)·s, exact but for the sum
        spacing = _spacing(y)
        y = torch.floor(y / spacing + _draws(y.numel(), offset, key).view_as(y)) * spacing
    codes = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # the clamp: a quotient a rounding above 448
    return codes.reshape(-1), scale


def _decode(codes: torch.Tensor, scale: torch.Tensor, numel: int, root: bool) -> torch.Tensor:
    x = (codes.view(-1, BLOCK).to(torch.float32) * scale[:, None]).reshape(-1)[:numel]
    return x * x if root else x


_compiled = {"on": False}


def compiled() -> bool:
    """Whether :func:`use_compiled` is on."""
    return _compiled["on"]


def use_compiled(on: bool = True) -> None:
    """Encode and decode through ``torch.compile`` (this process; on the CPU it needs a C++ compiler): the same
    codes, several times faster. A compile that fails warns once and leaves the eager functions in place."""
    _compiled["on"] = bool(on)


@functools.cache
def _kernel(name: str) -> Callable:
    eager: Callable[..., Any] = _encode if name == "encode" else _decode
    compiled = torch.compile(eager, dynamic=True)

    def run(*args):
        if name in _failed:
            return eager(*args)
        try:
            return compiled(*args)
        except Exception as exc:  # no C++ compiler, an unsupported device: the eager codec, the same codes
            _failed.append(name)
            warnings.warn(f"the fp8 codec could not be compiled ({type(exc).__name__}: {str(exc)[:200]}); it runs "
                          "eagerly (the same codes, slower)", RuntimeWarning, stacklevel=3)
            return eager(*args)

    return run


_failed: list[str] = []


def encode(x: torch.Tensor, seed: int = 0, root: bool = False, stochastic: bool = False,
           offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, float32 scales) of ``x`` (of its square root if ``root``), rounded to the nearest code or
    ``stochastic``-ally with draws from ``seed``; ``offset``: the index of ``x``'s first element in the tensor it
    is a part of (a multiple of the block), so that a tensor encoded in parts draws what it draws whole."""
    limit, start, key = _constants(x.device)
    if stochastic:
        start, key = _keys(seed, offset, x.device)
    # flat: one compiled graph per format (and whether the tail is padded), whatever the tensor's rank
    return (_kernel("encode") if _compiled["on"] else _encode)(x.reshape(-1), start, key, limit, root, stochastic)


def decode(codes: torch.Tensor, scale: torch.Tensor, numel: int, root: bool = False) -> torch.Tensor:
    """The flat float32 tensor of ``numel`` elements that :func:`encode` gave ``codes`` and ``scale`` for."""
    fn = _kernel("decode") if _compiled["on"] else _decode
    return fn(codes.view(torch.float8_e4m3fn), scale, numel, root)
