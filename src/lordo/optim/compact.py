"""Optimizer state held compact between steps: 8-bit (or 4-bit) codes with one float32 scale per block of elements.

A state entry ``key`` of a parameter (``exp_avg``, ``error_feedback``, ...) that is held compact is two tensors in
its state dict: ``key + CODES`` (uint8, the flattened tensor's codes; two 4-bit codes per byte) and ``key + SCALE``
(float32, the largest magnitude of each block). Everything that computes with the entry expands it to float32
first (:func:`expanded`, one parameter at a time: the float32 copy is a transient, never the whole optimizer's
state at once) and stores it back when done, so the step's arithmetic is the float32 arithmetic; only the
storage between steps is rounded. The state stays tensors only (``weights_only`` checkpoints), and a checkpoint
stores the codes as they are.

Formats (:class:`Format`), each a code book of values in [−1, 1] (or [0, 1]) that a block's elements, divided by
the block's scale, are rounded to:

- ``int8`` (signed, blocks of 256): a dynamic map, as 8-bit Adam's: a sign, a decade (10⁻⁶ … 1) and a fraction
  with more steps in the larger decades (64 between 0.1 and 1 of the block's largest magnitude), so small entries
  keep their relative precision; for first moments and error feedback.
- ``uint8`` (non-negative, blocks of 256): the same map without a sign and twice the steps, applied to the square
  root of the entry (second moments: the root halves their dynamic range) and rounded stochastically: a second
  moment moves by 0.1 % a step (β2 = 0.999), less than one step of any 8-bit map, which rounding to the nearest
  code would freeze; stochastic rounding keeps the expected value (its randomness is seeded by the step and
  the entry, so a resumed run is bit-identical).
- ``int4`` (signed, blocks of 64): 15 evenly spaced values, two codes per byte; for error feedback.
- ``lin8`` (signed, blocks of 256): 255 evenly spaced values; for weights (the anchor), whose error matters in
  absolute terms (it enters the pseudo-gradient), where even steps are finer than the dynamic map's at the sizes
  most weights have.
- ``fp8`` (signed, blocks of 256): the 8-bit floating-point format e4m3 (``torch.float8_e4m3fn``: 3 mantissa bits,
  values to ±448), each block scaled so that its largest magnitude is 448 and rounded to the nearest value by
  torch's own conversion, with no table and no search: an encoding several times cheaper than the dynamic map's
  on a CPU, at about twice its error (relative steps of 2⁻³ where the map's top decade has 64 steps; normal values
  over about 4.5 decades below the block's largest magnitude, the map's over 6). Its codes are stored as
  ``torch.float8_e4m3fn`` tensors, which tells a saved state's format apart from ``int8``'s; for error feedback and
  first moments.
- ``ufp8`` (non-negative, blocks of 256): ``fp8`` on the square root of the entry, rounded stochastically by
  arithmetic (optim/float8.py); for second moments. With ``fp8`` first moments it is ``moments_dtype = "fp8"``.

The two e4m3 formats encode and decode through ``torch.compile`` after :func:`float8.use_compiled` (the same codes).

Tensors below :data:`MIN_COMPACT_NUMEL` elements stay float32 (norm weights, biases: nothing to gain).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import float8

CODES, SCALE = ".codes", ".scale"
MIN_COMPACT_NUMEL = 4096
CODEC_CHUNK = 1 << 18  # elements encoded (rounded to the nearest code) or looked up at once: a multiple of every block
FORMATS = ("int8", "uint8", "int4", "lin8", "fp8", "ufp8")


@dataclass(frozen=True)
class Format:
    name: str
    bits: int
    block: int
    signed: bool
    stochastic: bool = False
    root: bool = False  # store sqrt(x) (x >= 0)
    float8: bool = False  # codes are e4m3 values (torch.float8_e4m3fn) of the block's elements / scale


INT8 = Format("int8", 8, 256, signed=True)
UINT8 = Format("uint8", 8, 256, signed=False, stochastic=True, root=True)
INT4 = Format("int4", 4, 64, signed=True)
LIN8 = Format("lin8", 8, 256, signed=True)
FP8 = Format("fp8", 8, 256, signed=True, float8=True)
UFP8 = Format("ufp8", 8, 256, signed=False, stochastic=True, root=True, float8=True)
BY_NAME = {f.name: f for f in (INT8, UINT8, INT4, LIN8, FP8, UFP8)}


@functools.cache
def _dynamic_magnitudes(steps_per_decade: tuple[int, ...]) -> list[float]:
    """Magnitudes in (0, 1]: for decade k (10^(k−n+1) … 10^(k−n+2), n decades) ``steps_per_decade[k]`` values, the
    midpoints of that many equal steps between 0.1 and 1 of the decade's top; then 1 itself."""
    out = []
    n = len(steps_per_decade)
    for k, steps in enumerate(steps_per_decade):
        top = 10.0 ** (k - n + 1)
        edges = [0.1 + 0.9 * i / steps for i in range(steps + 1)]
        out += [top * (a + b) / 2 for a, b in zip(edges, edges[1:])]
    return out + [1.0]


