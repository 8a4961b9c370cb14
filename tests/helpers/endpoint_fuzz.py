"""A seeded fuzz run over some endpoints of a real server (the pooling ones, the Responses API,
/tokenize): random JSON values in each endpoint's fields (and a bogus one), sent 8 at a time; no
5xx, every error in the OpenAI shape, and afterwards no request left in the front-end and every
KV block free."""

from __future__ import annotations

import asyncio
import json
import random

from helpers.server import API_KEY, wait_for


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(10)
    if kind == 0:
        return rng.choice([0, 1, -1, 3, 2**31, 2**63, -(2**63) - 1, 10**30])
    if kind == 1:
        return rng.choice([0.5, -0.1, 1e39, 1e300, 5e-324])
    if kind == 2:
        return "".join(chr(rng.randint(0x20, 0x2FF)) for _ in range(rng.randint(0, 30)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4 and depth < 3:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == 5 and depth < 3:
        return {rng.choice(["text", "x", ""]): random_value(rng, depth + 1)}
    if kind == 6:
        return [rng.randint(-5, 60000) for _ in range(rng.randint(0, 6))]
    return rng.choice(["Hello", "Paris", "", " ", "\u0000", ["a", "b"], [[1, 2], [3]]])


def fuzz_endpoints(server, endpoints: dict[str, tuple[dict, list[str]]], seed: int, count: int = 150,
                           ) -> dict[int, int]:
    """``endpoints``: path -> (a valid body, the fields to fill with random values). Returns the
    count of each status; raises AssertionError on a 5xx, a malformed error or a leak."""
    import httpx

    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        path = rng.choice(list(endpoints))
        valid, fields = endpoints[path]
        body = dict(valid)
        for name in rng.sample(fields, rng.randint(0, min(3, len(fields)))):
            body[name] = random_value(rng)
        requests.append((path, json.dumps(body).encode()))
    failures, statuses = [], {}

    async def main():
        limit = asyncio.Semaphore(8)
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            async def one(path, content):
                async with limit:
                    r = await client.post(path, content=content, headers=headers)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code >= 500:
                    failures.append(f"{path} {content[:200]!r}: {r.status_code} {r.text[:300]}")
                elif r.status_code != 200 and set(r.json()["error"]) != {"message", "type", "param", "code"}:
                    failures.append(f"{path}: error shape {r.text[:300]}")

            await asyncio.gather(*[one(*req) for req in requests])

    asyncio.run(main())
    assert not failures, failures[:5]
    wait_for(lambda: (d := server.debug())["front_end_unfinished_requests"] == 0
             and d["core"]["num_free_blocks"] == d["core"]["num_blocks"], 30, "every block free")
    return statuses
