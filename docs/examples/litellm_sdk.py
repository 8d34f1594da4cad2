"""kvgate as a LiteLLM provider, from the LiteLLM SDK (docs/litellm.md).

kvgate speaks OpenAI's API, so LiteLLM reaches any kvgate model as ``openai/<model>`` with
``api_base`` pointing at kvgate. The session header is sent on every call of a session (kvgate
keys its cache affinity on it), and LiteLLM prices the answer with kvgate's own price map
(``kvgate usage litellm-prices --prices prices.yaml --out kvgate-prices.json``), so
``litellm.completion_cost`` equals the cost in kvgate's ledger (for tenants without a discount).

    export KVGATE_API_KEY=kvg-...
    python docs/examples/litellm_sdk.py --base-url http://127.0.0.1:8080 \
        --prices kvgate-prices.json --model sim-model --session ses_demo "Hello"
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def litellm_module() -> Any:
    """LiteLLM with its bundled price map (no network at import)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    return litellm


def register_kvgate_prices(path: str) -> None:
    """Teach LiteLLM kvgate's prices (the exported LiteLLM price map)."""
    with open(path, encoding="utf-8") as f:
        litellm_module().register_model(json.load(f))


def ask(base_url: str, api_key: str, model: str, session: str,
        messages: list[dict[str, Any]], **params: Any) -> tuple[Any, float]:
    """One chat completion through kvgate; returns the response and LiteLLM's cost (USD)."""
    litellm = litellm_module()
    response = litellm.completion(
        model=f"openai/{model}",                       # kvgate is OpenAI-compatible
        api_base=f"{base_url.rstrip('/')}/v1",
        api_key=api_key,
        messages=messages,
        extra_headers={"x-session-affinity": session},  # same value for a whole session
        **params,
    )
    return response, litellm.completion_cost(completion_response=response)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8080")
    parser.add_argument("--prices", required=True, help="kvgate's exported LiteLLM price map")
    parser.add_argument("--model", default="sim-model")
    parser.add_argument("--session", default="ses_demo")
    parser.add_argument("prompt", nargs="?", default="Hello")
    args = parser.parse_args(argv)
    register_kvgate_prices(args.prices)
    response, cost = ask(args.base_url, os.environ["KVGATE_API_KEY"], args.model,
                         args.session, [{"role": "user", "content": args.prompt}])
    print(response.choices[0].message.content)
    print(f"usage: {response.usage}")
    print(f"cost (LiteLLM, kvgate prices): ${cost:.10f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
