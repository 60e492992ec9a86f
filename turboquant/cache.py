"""KV caches that store codes and drop into ``mlx_lm.generate`` (Chapter 7).

``TurboQuantKVCache`` follows mlx-lm's cache protocol (``offset``, ``update_and_fetch``,
``state``/``meta_state``, ``from_state``, ``is_trimmable``/``trim``, ``make_mask``, ``empty``,
``nbytes``, ``size``; ``keys``/``values`` are read-only decoded views, as mlx-lm code reads
them). It stores only codes (``key_codes``/``value_codes``) — per-token fields of shape (B, H_kv, T, w) —
grown in steps of 256 tokens, plus optional full-precision copies of the most recent R
tokens and of the first S tokens (attention sinks: Chapter 9 shows why they matter once
keys are centered). ``update_and_fetch`` returns dequantized K and V, so any model's usual attention
works unchanged; under ``turboquant.attention.codes_attention`` it returns ``CodesView``
objects instead and attention is computed from the codes.

``TurboQuantRotatingKVCache`` has the semantics of mlx-lm's ``RotatingKVCache`` (``max_size``,
``keep``; multi-token updates concatenate in temporal order, single tokens overwrite a ring)
on codes, so sliding-window layers see exactly the attention pattern they would see
uncompressed. No class here has an attribute named ``bits``: mlx-lm would route such a cache
to its affine quantized attention.
"""
from __future__ import annotations

import json
import warnings
from typing import Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from .cache_base import CacheBase, codes_mode, protocol_mask, returning_codes
from .checks import check_int
from .codecs.base import Codec
from .codes import CodeBuffer, CodesView

__all__ = ["CodeBuffer", "CodesView", "TurboQuantKVCache", "TurboQuantRotatingKVCache", "tag_group", "codes_mode",
           "returning_codes", "FittedPositionsWarning"]

def _append(old: Optional[mx.array], new: mx.array) -> mx.array:
    """Concatenate along the token axis (2), ``old`` possibly None."""
    return new if old is None else mx.concatenate([old, new], axis=2)


def causal_mask(N: int, offset: int, return_array: bool = False, window_size: Optional[int] = None):
    """Deprecated name of ``cache_base.protocol_mask``."""
    from .checks import deprecated
    deprecated("cache.causal_mask", "cache_base.protocol_mask")
    return protocol_mask(N, offset, return_array, window_size)


FIT_TOKENS = 16   # a learning codec is fitted on this many tokens after the sinks


def codec_ready(codec: Codec) -> bool:
    """Whether ``codec`` can encode: False for a codec that learns from data (``fit``) and has not yet."""
    return not hasattr(codec, "fit") or getattr(codec, "fitted", True)


def _check_trim(n) -> int:
    return check_int("trim(n): n", n, 0)


def _copy_array(a):
    """An independent handle on an mx array: in-place writes into one (``x[...] = y``) are
    not seen by the other."""
    return None if a is None else mx.array(a)


