"""The gateway's prefix cache in a KV pool too small for it, on the embedded SmolLM2: every
cache entry shares the system prompt's pages with the requests in flight, and entries must
still be dropped to make room, so that a stream of distinct prompts all finish (none refused
with kv_no_space) and the cache keeps serving the shared system prompt."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from conftest import KernelProc
from .test_gateway import free_port, wait_for_gateway

SYSTEM = "You answer questions about invented towns. " + " ".join(
    f"Town {i} has {i * 7 % 13 + 2} bridges and a market on day {i % 7 + 1}." for i in range(1, 9))


def test_distinct_prompts_in_a_full_pool_all_finish_and_the_cache_drops_entries(tmp_path):
    port = free_port()
    # ~1,100 tokens of float32 KV, no host tier, the whole pool to one user: a few prompts fill it,
    # and only dropping entries makes room
    k = KernelProc(tmp_path, "--http", f"127.0.0.1:{port}", "--kv-memory-mb", "48", "--host-pages", "0",
                   "--user-quota", "100%")
    try:
        wait_for_gateway(k)
        url = f"http://127.0.0.1:{port}"
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]

        def one(i):
            body = {"model": model, "temperature": 0, "max_tokens": 8, "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"Report {i}: " + " ".join(
                                     f"item {i}-{j} weighs {(i * 31 + j) % 97} grams." for j in range(12))
                                  + " Which item is the heaviest?"}]}
            errors, text, usage = [], [], None
            with httpx.Client(timeout=300) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        d = json.loads(line[6:])
                        errors += [d["error"]] if d.get("error") else []
                        text += [(ch.get("delta") or {}).get("content") or "" for ch in d.get("choices", [])]
                        usage = d.get("usage") or usage
            return errors, "".join(text), usage

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(one, range(28)))
        assert [e for e, _, _ in got if e] == []
        assert all(text and usage for _, text, usage in got)
        cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for _, _, u in got]
        assert sum(1 for c in cached[8:] if c >= 16) >= 15           # the system prompt still found
        stats = k.client().stats()
        assert stats["cache_drops"] > 0, stats
    finally:
        k.stop()

