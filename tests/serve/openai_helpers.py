"""What the server tests that go through the official ``openai`` client share: the client, a
choice's ``naf`` certificate object, and a key's balance (``GET /v1/budget``)."""

from __future__ import annotations

import httpx


def client(url: str, key: str = "unused"):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def naf(choice) -> dict:
    return choice.model_extra["naf"]


def balance(url: str, key: str) -> dict:
    r = httpx.get(url + "/v1/budget", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()
