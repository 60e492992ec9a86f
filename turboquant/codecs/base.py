"""The codec interface shared by every quantizer in the package.

Every codec has ``encode(x) -> Code`` for x of shape (..., D) in float32, float16 or
bfloat16, ``decode(code) -> x̂`` in the input dtype, ``bits_per_coordinate`` (payload
plus side information, e.g. b + 16/D for an fp16 norm), ``nbytes_per_vector`` (what the
stored code really occupies, word padding included) and ``config()``: plain values from
which ``from_config`` rebuilds the codec bit for bit.
"""
from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass, field
from typing import ClassVar, Mapping

import mlx.core as mx

from ..checks import check_int

__all__ = ["Code", "Codec", "register", "from_config", "with_dim", "CODECS", "check_input", "split_norm",
           "FP16_MAX", "FP16_TINY", "check_norms", "check_spans", "check_int", "mse"]

FP16_MAX = 65504.0
FP16_TINY = 2.0 ** -17          # below it fp16 (subnormal) keeps less than 8 bits of a value; under 2^-25 it flushes to 0
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
CODECS: dict[str, type] = {}


@dataclass(frozen=True, eq=False)
class Code:
    """Encoded vectors. ``arrays`` maps field names to mx arrays whose leading dimensions
    are ``shape`` (the input's x.shape[:-1]); ``dtype`` is the input's dtype."""

    arrays: Mapping[str, mx.array]
    shape: tuple
    dtype: mx.Dtype = mx.float32
    codec: Mapping = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def __getitem__(self, name: str) -> mx.array:
        return self.arrays[name]


def register(cls):
    """Class decorator: make ``from_config`` know the codec by ``cls.name``."""
    CODECS[cls.name] = cls
    return cls


def from_config(config: Mapping) -> "Codec":
    """Rebuild a codec from ``codec.config()``."""
    if not isinstance(config, Mapping) or "codec" not in config:
        raise ValueError(f"a codec config is a mapping with a 'codec' key, got {config!r}")
    name = config["codec"]
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; known: {sorted(CODECS)}")
    kwargs = {k: v for k, v in config.items() if k != "codec"}
    params = list(inspect.signature(CODECS[name].__init__).parameters.values())[1:]    # past self
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [p.name for p in params if p.name in named and p.default is p.empty and p.name not in kwargs]
    unknown = [] if any(p.kind == p.VAR_KEYWORD for p in params) else sorted(set(kwargs) - named)
    if missing or unknown:
        raise ValueError(f"codec {name!r}: the config " + "; ".join(
            ([f"lacks {', '.join(map(repr, missing))}"] if missing else []) +
            ([f"has unknown field(s) {', '.join(map(repr, unknown))}"] if unknown else [])) +
            f" (its fields: {', '.join(sorted(named))}; the config's: {', '.join(map(str, config))})")
    return CODECS[name](**kwargs)


def with_dim(config: Mapping, dim: int) -> dict:
    """``config`` for head size ``dim``: a wrapper (a config with an ``"inner"`` codec, e.g.
    ``Centered``) passes the size to its inner codec; any other codec takes ``"dim"``."""
    if not isinstance(config, Mapping):
        raise ValueError(f"a codec config is a mapping with a 'codec' key, got {config!r}")
    if isinstance(config.get("inner"), Mapping):
        return {**config, "inner": with_dim(config["inner"], dim)}
    cls = CODECS.get(config.get("codec"))
    if cls is not None and "dim" not in inspect.signature(cls.__init__).parameters:
        return dict(config)                  # e.g. a wrapper without its inner codec: from_config says so
    return {**config, "dim": dim}