class TurboQuantKVCache(CacheBase):
    """A KV cache of codes: ``TurboQuantKVCache(key_codec, value_codec=None, fp_window=0,
    sink_tokens=0)``.

    Keys and values have shape (B, H_kv, T, D); ``value_codec`` defaults to ``key_codec``.
    ``fp_window`` = R keeps the most recent R tokens in full precision as well, and
    ``sink_tokens`` = S the first S tokens of the sequence (attention reads them from these
    copies; their code slots hold the codes of zero vectors).

    A codec that learns from data (``Centered``'s mean, ``OutlierSplit``'s channels) is
    fitted on the first ``fit_tokens`` = F tokens after the sinks (positions S … S + F − 1),
    whatever chunks they arrive in, and those tokens stay exact (``sink_tokens`` becomes
    S + F at the first update): until F tokens have been seen each update refits on
    all of them and re-encodes what it holds (``_learn``). Every query therefore sees the
    same cache however the prompt is fed, to float rounding. (A rotating cache has no
    sinks: there only the fit is shared, see ``TurboQuantRotatingKVCache``.)
    """

    step = 256

    def __init__(self, key_codec: Codec, value_codec: Optional[Codec] = None, fp_window: int = 0,
                 sink_tokens: int = 0, *, fit_tokens: int = FIT_TOKENS):
        if not isinstance(key_codec, Codec) or not isinstance(value_codec or key_codec, Codec):
            raise TypeError("key_codec and value_codec must be turboquant codecs")
        fp_window, sink_tokens = check_int("fp_window", fp_window, 0), check_int("sink_tokens", sink_tokens, 0)
        self.fit_tokens = check_int("fit_tokens", fit_tokens, 1)
        self._warm: Optional[dict] = None   # while a codec learns: the first tokens, exact (``_learn``)
        self._refit: Optional[dict] = None  # once it has learnt: how, so a trim back into those tokens refits
        self.sink_tokens = sink_tokens
        self.sink_keys = self.sink_values = None
        self.key_codec, self.value_codec = key_codec, value_codec or key_codec
        # a calibrated key coder saw keys only below this position (``TransformCoder.positions``);
        # None once the warning was given (kept in meta_state, so in copies and files)
        self.fitted_positions: Optional[int] = getattr(key_codec, "positions", None)
        self.fp_window = fp_window
        self.key_codes: Optional[CodeBuffer] = None
        self.value_codes: Optional[CodeBuffer] = None
        self.recent_keys = self.recent_values = None
        self.offset = 0
        self.dtype = mx.float32
        self.n_layers = None       # length of the prompt-cache list this belongs to, if known
        self.group = None          # {"caches": that list, "broken": why it is unusable, or None}

    # ---------------------------------------------------------------- protocol
    @property
    def keys(self) -> Optional[mx.array]:
        """The held keys (B, H_kv, T, D) as attention reads them — decoded from the codes,
        exact where held exactly — or None while empty: what mlx-lm's ``KVCache.keys[...,
        :offset, :]`` holds. A view, computed (lazily) on each read; the cache stores only
        codes (``key_codes``, a ``CodeBuffer``)."""
        return None if self.key_codes is None else self.ring_codes()[0].dequantize()

    @keys.setter
    def keys(self, value) -> None:
        self._depend("keys", value)

    @property
    def values(self) -> Optional[mx.array]:
        """A view like ``keys``, of the held values (B, H_kv, T, D); the codes are ``value_codes``."""
        return None if self.value_codes is None else self.ring_codes()[1].dequantize()

    @values.setter
    def values(self, value) -> None:
        self._depend("values", value)

    def _depend(self, name: str, value) -> None:
        """Several mlx-lm models order evaluation with ``cache.keys = mx.depends(cache.keys, h)``:
        an array of the view's shape is accepted, and the codes are made to depend on it
        (its values are the view's own; anything else is refused — the view is read-only).
        The dependency is kept, so evaluating the codes then decodes the cache once more: a
        cost per step for the pipeline-parallel models that write it, never a wrong result."""
        held = getattr(self, name)
        if held is None or not isinstance(value, mx.array) or value.shape != held.shape:
            raise ValueError(f"cache.{name} is a read-only view of the codes "
                             f"({'empty' if held is None else tuple(held.shape)}); only an mx.depends of "
                             f"it may be assigned, got {getattr(value, 'shape', type(value).__name__)}")
        buf = self.key_codes if name == "keys" else self.value_codes
        names = list(buf.fields)
        buf.fields = dict(zip(names, mx.depends([buf.fields[n] for n in names], [value])))

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store ``keys``/``values`` (B, H_kv, T, D) and return what attention reads. A layer
        that fails changes nothing of itself; but if layers before it in the same prompt
        cache (``group``, set by ``make_prompt_cache``/``load_prompt_cache``) already took
        the tokens, the layers now disagree: the whole prompt cache is marked unusable and
        says so on this and every later update, instead of continuing out of step."""
        group = getattr(self, "group", None)
        T = keys.shape[2] if getattr(keys, "ndim", 0) == 4 else 0
        if group is not None and group["broken"]:
            raise ValueError(group["broken"])
        if group is not None:
            self._check_in_step(group, T)
        try:
            out = self._update_and_fetch(keys, values)
            if self.fitted_positions is not None and self.offset > self.fitted_positions:
                _warn_fitted_positions(self)     # stored a key at position ≥ fitted_positions
            return out
        except BaseException as e:                  # KeyboardInterrupt too: the layers disagree all the same
            if group is not None:
                caches = group["caches"]
                layer = next((n for n, c in enumerate(caches) if c is self or getattr(c, "inner", None) is self),
                             None)
                member = self if layer is None else caches[layer]   # a wrapper's offset is the layer's
                ahead = [n for n, c in enumerate(caches) if c.offset != member.offset]
                if ahead:
                    group["broken"] = (f"this prompt cache is unusable: a forward pass failed in layer {layer} "
                                       f"({type(e).__name__}: {e}) after layer(s) {ahead[0]}..{ahead[-1]} had "
                                       "stored its tokens, so its layers disagree. Make a new cache "
                                       "(make_prompt_cache) or load a saved one")
                    raise ValueError(group["broken"]) from e
            raise

    def _check_in_step(self, group: dict, T: int) -> None:
        """``check_in_step`` for this layer of its group (a wrapped cache, ``group_index``
        None, leaves the check to its wrapper, whose offset is the layer's)."""
        caches = group["caches"]
        i = getattr(self, "group_index", None)          # set with the group (cache.tag_group): no search per step
        if i is None or i >= len(caches) or caches[i] is not self:
            return
        check_in_step(caches, i, self.offset, T, group)

    def _update_and_fetch(self, keys: mx.array, values: mx.array):
        self._check(keys, values)
        if self._warm is not None or not (codec_ready(self.key_codec) and codec_ready(self.value_codec)):
            return self._learn(keys, values)
        self._store(keys, values)
        return self._fetch(*self._held())

    def _learn(self, keys: mx.array, values: mx.array):
        """An update while a codec still learns (fewer than S + ``fit_tokens`` tokens seen): fit
        fresh codecs (rebuilt from their unfitted configurations) on positions S … S + F − 1 of
        the exact tokens seen so far, re-run every update since the first into an empty
        cache, and adopt the result — all or nothing, so a failure changes nothing."""
        w = self._warm or {"start": self.offset, "chunks": [], "k": None, "v": None,
                           "configs": [self.key_codec.config(), self.value_codec.config()],
                           "shared": self.value_codec is self.key_codec, "fit_from": self.sink_tokens}
        seen, T, F = sum(w["chunks"]), keys.shape[2], w["fit_from"] + self.fit_tokens
        k_all = keys if w["k"] is None else mx.concatenate([w["k"], keys], axis=2)
        v_all = values if w["v"] is None else mx.concatenate([w["v"], values], axis=2)
        chunks = w["chunks"] + [T]
        kc, vc = self._fitted_codecs(w, k_all, v_all)
        shadow = self._emptied(w["start"], kc, vc)
        shadow.sink_tokens = self._sinks_while_learning(w["fit_from"])
        if len(chunks) == 1 or shadow._merges(seen + T):
            shadow._store(k_all, v_all)
        else:
            pos = 0
            for c in chunks:
                shadow._store(k_all[..., pos:pos + c, :], v_all[..., pos:pos + c, :])
                pos += c
        n = min(seen + T, F)
        shadow._warm = None if seen + T >= F else {**w, "chunks": chunks, "k": k_all[..., :n, :],
                                                   "v": v_all[..., :n, :]}
        if shadow._warm is None:           # fitted for good: remember from what (``_refit_after_trim``)
            shadow._refit = {k: w[k] for k in ("start", "configs", "shared", "fit_from")}
        self.__dict__.update(shadow.__dict__)
        return self._fetch(*self._held())

    def _fitted_codecs(self, w: dict, k_all: mx.array, v_all: mx.array):
        """Codecs rebuilt from ``w``'s unfitted configurations and fitted on positions
        S … min(seen, S + F) − 1 (on the sinks themselves while no more than S were seen)."""
        from .codecs.base import from_config
        n = min(k_all.shape[2], w["fit_from"] + self.fit_tokens)
        lo = w["fit_from"] if n > w["fit_from"] else 0
        kc = from_config(w["configs"][0])
        vc = kc if w["shared"] else from_config(w["configs"][1])
        for codec, x in ((kc, k_all), (vc, v_all)):
            if not codec_ready(codec):
                codec.fit(x[..., lo:n, :])
        return kc, vc

    def _emptied(self, offset: int, key_codec: Codec, value_codec: Codec) -> "TurboQuantKVCache":
        """A shallow copy holding nothing, at ``offset``, with these codecs."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.key_codec, new.value_codec = key_codec, value_codec
        new.key_codes = new.value_codes = new.recent_keys = new.recent_values = new.sink_keys = new.sink_values = None
        new.offset = offset
        return new

    @property
    def learning(self) -> bool:
        """True while a codec of this cache is still being fitted (fewer than ``sink_tokens`` +
        ``fit_tokens`` tokens seen; ``meta_state["learning"]`` says on which chunks)."""
        return self._warm is not None

    def _sinks_while_learning(self, sinks: int) -> int:
        """The sinks and the ``fit_tokens`` tokens after them stay exact: every query among them then
        sees them exactly however the prompt is fed, so their hidden states, and so the keys
        the codec is fitted on and everything after them, do not depend on the chunking."""
        return sinks + self.fit_tokens

    def _merges(self, n_tokens: int) -> bool:
        """Whether storing ``n_tokens`` in one update leaves the same cache as storing them in
        several (true of a plain cache; ``_learn`` replays chunk by chunk otherwise)."""
        return True

    def _store(self, keys: mx.array, values: mx.array) -> None:
        prev, T = self.offset, keys.shape[2]
        s = min(T, self.sink_tokens - prev)
        ck, cv = keys, values
        if s > 0:
            # the sinks are read from their exact copies, never from codes: their slots get the
            # codes of zero vectors, so a sink far outside what a fitted coder represents
            # (a BOS key) is not refused
            ck = mx.concatenate([mx.zeros_like(keys[..., :s, :]), keys[..., s:, :]], axis=2)
            cv = mx.concatenate([mx.zeros_like(values[..., :s, :]), values[..., s:, :]], axis=2)
        kc, vc = self._encode(ck, cv)
        if self.key_codes is None or prev + T > self.key_codes.length:
            n = -(-T // self.step) * self.step
            if self.key_codes is None:
                self.key_codes, self.value_codes = kc.zeros(n), vc.zeros(n)
            else:
                self.key_codes = CodeBuffer.concat([self.key_codes.slice(0, prev), kc.zeros(n)])
                self.value_codes = CodeBuffer.concat([self.value_codes.slice(0, prev), vc.zeros(n)])
        self.key_codes.assign(prev, kc)
        self.value_codes.assign(prev, vc)
        self._update_sink(prev, keys, values)
        self.offset += T
        self._update_recent(keys, values)

    def _check(self, keys, values):
        for name, a, codec in (("keys", keys, self.key_codec), ("values", values, self.value_codec)):
            if not isinstance(a, mx.array) or a.ndim != 4 or a.shape[-1] != codec.dim:
                raise ValueError(f"{name} must be an mx.array of shape (B, H, T, {codec.dim}), "
                                 f"got {getattr(a, 'shape', type(a).__name__)}")
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"keys {keys.shape} and values {values.shape} disagree in (B, H, T)")
        if self.key_codes is not None:
            held = tuple(next(iter(self.key_codes.fields.values())).shape[:2])
            if tuple(keys.shape[:2]) != held:
                raise ValueError(f"this cache holds batch {held[0]} × {held[1]} kv heads; new keys have "
                                 f"{keys.shape[0]} × {keys.shape[1]} (a cache serves one batch and model)")
        self.dtype = keys.dtype

    def _encode(self, keys, values):
        kc, vc = self.key_codec.encode(keys), self.value_codec.encode(values)
        return CodeBuffer(kc.arrays), CodeBuffer(vc.arrays)

    def _update_sink(self, prev, keys, values):
        n = self.sink_tokens - prev
        if n <= 0:
            return
        self.sink_keys = _append(self.sink_keys, keys[..., :n, :])
        self.sink_values = _append(self.sink_values, values[..., :n, :])

    def _update_recent(self, keys, values):
        if not self.fp_window:
            return
        r = self.fp_window
        self.recent_keys = _append(self.recent_keys, keys)[..., -r:, :]
        self.recent_values = _append(self.recent_values, values)[..., -r:, :]

    def _fetch(self, kbuf: CodeBuffer, vbuf: CodeBuffer):
        k, v = self._fetch_views(kbuf, vbuf)
        if codes_mode.get() > 0:
            return k, v
        return k.dequantize(), v.dequantize()

    def codes(self):
        """The held tokens as (keys, values) ``CodesView`` objects in temporal order, oldest
        first (in every cache of the package; for a plain cache also the order attention
        reads them)."""
        return self.ring_codes()

    def ring_codes(self):
        """The held tokens as (keys, values) ``CodesView`` objects in the order attention reads
        them (what ``update_and_fetch`` returns under ``codes_attention``; a rotating cache's
        ring order after single-token steps, as mlx-lm's ``RotatingKVCache.keys``)."""
        if self.key_codes is None:
            raise ValueError("the cache is empty: no codes yet")
        return self._fetch_views(*self._held())

    @classmethod
    def from_kv(cls, keys: mx.array, values: mx.array, key_codec: Codec, value_codec: Optional[Codec] = None, *,
                offset: Optional[int] = None, fp_window: int = 0, sink_tokens: int = 0) -> "TurboQuantKVCache":
        """A cache holding ``keys``/``values`` (B, H, T, D), the last T of ``offset`` tokens
        (default T), encoded as if they had come in one update (``to_turboquant`` converts
        mlx-lm caches with it)."""
        T = keys.shape[2] if isinstance(keys, mx.array) and keys.ndim == 4 else None
        if T is None:
            raise ValueError(f"keys must be a (B, H, T, D) mx.array, got {getattr(keys, 'shape', keys)!r}")
        offset = T if offset is None else check_int("offset", offset, T)
        cache = cls(key_codec, value_codec, fp_window=fp_window, sink_tokens=sink_tokens)
        cache.offset = offset - T
        cache.update_and_fetch(keys, values)
        return cache

    def _held(self) -> tuple[CodeBuffer, CodeBuffer]:
        """The key and value buffers of the held tokens."""
        return self.key_codes.slice(0, self.offset), self.value_codes.slice(0, self.offset)

    def _fetch_views(self, kbuf: CodeBuffer, vbuf: CodeBuffer):
        k = CodesView(self.key_codec, kbuf, self.dtype, self.recent_keys, self.sink_keys)
        v = CodesView(self.value_codec, vbuf, self.dtype, self.recent_values, self.sink_values)
        return k, v

    def empty(self) -> bool:
        return self.key_codes is None

    def is_trimmable(self) -> bool:
        """True unless ``fp_window`` > 0: trimming would leave fewer than R exact recent
        tokens (the older ones exist only as codes), so logits after a trim would differ
        from a cache that never saw the trimmed tokens."""
        return not self.fp_window

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (fewer if fewer are held); returns how many. While a codec
        still learns, the next update refits without them. Once it has been fitted, a trim
        back into the tokens it was fitted on forgets that fit and learns again from the
        tokens that remain (all held exactly), so the next tokens are coded as in a fresh
        cache fed the same prefix (mlx-lm's server reuses a conversation's cache for another
        that shares only a short prefix, e.g. Gemma's chat template). A cache loaded from a
        file keeps its fit on such a trim (files do not record how it was learnt)."""
        n = _check_trim(n)
        if self.fp_window and n:
            raise ValueError(f"a cache with fp_window={self.fp_window} cannot be trimmed exactly "
                             "(is_trimmable() is False): the tokens that would re-enter the "
                             "full-precision window are held only as codes")
        n = min(self.offset, n)
        self.offset -= n
        if self.fp_window and self.recent_keys is not None:
            keep = max(0, self.recent_keys.shape[2] - n)
            self.recent_keys = self.recent_keys[..., :keep, :]
            self.recent_values = self.recent_values[..., :keep, :]
        if self.sink_keys is not None and self.sink_keys.shape[2] > self.offset:
            self.sink_keys = self.sink_keys[..., :self.offset, :]
            self.sink_values = self.sink_values[..., :self.offset, :]
        self._trim_warm()
        self._refit_after_trim()
        return n

    def _refit_after_trim(self) -> None:
        """After a trim back into the tokens a learning codec was fitted on (a server reusing a
        prefix shorter than sinks + ``fit_tokens`` of another conversation): forget that fit
        and learn again from the tokens that remain — all held exactly — as if only they had
        come. The next tokens then complete the fit, as in a fresh cache."""
        r = self._refit
        if r is None or self._warm is not None or r["start"] != 0 or \
                self.offset >= r["fit_from"] + self.fit_tokens or self.sink_keys is None:
            return
        from .codecs.base import from_config
        o = self.offset
        k, v = self.sink_keys[..., :o, :], self.sink_values[..., :o, :]
        kc = from_config(r["configs"][0])
        vc = kc if r["shared"] else from_config(r["configs"][1])
        fresh = self._emptied(0, kc, vc)
        fresh.sink_tokens, fresh._warm, fresh._refit = r["fit_from"], None, None
        if o:
            fresh._update_and_fetch(k, v)
        self.__dict__.update(fresh.__dict__)

    def _trim_warm(self) -> None:
        """After a trim while a codec learns: forget the trimmed tokens (the next update
        refits without them, as if they had never come)."""
        w = self._warm
        if w is None:
            return
        total, chunks, acc = max(0, self.offset - w["start"]), [], 0
        for c in w["chunks"]:
            if acc >= total:
                break
            chunks.append(min(c, total - acc))
            acc += chunks[-1]
        n = min(total, w["fit_from"] + self.fit_tokens)
        w.update(chunks=chunks, k=w["k"][..., :n, :] if n else None, v=w["v"][..., :n, :] if n else None)

    @property
    def batch_size(self) -> Optional[int]:
        """Sequences held (None while empty)."""
        return None if self.key_codes is None else next(iter(self.key_codes.fields.values())).shape[0]

    @property
    def nbytes(self) -> int:
        if self.key_codes is None:
            return 0
        return self.key_codes.nbytes + self.value_codes.nbytes + self.exact_nbytes

    @property
    def exact_nbytes(self) -> int:
        """How many bytes the tokens held exactly take besides their codes (sinks, the recent
        window, and the first tokens a learning codec is fitted on)."""
        warm = (self._warm["k"], self._warm["v"]) if self._warm is not None else ()
        return sum(a.nbytes for a in (self.recent_keys, self.recent_values, self.sink_keys, self.sink_values, *warm)
                   if a is not None)

    def code_nbytes(self, n_tokens: Optional[int] = None) -> int:
        """The bit accounting: codec bytes per vector × vectors held (B·H·T) for K and V."""
        if self.key_codes is None:
            return 0
        B, H = next(iter(self.key_codes.fields.values())).shape[:2]
        t = self.offset if n_tokens is None else n_tokens
        return B * H * t * (self.key_codec.nbytes_per_vector + self.value_codec.nbytes_per_vector)

    # ---------------------------------------------------------------- state
    @property
    def state(self):
        """tuple: (key code fields, value code fields, exact tokens, meta JSON). The code fields map
        names to (B, H, T, w) arrays; exact tokens are ``k``/``v`` (the recent window) and
        ``sk``/``sv`` (sinks) as (B, H, t, D) arrays. Unlike mlx-lm's ``KVCache`` (whose
        state is (keys, values)) this is a tree of code fields; the fourth entry, the JSON of
        ``meta_state``, lets a file written by ``mlx_lm.save_prompt_cache`` be rebuilt by
        ``turboquant.load_prompt_cache``."""
        meta = json.dumps(self.meta_state)
        if self.key_codes is None or self.offset == 0:
            return {}, {}, {}, meta
        rec = {"k": self.recent_keys, "v": self.recent_values} if self.fp_window and self.recent_keys is not None else {}
        if self.sink_keys is not None:
            rec.update(sk=self.sink_keys, sv=self.sink_values)
        rec.update(self._warm_state())
        return self.key_codes.slice(0, self.offset).fields, self.value_codes.slice(0, self.offset).fields, rec, meta

    def _warm_state(self) -> dict:
        """The exact first tokens a learning codec is fitted on (``wk``/``wv``), if it still learns."""
        w = self._warm
        return {} if w is None or w["k"] is None else {"wk": w["k"], "wv": w["v"]}

    @state.setter
    def state(self, v):
        k, val, rec = v[:3]
        self.key_codes = CodeBuffer(k) if k else None
        self.value_codes = CodeBuffer(val) if val else None
        self.recent_keys, self.recent_values = rec.get("k"), rec.get("v")
        self.sink_keys, self.sink_values = rec.get("sk"), rec.get("sv")
        self._set_warm_state(rec)

    def _set_warm_state(self, rec: dict) -> None:
        if self._warm is not None:
            self._warm.update(k=rec.get("wk"), v=rec.get("wv"))

    @property
    def meta_state(self) -> dict:
        m = {"class": type(self).__name__, "key_codec": self.key_codec.config(),
             "value_codec": self.value_codec.config(), "fp_window": self.fp_window,
             "sink_tokens": self.sink_tokens, "fit_tokens": self.fit_tokens,
             "offset": self.offset, "dtype": str(self.dtype).split(".")[-1]}
        if self._warm is not None:
            m["learning"] = {n: self._warm[n] for n in ("start", "chunks", "configs", "shared", "fit_from")}
        if getattr(self.key_codec, "positions", None) is not None or self.fitted_positions is not None:
            m["fitted_positions"] = self.fitted_positions       # None: already warned
        return m

    @meta_state.setter
    def meta_state(self, m):
        from .codecs.base import from_config
        self.key_codec = from_config(m["key_codec"])
        learning = m.get("learning")
        shared = bool(learning and learning["shared"])
        self.value_codec = self.key_codec if shared else from_config(m["value_codec"])
        self.fp_window, self.offset = int(m["fp_window"]), int(m["offset"])
        self.sink_tokens = int(m.get("sink_tokens", 0))
        self.fit_tokens = int(m.get("fit_tokens", FIT_TOKENS))
        self._warm = None if not learning else {
            "start": int(learning["start"]), "chunks": [int(c) for c in learning["chunks"]],
            "configs": [dict(c) for c in learning["configs"]], "shared": shared, "k": None, "v": None,
            "fit_from": int(learning["fit_from"])}
        self._refit = None        # how a fitted codec was learnt is kept in memory (and by copies), not in files
        fitted = m.get("fitted_positions", getattr(self.key_codec, "positions", None))   # None: warned
        self.fitted_positions = None if fitted is None else check_int("fitted_positions", fitted, 1)
        self.dtype = getattr(mx, m["dtype"])

    @classmethod
    def from_state(cls, state, meta_state=None):
        """Rebuild a cache from ``state`` and ``meta_state`` (taken from ``state``'s fourth
        entry when not given, as for files written by ``mlx_lm.save_prompt_cache``)."""
        if meta_state is None:
            if len(state) < 4 or not isinstance(state[3], str):
                raise ValueError("this state carries no meta_state: pass it explicitly")
            meta_state = json.loads(state[3])
        obj = cls.__new__(cls)
        obj.n_layers, obj.group = None, None
        obj.meta_state = meta_state
        obj.state = state
        return obj

    def merge(self, caches):
        """One batch cache (``turboquant.batch.BatchCodesCache``) from one cache of this kind
        per sequence, as mlx-lm's batching calls it (``caches[0].merge(caches)``): their codes
        copied, never re-encoded."""
        from .batch import BatchCodesCache
        return BatchCodesCache.merge(caches)

    def __deepcopy__(self, memo):
        """An independent copy: arrays copied, codecs rebuilt from their configurations
        (mlx-lm deep-copies prompt caches in its server, batch generator and evaluation). A
        copy of a whole prompt cache (the list) keeps the layers-in-step check among the
        copies; a layer copied alone belongs to no group."""
        state = tuple({n: _copy_array(a) for n, a in part.items()} for part in self.state[:3])
        new = type(self).from_state(state, self.meta_state)
        new.n_layers = self.n_layers
        refit = self._refit
        new._refit = None if refit is None else {**refit, "configs": [dict(c) for c in refit["configs"]]}
        memo[id(self)] = new
        group = self.group
        copied = None if group is None else memo.get(id(group["caches"]))
        if copied is not None:              # copying the whole prompt cache: the copies form their own group
            new.group = memo.setdefault(id(group), {"caches": copied, "broken": group["broken"]})
            new.group_index = self.group_index
        return new


class TurboQuantRotatingKVCache(TurboQuantKVCache):
    """A sliding-window cache of codes with mlx-lm ``RotatingKVCache`` semantics:
    ``TurboQuantRotatingKVCache(max_size, key_codec, value_codec=None, keep=0)``.

    Memory is constant once ``max_size`` tokens are held; a prefill of S tokens
    temporarily holds up to max_size + S − 1 so that every new token sees a full window.
    """

    def __init__(self, max_size: int, key_codec: Codec, value_codec: Optional[Codec] = None, keep: int = 0, *,
                 fit_tokens: int = FIT_TOKENS):
        super().__init__(key_codec, value_codec, fp_window=0, fit_tokens=fit_tokens)
        max_size = check_int("max_size", max_size, 1)
        keep = check_int("keep", keep, 0, max_size - 1)
        self.max_size, self.keep, self._idx = max_size, keep, 0

    def _trim(self, trim_size: int, buf: CodeBuffer, append: Optional[CodeBuffer] = None) -> CodeBuffer:
        parts = [buf.slice(0, self.keep), buf.slice(trim_size + self.keep)] if trim_size > 0 else [buf]
        return CodeBuffer.concat(parts + ([append] if append is not None else []))

    def _temporal_order(self, buf: CodeBuffer) -> CodeBuffer:
        if self._idx == buf.length:
            return buf
        if self._idx < self.offset:
            return CodeBuffer.concat([buf.slice(0, self.keep), buf.slice(self._idx),
                                      buf.slice(self.keep, self._idx)])
        return buf.slice(0, self._idx)

    def _store(self, keys: mx.array, values: mx.array) -> None:
        kc, vc = self._encode(keys, values)
        S = keys.shape[2]
        if S == 1:
            self._update_in_place(kc, vc)
        else:
            self._update_concat(kc, vc, S)

    def _sinks_while_learning(self, sinks: int) -> int:
        """A ring has no sinks: queries within the first ``fit_tokens`` see the provisional
        fit of the tokens before them, so chunking can still move what follows (measured in
        ``tests/test_cache.py``)."""
        return 0

    def _emptied(self, offset, key_codec, value_codec):
        new = super()._emptied(offset, key_codec, value_codec)
        new._idx = 0
        return new

    def _merges(self, n_tokens: int) -> bool:
        """Until the ring first fills, one update leaves what several would (in temporal
        order either way); after that, eviction depends on the chunks."""
        return self.offset == 0 and n_tokens <= self.max_size

    @classmethod
    def from_tokens(cls, max_size: int, keys: mx.array, values: mx.array, key_codec: Codec,
                    value_codec: Optional[Codec] = None, *, offset: Optional[int] = None,
                    keep: int = 0) -> "TurboQuantRotatingKVCache":
        """A ring holding the last of ``keys``/``values`` (B, H, T, D), in temporal order, as
        if it had seen ``offset`` tokens (default T) of which these are the last T."""
        T = keys.shape[2] if isinstance(keys, mx.array) and keys.ndim == 4 else None
        if T is None or T < 1:
            raise ValueError(f"keys must be a non-empty (B, H, T, D) mx.array, got {getattr(keys, 'shape', keys)!r}")
        offset = T if offset is None else check_int("offset", offset, T)
        if T < min(offset, max_size):
            raise ValueError(f"a ring of max_size={max_size} after {offset} tokens holds "
                             f"{min(offset, max_size)} of them; {T} given")
        cache = cls(max_size, key_codec, value_codec, keep=keep)
        cache.offset = offset - T
        cache.update_and_fetch(keys, values)
        cache.compact()
        return cache

    @classmethod
    def from_ring(cls, keys: mx.array, values: mx.array, key_codec: Codec, value_codec: Optional[Codec] = None, *,
                  max_size: int, keep: int, offset: int, idx: int) -> "TurboQuantRotatingKVCache":
        """The codes of an mlx-lm ``RotatingKVCache``'s buffer: ``keys``/``values`` (B, H, n, D)
        in its ring order, with its ``offset`` and write position ``idx`` (the same ring
        layout, so the next update evicts what mlx-lm's would). A codec that learns is
        fitted on the first ``fit_tokens`` slots of the ring (``to_turboquant``)."""
        cache = cls(max_size, key_codec, value_codec, keep=keep)
        cache._check(keys, values)
        for codec, x in ((cache.key_codec, keys), (cache.value_codec, values)):
            if not codec_ready(codec):
                codec.fit(x[..., :cache.fit_tokens, :])
        cache.key_codes, cache.value_codes = cache._encode(keys, values)
        cache.offset = check_int("offset", offset, 0)
        cache._idx = check_int("idx", idx, 0, keys.shape[2])
        return cache

    def codes(self):
        """The held tokens as (keys, values) ``CodesView`` objects in temporal order, oldest
        first (``ring_codes()`` gives them in the order attention reads them, which after
        single-token steps is ring order)."""
        if self.key_codes is None:
            raise ValueError("the cache is empty: no codes yet")
        k, v = self._held()
        return self._fetch_views(self._temporal_order(k), self._temporal_order(v))

    def ordered_codes(self):
        """Deprecated name of ``codes()`` (temporal order in every cache)."""
        from .checks import deprecated
        deprecated("TurboQuantRotatingKVCache.ordered_codes()", "codes()")
        return self.codes()

    def compact(self) -> None:
        """Drop what no later step can see: keep at most ``max_size`` tokens (the ``keep``
        first ones and the most recent). After a prefill of S tokens the
        ring holds up to max_size + S − 1; compacting brings memory back to the window
        without changing any later output or mask (the stored arrays and ``idx`` in
        ``meta_state`` do change: they are what the next update would have made them)."""
        if self.key_codes is None or self.offset == 0:
            return
        cut = self.key_codes.length - self.max_size
        if cut <= 0:                   # within the window: the ring order is part of the state
            return
        # more than max_size held happens only right after a multi-token update, in temporal
        # order: drop what the next update would drop anyway
        self.key_codes, self.value_codes = self._trim(cut, self.key_codes), self._trim(cut, self.value_codes)
        self._idx = self.max_size

    def _held(self) -> tuple[CodeBuffer, CodeBuffer]:
        if self.offset < self.key_codes.length:
            return self.key_codes.slice(0, self.offset), self.value_codes.slice(0, self.offset)
        return self.key_codes, self.value_codes

    def _update_concat(self, kc, vc, S):
        if self.key_codes is None:
            self.key_codes, self.value_codes = kc, vc
        else:
            self.key_codes, self.value_codes = self._temporal_order(self.key_codes), self._temporal_order(self.value_codes)
            self._idx = self.key_codes.length
            trim_size = self._idx - self.max_size + 1          # every new token sees max_size keys
            self.key_codes = self._trim(trim_size, self.key_codes, kc)
            self.value_codes = self._trim(trim_size, self.value_codes, vc)
        self.offset += S
        self._idx = self.key_codes.length

    def _update_in_place(self, kc, vc):
        prev = self.offset
        if self.key_codes is None or (prev >= self.key_codes.length and self.key_codes.length < self.max_size):
            n = min(self.step, self.max_size - prev)
            if self.key_codes is None:
                self.key_codes, self.value_codes = kc.zeros(n), vc.zeros(n)
            else:
                self.key_codes = CodeBuffer.concat([self.key_codes, kc.zeros(n)])
                self.value_codes = CodeBuffer.concat([self.value_codes, vc.zeros(n)])
            self._idx = prev
        trim_size = self.key_codes.length - self.max_size
        if trim_size > 0:
            self.key_codes, self.value_codes = self._trim(trim_size, self.key_codes), self._trim(trim_size, self.value_codes)
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = self.keep
        self.key_codes.assign(self._idx, kc)
        self.value_codes.assign(self._idx, vc)
        self.offset += 1
        self._idx += 1

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        n = min(self.offset, _check_trim(n))
        self.offset -= n
        self._idx -= n
        self._trim_warm()
        return n

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        # mlx-lm RotatingKVCache.make_mask, unchanged
        if N > 1:
            window_size = window_size or self.max_size
            offset = min(self.max_size - 1, self.offset)
            if offset + N > window_size or return_array:
                return create_causal_mask(N, offset, window_size=window_size)
            return "causal"
        if window_size is None:
            return None
        if self.offset >= window_size and self.max_size > window_size:
            idx = self._idx if self._idx < self.max_size else 0
            mask_size = self.offset + 1 if self.offset < self.max_size else self.max_size
            mask = mx.arange(mask_size) >= (mask_size - window_size)
            return mx.roll(mask, shift=idx + 1)
        return None

    @property
    def state(self):
        meta = json.dumps(self.meta_state)
        if self.key_codes is None or self.offset == 0:
            return {}, {}, {}, meta
        return self.key_codes.fields, self.value_codes.fields, self._warm_state(), meta

    @state.setter
    def state(self, v):
        k, val = v[:2]
        rec = v[2] if len(v) > 2 else {}
        self.key_codes = CodeBuffer(k) if k else None
        self.value_codes = CodeBuffer(val) if val else None
        self.recent_keys = self.recent_values = self.sink_keys = self.sink_values = None
        self._set_warm_state(rec)

    @property
    def meta_state(self) -> dict:
        m = super().meta_state
        m.update(max_size=self.max_size, keep=self.keep, idx=self._idx)
        return m

    @meta_state.setter
    def meta_state(self, m):
        TurboQuantKVCache.meta_state.fset(self, m)
        self.max_size, self.keep, self._idx = int(m["max_size"]), int(m["keep"]), int(m["idx"])


class FittedPositionsWarning(UserWarning):
    """A calibrated cache stores keys at positions its coders never saw in calibration."""


def _warn_fitted_positions(cache: "TurboQuantKVCache") -> None:
    """Warn that a calibrated cache's coders now code keys at positions they were not fitted
    on; this layer's cache then forgets the limit (one warning per layer at most; Python's
    default filter shows repeats from the same line once)."""
    n, cache.fitted_positions = cache.fitted_positions, None
    warnings.warn(f"turboquant: this cache's key coder was calibrated on keys at positions below {n} "
                  f"(TransformCoder.positions: where its profile put them) and now codes keys at position {n} "
                  "or later. "
                  "RoPE turns keys by an angle that grows with position, so later keys have other statistics "
                  "and a profile's key error grows many-fold past the positions it was fitted for (Chapter 10 "
                  "measures it). Re-calibrate over the positions you serve (turboquant calibrate --positions N) "
                  "or use the uncalibrated budgets: make_prompt_cache(model, bits=…) without profile (on the "
                  "command line: without --profile).", FittedPositionsWarning, stacklevel=3)


def check_in_step(caches: list, i: int, offset: int, T: int, group: Optional[dict]) -> None:
    """A model runs its layers in order, so before layer i of ``caches`` takes T tokens at
    ``offset``, the layers before it hold offset + T and those after it offset. Otherwise the
    list the model was given is not the whole prompt cache (e.g. ``cache[:10]``: mlx-lm zips
    layers with caches and silently runs 10 of 30 layers), or an earlier pass stopped part-way:
    refuse, and mark ``group`` (the prompt cache) unusable."""
    before = [n for n in range(i) if caches[n].offset != offset + T]
    after = [n for n in range(i + 1, len(caches)) if caches[n].offset != offset]
    if before or after:
        odd = before or after
        why = (f"this prompt cache is unusable: layer {i} was given tokens while layer(s) "
               f"{odd[0]}..{odd[-1]} were not: either the model was passed only part of the "
               f"cache list (a slice such as cache[{f':{odd[0]}' if after else f'{odd[-1] + 1}:'}]?; "
               f"pass the whole list of {len(caches)} caches), or an earlier forward pass "
               "stopped part-way. Make a new cache (make_prompt_cache) or load a saved one")
        if group is not None:
            group["broken"] = why
        raise ValueError(why)


def tag_group(cache: list) -> list:
    """Tell each TurboQuant cache the length of its list (``codes_attention`` checks it
    against the model's layers) and the group it belongs to (a failed forward pass marks the
    whole group unusable: ``TurboQuantKVCache.update_and_fetch``). A cache that wraps one
    (``prerope.TurnedMeanCache``: an ``inner`` TurboQuant cache) is the group's member: it
    checks that the layers take tokens in step, its inner cache shares the group's verdict
    (``join_group``)."""
    def wrapped(c) -> bool:
        return isinstance(getattr(c, "inner", None), TurboQuantKVCache) and hasattr(c, "join_group")
    members = [c for c in cache if isinstance(c, TurboQuantKVCache) or wrapped(c)]
    if len(members) == len(cache):
        members = cache                     # the list itself: a deep copy of it re-links its wrappers
    group = {"caches": members, "broken": None}
    for i, c in enumerate(members):
        if wrapped(c):
            c.join_group(group, i, len(cache))
        else:
            c.n_layers, c.group, c.group_index = len(cache), group, i
    return cache
