"""Use the cache-worthiness policy with the ``openai`` client against a server running
``--radix-cache-backend tiered`` (e.g. ``SGLANG_ARGS=--enable-cache-report make serve``: without
``--enable-cache-report`` SGLang reports no ``cached_tokens`` and this prints None).

    .venv/bin/python examples/openai_client.py --base-url http://127.0.0.1:30000/v1
"""

import argparse

from openai import OpenAI

from sglang_tiered.client import KVCacheLayeringPolicy, fold_kv_hint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    ap.add_argument("--api-key", default="EMPTY")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    policy = KVCacheLayeringPolicy()
    system = "You are a meticulous assistant for the cache team. " * 90  # ~1.2k tokens: shared
    calls = [
        ("one-off", None, "What is two plus two?"),  # short single shot: skip_save
        ("shared system prompt", system, "Summarise the design."),  # long prefix: store
        ("shared system prompt again", system, "List three risks."),  # reuses the stored prefix
    ]
    for label, sys_prompt, user in calls:
        decision = policy.decide(system_prompt=sys_prompt, user_prompt=user)
        messages = ([{"role": "system", "content": sys_prompt}] if sys_prompt else []) + [
            {"role": "user", "content": user}
        ]
        resp = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=args.max_tokens,
            temperature=0,
            extra_body=fold_kv_hint({"cache_salt": "example-tenant"}, decision),
        )
        cached = getattr(getattr(resp.usage, "prompt_tokens_details", None), "cached_tokens", None)
        print(f"{label:28s} skip_save={decision.skip_save!s:5s} prompt_tokens={resp.usage.prompt_tokens} "
              f"cached_tokens={cached} reasons={decision.reasons}")  # fmt: skip


if __name__ == "__main__":
    main()
