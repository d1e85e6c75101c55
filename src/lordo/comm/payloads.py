"""Which codec each payload of a synchronisation travels in, for every ``strategy.compress``: the dense ones
(comm/codec.py), chunk-wise top-k (comm/sparse.py) and coefficients in the shared basis (comm/basis_codec.py)."""

from __future__ import annotations

from .basis_codec import BasisCodec, SparseSettings
from .codec import ALL_COMPRESSIONS, COMPRESSIONS, AnyCodec, dense_codecs
from .sparse import SparseCodec


def sync_codecs(compress: str, settings: SparseSettings | None = None) -> dict[str, AnyCodec]:
    """The codec of each payload: ``pseudo_gradient``, ``exp_avg``, ``exp_avg_sq``; under sparse and basis the
    moments (and what travels dense) as ``settings.dense`` says."""
    if compress in COMPRESSIONS:
        return dense_codecs(compress)
    if compress not in ALL_COMPRESSIONS:
        raise ValueError(f"compress must be one of {', '.join(ALL_COMPRESSIONS)}, got {compress!r}")
    settings = settings or SparseSettings()
    codecs = dense_codecs(settings.dense)
    codecs["pseudo_gradient"] = (SparseCodec(settings.density, settings.bits) if compress == "sparse"
                                 else BasisCodec(settings))
    return codecs