@functools.cache
def code_book(fmt: Format, device: torch.device) -> torch.Tensor:
    """The values of ``fmt``'s codes (2**bits of them, float32 on ``device``): sorted, or for ``fp8`` in the order of
    the codes' bit patterns (its two NaN patterns, never written, read as 0)."""
    if fmt.float8:
        patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
        return patterns.to(torch.float32).nan_to_num_(0.0).to(device)
    if fmt.bits == 4:
        values = [i / 7 for i in range(-7, 8)] + [0.0]  # 15 levels; the 16th code is a second zero
    elif fmt.name == "lin8":
        values = [i / 127 for i in range(-127, 128)] + [0.0]
    elif fmt.signed:
        mags = _dynamic_magnitudes((1, 2, 4, 8, 16, 32, 63))  # 126 + 1 magnitudes
        values = sorted([-m for m in mags] + [0.0] + mags) + [0.0]  # 255 values, one spare zero
    else:
        values = [0.0] + _dynamic_magnitudes((2, 4, 8, 16, 32, 64, 128))  # 254 + 1 + zero
        values += [1.0] * (256 - len(values))
    book = sorted(values)[: 2 ** fmt.bits]
    assert len(book) == 2 ** fmt.bits
    return torch.tensor(book, dtype=torch.float32, device=device)


def nbytes(fmt: Format, numel: int) -> int:
    """Bytes of ``numel`` elements held in ``fmt`` (codes and scales)."""
    blocks = math.ceil(numel / fmt.block)
    return math.ceil(numel * fmt.bits / 8) + 4 * blocks


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def _as_float32(bits: torch.Tensor) -> torch.Tensor:
    """The float32 values whose bit patterns are ``bits`` (int64 holding unsigned 32-bit patterns)."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


@functools.cache
def _rank_tables(fmt: Format, stochastic: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables that give ``count(points < y)`` for float32 ``y`` without a search (``points``: the code book for
    stochastic rounding, the midpoints between its values for rounding to the nearest). A float32's top 16 bits
    (sign, exponent, 7 mantissa bits) name a bucket of values 2⁻⁷ of their size wide, narrower than any gap
    between the points where they lie in [−1, 1]; so within a bucket the count is the count below the bucket's
    smallest value plus one if ``y`` passes the next point. ``below[key]`` is the first, ``nxt[key]`` that point."""
    book = code_book(fmt, torch.device("cpu"))
    points = book if stochastic else (book[1:] + book[:-1]) / 2
    keys = torch.arange(2**16, dtype=torch.int64)
    negative = keys >= 2**15  # larger mantissa bits are further from zero: the bucket's least value is its last
    least = _as_float32(torch.where(negative, (keys << 16) | 0xFFFF, keys << 16))
    most = _as_float32(torch.where(negative, keys << 16, (keys << 16) | 0xFFFF))
    below = torch.searchsorted(points, least)
    finite = torch.isfinite(least) & torch.isfinite(most)
    assert int((torch.searchsorted(points, most) - below)[finite].max()) <= 1, f"{fmt.name}: points too close"
    nxt = torch.cat([points, points.new_tensor([math.inf])])[below]
    # uint8 counts: a value in [-1, 1] has at most 255 points below it; buckets beyond 1 (never met) are clamped
    return below.clamp(max=255).to(torch.uint8).to(device), nxt.to(device)