def check_input(x, dim: int, finite: bool = True) -> mx.array:
    """Validate a batch of vectors (..., D) and return it as float32; raise on bad input.

    ``finite=False`` skips the NaN/Inf scan for callers that go on to ``split_norm``,
    which detects both in the same device sync as its range check."""
    if not isinstance(x, mx.array):
        raise TypeError(f"expected an mx.array of shape (..., {dim}), got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"expected float32, float16 or bfloat16 input, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != dim:
        raise ValueError(f"expected last dimension D={dim}, got shape {tuple(x.shape)}")
    x = x.astype(mx.float32)
    if finite and x.size and not mx.all(mx.isfinite(x)).item():
        raise ValueError("input contains NaN or Inf")
    return x


def check_norms(norm: mx.array, floor: bool = True) -> None:
    """The range rule of every codec that stores a norm in fp16 (one home for it): NaN or
    Inf input (it makes a norm non-finite), norms above ``FP16_MAX`` and nonzero norms below
    ``FP16_TINY`` are refused — an fp16 norm there keeps less than 8 bits and flushes to zero
    below 3e-8, a relative error up to 1. All-zero vectors are exact (norm 0). Real keys and
    values lie far inside (norms 0.16 … 282 on the installed models). ``floor=False`` skips
    the lower bound, for norms whose error only counts in absolute terms (a residual's)."""
    if norm.size:
        # one sync for all three: NaN or Inf anywhere in x makes the sum non-finite
        total, largest, smallest = mx.stack([mx.sum(norm), mx.max(norm),
                                             mx.min(mx.where(norm > 0, norm, mx.inf))]).tolist()
        if math.isnan(total):
            raise ValueError("input contains NaN or Inf")
        if math.isinf(total):
            raise ValueError(f"input contains NaN or Inf, or a vector whose norm overflows: norms must be "
                             f"within fp16's range ({FP16_MAX}); scale the input down")
        if largest > FP16_MAX:
            raise ValueError(f"a vector norm of {largest:.4g} exceeds fp16's range "
                             f"({FP16_MAX}); scale the input down")
        if floor and smallest < FP16_TINY:
            raise ValueError(f"a vector norm of {smallest:.3g} is below fp16's normal range ({FP16_TINY:.3g}): "
                             "its stored norm would lose precision or flush to zero; scale the input up "
                             "(all-zero vectors are fine)")


def check_spans(span: mx.array, levels: int) -> None:
    """The same rule for codes that store an fp16 scale span/(levels − 1) per group
    (``AffineCodec``): (levels − 1)·scale must stay within fp16 (span ≤ FP16_MAX·(1 − 2⁻¹⁰),
    allowing for the scale's rounding), and a nonzero scale must reach ``FP16_TINY``."""
    if span.size:
        largest, smallest = mx.stack([mx.max(span), mx.min(mx.where(span > 0, span, mx.inf))]).tolist()
        if largest > FP16_MAX * (1 - 2 ** -10):
            raise ValueError(f"a group spans {largest:.4g}, beyond what fp16 scales represent "
                             f"({FP16_MAX * (1 - 2 ** -10):.6g}); scale the input down")
        if smallest / (levels - 1) < FP16_TINY:
            raise ValueError(f"a group spans only {smallest:.3g}: its fp16 scale would lose precision or flush "
                             f"to zero (below {FP16_TINY * (levels - 1):.3g}); scale the input up "
                             "(constant groups are fine)")


def split_norm(x: mx.array, floor: bool = True) -> tuple[mx.array, mx.array]:
    """x (..., D) float32 → (norm (..., 1) float32, unit direction (..., D)); zero stays zero.

    The norm is stored in fp16: ``check_norms`` (``floor`` as there).
    """
    norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
    check_norms(norm, floor)
    return norm, x / mx.where(norm > 0, norm, 1.0)


def mse(codec: "Codec", x: mx.array) -> float:
    """E‖x − x̂‖² over the rows of x (..., D): the measured distortion of ``codec``."""
    return mx.mean(mx.sum((x - codec.decode(codec.encode(x))) ** 2, axis=-1)).item()


class Codec:
    """Base class; see the module docstring for the contract.

    Subclasses implement ``_encode``/``_decode`` for non-empty input; the public
    ``encode``/``decode`` here add what every codec shares: empty batches (0 vectors) give
    empty results of the right shapes, and a code is checked against its codec and its own
    ``shape`` before it is decoded."""

    name: ClassVar[str] = "codec"
    dim: int

    def encode(self, x: mx.array) -> Code:
        """x (..., D) float32, float16 or bfloat16 → a ``Code`` whose fields have leading
        dimensions x.shape[:-1]. NaN/Inf input, norms beyond fp16's range and wrong shapes
        raise ``ValueError``; wrong types ``TypeError``."""
        if isinstance(x, mx.array) and x.ndim >= 1 and x.shape[-1] == self.dim and x.size == 0 \
                and x.dtype in _FLOATS:
            return self._empty_code(x)
        return self._encode(x)

    def decode(self, code: Code) -> mx.array:
        """A ``Code`` made by this codec → x̂ ``(*code.shape, D)`` in the encoded input's dtype."""
        code = self._check_code(code)
        if math.prod(code.shape) == 0:
            return mx.zeros((*code.shape, self.dim), code.dtype)
        if code.dtype == mx.float16:
            # the input was finite in fp16, so each true coordinate lies within ±FP16_MAX:
            # saturating there only shrinks the error, where a cast could give Inf
            x = self._decode(Code(code.arrays, code.shape, mx.float32, code.codec))
            return mx.clip(x, -FP16_MAX, FP16_MAX).astype(mx.float16)
        return self._decode(code)

    @classmethod
    def example(cls, dim: int) -> "Codec":
        """One instance at head size ``dim`` for the codec contract tests (every registered
        codec defines its own: the tests are built from the registry)."""
        raise NotImplementedError(f"{cls.__name__} defines no example(dim): a registered codec needs one "
                                  "for the contract tests")

    def validate_code(self, fields: dict) -> None:
        """Raise ``ValueError`` when code fields of the right shapes and dtypes (e.g. read from
        a file) still hold values this codec never writes and could not decode safely. The
        default: every value is decodable. (The file loader checks shapes and dtypes, then
        asks the codec: it knows no codec's internals.)"""

    def _encode(self, x: mx.array) -> Code:  # pragma: no cover - interface
        raise NotImplementedError

    def _decode(self, code: Code) -> mx.array:  # pragma: no cover - interface
        raise NotImplementedError

    def _empty_code(self, x: mx.array) -> Code:
        """The code of 0 vectors: the fields of a one-vector stand-in, cut to 0 rows."""
        lead = tuple(x.shape[:-1])
        stand_in = self._encode(mx.zeros(tuple(max(1, s) for s in x.shape), mx.float32))
        cut = tuple(slice(0, s) for s in lead)
        return Code({n: a[cut] for n, a in stand_in.arrays.items()}, lead, x.dtype, self.config())

    @property
    def payload_bits(self) -> float:  # pragma: no cover - interface
        """Stored bits per coordinate of the code itself (indices, signs, values), without
        side information."""
        raise NotImplementedError

    @property
    def bits_per_coordinate(self) -> float:  # pragma: no cover - interface
        """``payload_bits`` plus per-vector side information (fp16 norms, scales, radii)
        spread over the D coordinates. Per-layer constants (a ``Centered`` mean) are not
        counted here."""
        raise NotImplementedError

    @property
    def nbytes_per_vector(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def config(self) -> dict:  # pragma: no cover - interface
        raise NotImplementedError

    def code_nbytes(self, n_vectors: int) -> int:
        """Bytes that codes for ``n_vectors`` vectors occupy."""
        return n_vectors * self.nbytes_per_vector

    def fit_once(self, x: mx.array) -> "Codec":
        """Fit on x if this codec learns from data (``fit``) and has not yet; returns self.
        (Caches fit on their first ``fit_tokens`` tokens instead: ``TurboQuantKVCache``.)"""
        if hasattr(self, "fit") and not getattr(self, "fitted", True):
            self.fit(x)
        return self

    def attention_view(self, code: Code):
        """(codec whose codes attention reads, its code, μ or None): a codec that stores
        x − μ (``Centered``) returns its inner codec and μ, so attention adds μ back exactly."""
        return self, code, None

    def roundtrip(self, x: mx.array) -> mx.array:
        return self.decode(self.encode(x))

    def _check_code(self, code) -> Code:
        if not isinstance(code, Code):
            raise TypeError(f"expected a Code, got {type(code).__name__}")
        if dict(code.codec) != self.config():
            raise ValueError(f"this code was made by {dict(code.codec)}, not by {self.config()}")
        shape = tuple(code.shape)
        if code.dtype not in _FLOATS:
            raise ValueError(f"a code's dtype must be float32, float16 or bfloat16, got {code.dtype}")
        for name, a in code.arrays.items():
            if not isinstance(a, mx.array) or a.ndim != len(shape) + 1 or tuple(a.shape[:-1]) != shape:
                raise ValueError(f"code field {name!r} has shape {tuple(getattr(a, 'shape', ()))}, but "
                                 f"the code's shape is {shape}: expected {shape} + (width,)")
        return code

    def _registered(self) -> bool:
        return CODECS.get(self.name) is type(self)

    def __reduce_ex__(self, protocol):
        """Pickle and copy through the configuration, which rebuilds the codec bit for bit
        (a codec class not registered with ``register`` is copied the default way)."""
        if self._registered():
            return from_config, (self.config(),)
        return super().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        import copy
        return from_config(self.config()) if self._registered() else copy.copy(self)

    def __eq__(self, other):
        return isinstance(other, Codec) and self.config() == other.config()

    def __hash__(self):
        return hash(json.dumps(self.config(), sort_keys=True))

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "codec")
        return f"{type(self).__name__}({args})"
