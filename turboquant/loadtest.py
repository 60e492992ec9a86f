"""A bounded load test of ``turboquant serve`` against mlx-lm's own server (Chapter 7).

``run_loadtest`` starts each server itself on a free loopback port, drives it with a fixed
number of conversations from a fixed number of client threads, and stops it — every loop
is bounded, nothing reaches beyond 127.0.0.1. Per server it measures:

* **throughput** at each concurrency C: C clients share N first turns (a news article and
  a request for a one-sentence summary, greedy, a fixed number of new tokens): requests/s,
  generated tokens/s, p50/p95 request latency, the server's peak resident memory;
* **capacity** at each ``--prompt-cache-bytes`` budget: N conversations' first turns one
  after another, then how many conversations mlx-lm's prompt-cache LRU reports holding
  (its own log line) and how many second turns, asked newest first, find their whole
  first turn cached (``usage.prompt_tokens_details.cached_tokens``);
* **faults** (compressed server): a client that disconnects mid-stream, a malformed
  request and a request longer than the budget; afterwards the server must still answer,
  and the conversations it reported holding before are counted again.

The baseline is ``turboquant serve --plain``: mlx-lm's server unchanged, with its
uncompressed caches in the model's dtype (float32 here, as every model of this package
runs on the CPU); fp16 caches would hold half the bytes of those, which the report also
states.
"""
from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Optional

__all__ = ["run_loadtest", "start_server", "conversation_texts", "quantile"]