@functools.cache
def _book_below(fmt: Format, device: torch.device) -> torch.Tensor:
    """The code book shifted by one: ``_book_below(fmt)[i] == code_book(fmt)[i - 1]`` (i >= 1)."""
    book = code_book(fmt, device)
    return torch.cat([book[:1], book[:-1]])


def _count_below(y: torch.Tensor, fmt: Format, stochastic: bool) -> torch.Tensor:
    """``torch.searchsorted(points, y)`` (uint8) of :func:`_rank_tables`' points, by two table lookups. The counts
    are uint8 and the comparison's bools are read as bytes: a quarter of int32's memory traffic and no type
    promotion (encoding is memory-bound)."""
    below, nxt = _rank_tables(fmt, stochastic, y.device)
    flat = y.reshape(-1)
    key = flat.view(torch.int32) >> 16
    key.bitwise_and_(0xFFFF)
    passed = (nxt.index_select(0, key) < flat).view(torch.uint8)
    return below.index_select(0, key).add_(passed).view(y.shape)


@torch.no_grad()
def encode(x: torch.Tensor, fmt: Format, seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, scales float32) of ``x``; ``seed`` makes stochastic rounding reproducible (formats that round
    stochastically need it). A large tensor is encoded :data:`CODEC_CHUNK` elements at a time (blocks are encoded
    alone: the same codes), so its temporaries stay that size; except where the formats that round stochastically
    by table draw their noise at once, and where the e4m3 formats are compiled (one loop, no temporaries)."""
    x = x.float()
    if fmt.float8 and fmt.stochastic and seed is None:
        raise ValueError(f"format {fmt.name} rounds stochastically: give a seed")
    if fmt.float8 and (float8.compiled() or x.numel() <= CODEC_CHUNK):  # arithmetic: compiled, one loop
        return float8.encode(x, seed or 0, fmt.root, fmt.stochastic)
    if not fmt.float8 and (fmt.stochastic or x.numel() <= CODEC_CHUNK):
        return _encode(x, fmt, seed)
    flat = x.reshape(-1)
    def part(y: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        if fmt.float8:  # its stochastic draws by element index: the same codes as whole
            return float8.encode(y, seed or 0, fmt.root, fmt.stochastic, offset=offset)
        return _encode(y, fmt, seed)

    parts = [part(flat[i:i + CODEC_CHUNK], i) for i in range(0, flat.numel(), CODEC_CHUNK)]
    return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])


def _encode(x: torch.Tensor, fmt: Format, seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt.root:
        x = x.clamp(min=0).sqrt_()  # in place on clamp's copy
    rows = _blocks(x, fmt.block)
    # each pass over the tensor is memory-bound: the largest magnitude without an abs() copy, the temporaries
    # updated in place (amax and amin apart: torch.aminmax over a dimension is an order of magnitude slower on a CPU)
    most, least = rows.amax(dim=1), rows.amin(dim=1)
    scale = torch.maximum(most, least.neg()).abs_()  # abs_: +0 for an all-zero block
    divisor = scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
    if fmt.stochastic:
        if seed is None:
            raise ValueError(f"format {fmt.name} rounds stochastically: give a seed")
        gen = torch.Generator(device=x.device).manual_seed(seed)
        noise = torch.rand(rows.shape, generator=gen, device=x.device)  # the tensor's draws, as one
        codes = torch.empty(rows.shape, dtype=torch.uint8, device=x.device)
        step = CODEC_CHUNK // fmt.block  # the rest a chunk of blocks at a time (the same codes)
        for i in range(0, rows.shape[0], step):
            codes[i:i + step] = _round_stochastically(rows[i:i + step] / divisor[i:i + step], noise[i:i + step], fmt)
    else:
        codes = _count_below(rows / divisor, fmt, stochastic=False)
    codes = codes.reshape(-1)
    if fmt.bits == 4:
        codes = codes[0::2] | (codes[1::2] << 4)
    return codes, scale


def _round_stochastically(y: torch.Tensor, noise: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Codes of ``y`` (in the book's range) rounded up with probability its distance from the code below over the
    gap, ``noise`` uniform in [0, 1)."""
    book = code_book(fmt, y.device)
    upper = _count_below(y, fmt, stochastic=True).clamp_(1, book.numel() - 1).reshape(-1)
    index = upper.to(torch.int32)
    lo = _book_below(fmt, y.device).index_select(0, index).view_as(y)  # book[index - 1]
    gap = book.index_select(0, index).view_as(y).sub_(lo)
    take_hi = gap.mul_(noise) < y.sub_(lo)
    return upper.view_as(y).sub_((~take_hi).view(torch.uint8))


