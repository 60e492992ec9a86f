"""``turboquant serve``: mlx-lm's OpenAI-compatible HTTP server on compressed caches (Chapter 7).

Nothing here is an HTTP server: ``mlx_lm.server`` is run as it is (its API —
``/v1/chat/completions``, ``/v1/completions``, streaming, ``/health`` —, its continuous
batching ``BatchGenerator``, its prompt-cache LRU bounded by ``--prompt-cache-bytes``), with
one change: the model's ``make_cache`` returns TurboQuant caches (``install_caches``), so
every conversation it serves, batches (``turboquant.batch.BatchCodesCache``) and keeps in
its LRU holds codes. mlx-lm sizes that LRU by each cache's ``nbytes``, which for these
caches are the codes' real bytes, so the same ``--prompt-cache-bytes`` keeps several times
more conversations.

The server listens on 127.0.0.1 unless ``--host`` says otherwise; mlx-lm warns that it
implements only basic security checks.
"""
from __future__ import annotations

import re
import sys
import threading
from contextlib import contextmanager
from decimal import Decimal
from typing import Optional

from mlx_lm.models import cache as mlx_cache

__all__ = ["install_caches", "batchable", "serve", "serve_plain", "size_in_bytes", "check_mlx_options"]


_UNITS = {"": 1, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}