PROBE = "Say OK."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on 127.0.0.1:``port`` whose log is collected (for the LRU's own
    report of what it holds)."""

    def __init__(self, argv: list[str], port: int, timeout: float = 180):
        self.port, self.log = port, []
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {''.join(self.log)[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")

    def _read(self):
        for line in self.proc.stdout:
            self.log.append(line)

    def kept(self) -> Optional[int]:
        """Finished conversations (its "assistant" entries) the prompt-cache LRU reported
        holding in its latest log line, less the probe's own."""
        for line in reversed(self.log):
            m = re.search(r"- assistant: (\d+) sequences", line)
            if m:
                return max(0, int(m.group(1)) - 1)
        return None

    def probe(self) -> Optional[int]:
        """``kept()`` after two tiny requests: the first lets the LRU trim to its budget
        (mlx-lm trims when a request arrives), the second makes it report."""
        for _ in range(2):
            _chat(self.port, [{"role": "user", "content": PROBE}], 1)
        return self.kept()

    def peak_rss(self) -> Optional[int]:
        """The server process's peak resident memory in bytes (Linux ``VmHWM``)."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_server(model: str, kind: str, *, budget: Optional[str] = None, concurrency: int = 4,
                 cache_args: tuple = ("--bits", "4.25"), max_tokens: int = 16) -> Server:
    """``turboquant serve`` (``kind`` "turboquant", with ``cache_args``) or ``turboquant serve
    --plain`` (kind "plain") on a free loopback port, with the prompt-cache LRU bounded by
    ``budget`` bytes (e.g. "64MB") and holding up to 10,000 conversations."""
    if kind not in ("turboquant", "plain"):
        raise ValueError(f"kind must be 'turboquant' or 'plain', got {kind!r}")
    port = _free_port()
    argv = [sys.executable, "-m", "turboquant.cli", "serve", "--model", model, "--port", str(port),
            "--log-level", "INFO", "--prompt-cache-size", "10000", "--max-tokens", str(max_tokens),
            "--decode-concurrency", str(concurrency), "--prompt-concurrency", str(concurrency)]
    argv += list(cache_args) if kind == "turboquant" else ["--plain"]
    if budget is not None:
        argv += ["--prompt-cache-bytes", str(budget)]
    return Server(argv, port)


def conversation_texts(n: int, chars: int = 1200, corpus: str = "lee") -> list[str]:
    """``n`` distinct first-turn messages: consecutive passages of about ``chars`` characters
    of ``corpus`` (cut at a sentence end), each followed by a request for a summary."""
    from .data import load_text
    text = load_text(corpus)
    out, pos = [], 0
    while len(out) < n:
        if pos + chars >= len(text):
            raise ValueError(f"the {corpus} corpus holds fewer than {n} passages of {chars} characters")
        end = text.find(". ", pos + chars)
        end = len(text) if end < 0 else end + 1
        out.append(text[pos:end].strip() + "\n\nSummarize the text above in one sentence.")
        pos = end
    return out


def _chat(port: int, messages: list, max_tokens: int, timeout: float = 600) -> dict:
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
    out["latency_s"] = time.perf_counter() - t0
    return out


def _pool(jobs: list[Callable[[], dict]], clients: int) -> tuple[list[dict], float]:
    """Run ``jobs`` on ``clients`` threads (each takes the next job until none is left);
    returns their results in job order and the wall time."""
    results: list = [None] * len(jobs)
    nxt, lock = [0], threading.Lock()

    def worker():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(jobs):
                return
            try:
                results[i] = jobs[i]()
            except Exception as e:                         # a failed request is a result too
                results[i] = {"error": f"{type(e).__name__}: {e}"}
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def quantile(xs: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``xs`` (one of its values, no interpolation)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _throughput(server: Server, texts: list[str], clients: int, max_tokens: int) -> dict:
    jobs = [lambda t=t: _chat(server.port, [{"role": "user", "content": t}], max_tokens) for t in texts]
    res, wall = _pool(jobs, clients)
    ok = [r for r in res if "error" not in r]
    lat = [r["latency_s"] for r in ok]
    gen = sum(r["usage"]["completion_tokens"] for r in ok)
    return {"clients": clients, "requests": len(texts), "failed": len(res) - len(ok), "wall_s": wall,
            "requests_per_s": len(ok) / wall, "tokens_per_s": gen / wall,
            "p50_s": statistics.median(lat) if lat else None, "p95_s": quantile(lat, 0.95) if lat else None,
            "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in ok), "completion_tokens": gen}


def _capacity(server: Server, texts: list[str], max_tokens: int) -> dict:
    first = []
    for t in texts:
        msgs = [{"role": "user", "content": t}]
        r = _chat(server.port, msgs, max_tokens)
        first.append((msgs, r))
    kept = server.probe()
    hits = 0
    for msgs, r in reversed(first):                                    # newest first: LRU order
        follow = msgs + [r["choices"][0]["message"], {"role": "user", "content": "Now give it a title."}]
        r2 = _chat(server.port, follow, max_tokens)
        hits += r2["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) >= r["usage"]["prompt_tokens"]
    return {"conversations": len(texts), "kept": kept, "second_turn_hits": hits,
            "prompt_tokens_per_conversation": statistics.mean(r["usage"]["prompt_tokens"] for _, r in first)}


def _faults(server: Server, texts: list[str], max_tokens: int) -> dict:
    for t in texts:
        _chat(server.port, [{"role": "user", "content": t}], max_tokens)
    before = server.probe()
    out = {"kept_before": before}
    # 1. a client that disconnects after the first streamed chunk
    body = json.dumps({"messages": [{"role": "user", "content": texts[0] + " Explain in detail."}],
                       "max_tokens": 200, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while b"data: {" not in got:                 # read until the first generated chunk, then leave
            part = s.recv(4096)
            if not part:
                break
            got += part
        out["disconnect_got_bytes"] = len(got) if b"data: {" in got else 0
    # 2. a malformed request
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/chat/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=60)
        out["malformed_status"] = 200
    except urllib.error.HTTPError as e:
        out["malformed_status"] = e.code
    # 3. a request whose cache alone is larger than the budget
    big = " ".join(texts) * 2
    try:
        r = _chat(server.port, [{"role": "user", "content": big}], 4)
        out["oversize_prompt_tokens"] = r["usage"]["prompt_tokens"]
        out["oversize_status"] = 200
    except urllib.error.HTTPError as e:
        out["oversize_status"] = e.code
    time.sleep(1)
    out["kept_after"] = server.probe()
    out["still_serving"] = server.alive()
    return out


def run_loadtest(model: str = "smollm2-135m", *, conversations: int = 8, concurrency: tuple = (1, 4),
                 budgets: tuple = ("16MB", "48MB"), max_tokens: int = 16, chars: int = 1200,
                 cache_args: tuple = ("--bits", "4.25"), faults: bool = True,
                 kinds: tuple = ("plain", "turboquant"),
                 progress: Optional[Callable[[str], None]] = None) -> dict:
    """The load test described in the module docstring; a JSON-ready dict. ``kinds``: the
    servers measured, "plain" (mlx-lm's own caches) and/or "turboquant"."""
    if not kinds or not set(kinds) <= {"plain", "turboquant"}:
        raise ValueError(f"kinds must name 'plain' and/or 'turboquant', got {kinds!r}")
    say = progress or (lambda m: None)
    texts = conversation_texts(conversations, chars)
    label = {"plain": "mlx-lm (uncompressed)", "turboquant": f"turboquant {' '.join(cache_args)}"}
    out = {"setup": {"model": model, "conversations": conversations, "concurrency": list(concurrency),
                     "budgets": list(budgets), "max_tokens": max_tokens, "passage_chars": chars,
                     "cache_args": list(cache_args), "host": "127.0.0.1", "corpus": "lee"},
           "servers": {}}
    for kind in kinds:
        entry = {"label": label[kind], "throughput": [], "capacity": []}
        for c in concurrency:
            say(f"{label[kind]}: {conversations} requests from {c} client(s)")
            srv = start_server(model, kind, concurrency=c, cache_args=cache_args, max_tokens=max_tokens)
            try:
                _chat(srv.port, [{"role": "user", "content": PROBE}], 1)      # warm-up, not timed
                row = _throughput(srv, texts, c, max_tokens)
                row["peak_rss_bytes"] = srv.peak_rss()
                entry["throughput"].append(row)
            finally:
                srv.stop()
        for b in budgets:
            say(f"{label[kind]}: capacity within --prompt-cache-bytes {b}")
            srv = start_server(model, kind, budget=b, concurrency=1, cache_args=cache_args, max_tokens=max_tokens)
            try:
                row = _capacity(srv, texts, max_tokens)
                row["budget"] = b
                entry["capacity"].append(row)
            finally:
                srv.stop()
        out["servers"][kind] = entry
    if faults:
        say("faults against the compressed server")
        srv = start_server(model, "turboquant", budget=budgets[-1], concurrency=max(concurrency),
                           cache_args=cache_args, max_tokens=max_tokens)
        try:
            out["faults"] = _faults(srv, texts[: max(2, conversations // 2)], max_tokens)
        finally:
            srv.stop()
    return out