@torch.no_grad()
def decode(codes: torch.Tensor, scale: torch.Tensor, fmt: Format, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor of ``shape`` that :func:`encode` gave ``codes`` and ``scale`` for."""
    if fmt.float8 and float8.compiled():
        return float8.decode(codes, scale, math.prod(shape), fmt.root).view(shape)
    if fmt.bits == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=1).reshape(-1)
    if codes.dtype == torch.float8_e4m3fn:  # by bit pattern: torch's own fp8 conversion is slower than a lookup
        codes = codes.view(torch.uint8)
    book, codes = code_book(fmt, codes.device), codes.reshape(-1)
    values = torch.empty(codes.numel(), device=codes.device)
    for i in range(0, codes.numel(), CODEC_CHUNK):  # the int32 indices a chunk at a time
        torch.index_select(book, 0, codes[i:i + CODEC_CHUNK].to(torch.int32), out=values[i:i + CODEC_CHUNK])
    rows = values.view(-1, fmt.block).mul_(scale[:, None])
    x = rows.reshape(-1)[: math.prod(shape)].view(shape)
    return x.square_() if fmt.root else x


def make_tables(device: torch.device) -> None:
    """Build every format's cached tables on ``device`` now (each is made once per process at its first use, about
    1.3 MB in all): what a measurement of one optimizer should not count as its own."""
    for fmt in BY_NAME.values():
        decode(*encode(torch.ones(fmt.block, device=device), fmt, seed=0), fmt, (fmt.block,))


def is_compact(state: dict, key: str) -> bool:
    return key + CODES in state


def store(state: dict, key: str, x: torch.Tensor, fmt: Format, seed: int | None = None) -> None:
    """Hold ``x`` as ``state[key]``'s compact form (the float32 entry removed)."""
    state.pop(key, None)
    state[key + CODES], state[key + SCALE] = encode(x, fmt, seed)


def load(state: dict, key: str, fmt: Format, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """``state[key]`` as a float32 tensor of ``shape`` (a new one if it is compact)."""
    if not is_compact(state, key):
        return state[key]
    return decode(state[key + CODES], state[key + SCALE], fmt, shape)


@contextlib.contextmanager
def expanded(state: dict, entries: dict[str, Format], shape_of: dict[str, tuple[int, ...]],
             seed: int | None = None) -> Iterator[None]:
    """Inside the block, each compact entry ``key`` of ``entries`` is a float32 ``state[key]``; after it, held
    compact again (what the block computed, rounded to the format)."""
    opened = [key for key in entries if is_compact(state, key)]
    for key in opened:
        state[key] = decode(state.pop(key + CODES), state.pop(key + SCALE), entries[key], shape_of[key])
    try:
        yield
    finally:
        for key in opened:
            if key in state:
                store(state, key, state[key], entries[key], seed)


def worth_compacting(numel: int) -> bool:
    return numel >= MIN_COMPACT_NUMEL


def load_range(state: dict, key: str, fmt: Format, start: int, stop: int) -> torch.Tensor:
    """Elements ``start:stop`` of the flattened compact entry ``key`` (``start`` a multiple of the block)."""
    per_byte = 8 // fmt.bits
    blocks = slice(start // fmt.block, math.ceil(stop / fmt.block))
    codes = state[key + CODES][start // per_byte: blocks.stop * fmt.block // per_byte]
    return decode(codes, state[key + SCALE][blocks], fmt, (stop - start,))


def store_range(state: dict, key: str, x: torch.Tensor, fmt: Format, start: int, seed: int | None = None) -> None:
    """Write ``x`` (1-D) as elements ``start:`` of the flattened compact entry ``key``, in place."""
    codes, scale = encode(x, fmt, seed)
    per_byte = 8 // fmt.bits
    state[key + CODES][start // per_byte: start // per_byte + codes.numel()] = codes
    state[key + SCALE][start // fmt.block: start // fmt.block + scale.numel()] = scale