def size_in_bytes(text: str) -> int:
    """A size as mlx-lm's server reads ``--prompt-cache-bytes``: a number of bytes, or with
    ``M``/``MB`` (10⁶) or ``G``/``GB`` (10⁹); e.g. "64MB" → 64,000,000. ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"a size is a number of bytes, or with M/MB or G/GB (decimal), e.g. 64MB; got {text!r}")
    return int(Decimal(m.group(1)) * _UNITS[m.group(2).upper()])


class _CacheFactory:
    """The ``make_cache`` installed on a model: TurboQuant caches made with ``options``
    (``make_prompt_cache``'s keyword arguments). ``make_prompt_cache`` reads the model's
    mlx-lm layout through ``mlx_layout()``, during which this answers with the model's own
    caches (``original``, or mlx-lm's default when the model has no ``make_cache``)."""

    def __init__(self, model, options: dict, original):
        self.model, self.options, self.original = model, dict(options), original
        self._local = threading.local()          # per thread: inside mlx_layout() or not

    @contextmanager
    def mlx_layout(self):
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth

    def __call__(self) -> list:
        if getattr(self._local, "depth", 0):
            return self.original() if self.original is not None else [mlx_cache.KVCache() for _ in self.model.layers]
        from .prompt_cache import make_prompt_cache
        return make_prompt_cache(self.model, warn_rotating=False, **self.options)


def install_caches(model, **options) -> list:
    """Make ``model.make_cache()`` — and so ``mlx_lm.models.cache.make_prompt_cache(model)``,
    which mlx-lm's generation, batch generator and server call — return TurboQuant caches
    made with ``options`` (``turboquant.make_prompt_cache``'s keyword arguments, e.g.
    ``bits=4.25``). Returns one such cache (built now, so bad options fail here). Installing
    again replaces the options."""
    current = getattr(model, "make_cache", None)
    original = current.original if isinstance(current, _CacheFactory) else current
    factory = _CacheFactory(model, options, original)
    cache = factory()                          # bad options fail before anything changes
    model.make_cache = factory
    return cache


def batchable(cache: list) -> bool:
    """Whether mlx-lm's batch generator can merge these caches: every one has ``merge``, and
    rotating ones keep no leading tokens (``max_kv_size``'s ``keep=4`` is not batched)."""
    return all(hasattr(c, "merge") for c in cache) and not any(getattr(c, "keep", 0) for c in cache)


def _provider_class():
    from mlx_lm.server import ModelProvider

    class CompressedModelProvider(ModelProvider):
        """mlx-lm's ``ModelProvider`` whose models make TurboQuant caches (``install_caches``
        with ``cache_options``); installed model names (``smollm2-135m`` …) are accepted as
        the request's ``model`` too."""

        cache_options: dict = {}
        aliases: dict = {}
        from_codes: bool = True

        def __init__(self, cli_args):
            super().__init__(cli_args)
            self._model_map.update(self.aliases)

        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            import mlx.core as mx
            previous = getattr(self, "_codes", None)
            if previous is not None:                     # the model it patched is being replaced
                self._codes = None
                previous.__exit__(None, None, None)
            super()._load(model_path, adapter_path, draft_model_path)
            try:
                self.model.set_dtype(mx.float32)         # as turboquant.load: float32 on the CPU
                cache = install_caches(self.model, **self.cache_options)
                self.is_batchable = self.draft_model is None and batchable(cache)
                if self.from_codes:
                    # mlx-lm loads the model in its generation thread, which then serves every
                    # request: attention from codes is switched on there until the next load
                    from .attention import codes_attention
                    self._codes = codes_attention(self.model)
                    self._codes.__enter__()
            except BaseException:
                self.reset()                             # never serve this model uncompressed
                raise

    return CompressedModelProvider


CompressedModelProvider = None   # the class, made on first use (importing mlx_lm.server is slow)


@contextmanager
def _provider(options: dict, aliases: dict, from_codes: bool = True):
    """mlx-lm's server module with its ``ModelProvider`` replaced, for the duration."""
    global CompressedModelProvider
    import mlx_lm.server as server
    if CompressedModelProvider is None:
        CompressedModelProvider = _provider_class()
    cls = type("ConfiguredProvider", (CompressedModelProvider,), {"cache_options": dict(options),
                                                                   "aliases": dict(aliases),
                                                                   "from_codes": from_codes})
    saved = server.ModelProvider
    server.ModelProvider = cls
    try:
        yield cls
    finally:
        server.ModelProvider = saved


_NOT_MLX = ("--model", "--kv-bits", "--kv-group-size", "--quantized-kv-start", "--draft-model",
            "--num-draft-tokens", "--adapter-path")


def check_mlx_options(mlx_args: list) -> None:
    """Refuse mlx-lm server options that would contradict turboquant serve, also as the
    abbreviations mlx-lm's parser accepts (``--kv-b 4``, ``--mod X``)."""
    for a in mlx_args:
        name = str(a).split("=")[0]
        if len(name) > 2 and name.startswith("--"):
            hit = next((o for o in _NOT_MLX if o.startswith(name)), None)
            if hit:
                raise ValueError(f"{name} ({hit}) is not an option of turboquant serve: the model is --model "
                                 "here, the cache is chosen by --bits/--key-bits/--value-bits/--codec, and "
                                 "adapters and speculative decoding are not served")


def _mlx_argv(model: str, mlx_args: Optional[list]) -> tuple[list, dict]:
    from .models import MODELS, model_folder
    mlx_args = list(mlx_args or [])
    check_mlx_options(mlx_args)
    folder = str(model_folder(model))
    return ["turboquant serve", "--model", folder, *mlx_args], ({model: folder} if model in MODELS else {})


def _run_mlx_server(argv: list) -> None:
    from mlx_lm import server
    saved, sys.argv = sys.argv, argv
    try:
        server.main()
    finally:
        sys.argv = saved


def serve_plain(model: str, mlx_args: Optional[list] = None) -> None:
    """mlx-lm's server unchanged (its uncompressed caches in the model's dtype), on the same
    model folder and with the fast CPU BLAS this package sets up: the baseline of the load
    test (``turboquant serve --plain``)."""
    argv, _ = _mlx_argv(model, mlx_args)
    _run_mlx_server(argv)


def serve(model: str, options: dict, mlx_args: Optional[list] = None, from_codes: bool = True) -> None:
    """Run mlx-lm's server (blocking, until interrupted) on ``model`` (an installed model's
    name, converted on first use, or an mlx-lm folder) with TurboQuant caches made with
    ``options``, attention computed from the codes (``from_codes``; else decoded keys and
    values through the model's own attention). ``mlx_args`` are ``mlx_lm.server``'s own
    command-line options (``--port``, ``--host``, ``--prompt-cache-bytes``,
    ``--decode-concurrency`` …)."""
    argv, aliases = _mlx_argv(model, mlx_args)
    with _provider(options, aliases, from_codes):
        _run_mlx_server(argv)
