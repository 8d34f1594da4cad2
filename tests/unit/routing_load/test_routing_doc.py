"""docs/routing.md stays true: its default-preset block is what the quick start builds, and its
worked example is what the real kv-placement-scorer computes, row by row."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.quickstart import QuickStart, quick_start_config
from kvgate.middleware.framework.types import (
    Api,
    CycleState,
    Endpoint,
    EngineMetrics,
    InferenceRequest,
    RoutingDecision,
)
from kvgate.plugins.common.state import PREFIX_MATCH, SESSION_KEY, TOKEN_IDS, PrefixMatch
from kvgate.plugins.placement.scorer import KvPlacementScorer
from kvgate.plugins.placement.state import PLACEMENT as PLACEMENT_KEY
from tests.unit.routing_load.helpers import Lookup

DOC = Path(__file__).resolve().parents[3] / "docs" / "routing.md"
TOKENIZER = "/models/llama-3.1-8b-instruct"


def _block(marker: str, fence: str) -> str:
    match = re.search(rf"<!-- {marker}.*?-->\n{fence}(.*?)(?:```|\n\n)", DOC.read_text(), re.S)
    assert match, f"docs/routing.md lost its {marker} block"
    return match.group(1)


def test_default_preset_block_is_what_the_quick_start_builds() -> None:
    documented = parse_config(yaml.safe_load(_block("default-profile", "```yaml\n")), "doc")
    built = quick_start_config(QuickStart(
        engines=("http://10.0.0.1:8000", "http://10.0.0.2:8000"), kv_events=("tcp://*:5557",),
        tokenizer=TOKENIZER))
    assert documented.plugins == built.plugins
    assert documented.profiles == built.profiles
    assert [(e.name, e.url, e.kv_events) for e in documented.engines] == [
        (e.name, e.url, e.kv_events) for e in built.engines]


def _number(cell: str) -> float:
    return float(cell.replace(",", "").split()[0])


def _rows() -> list[dict[str, Any]]:
    rows = []
    for line in _block("worked-example", "").splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        held = [_number(x) for x in cells[2].split("/")]
        pressure = [_number(x) for x in cells[3].split("/")]
        rows.append({"session": cells[0].split(",")[0], "prompt": int(_number(cells[1])),
                     "held": {"e0": int(held[0]), "e1": int(held[1])},
                     "pressure": {"e0": pressure[0], "e1": pressure[1]},
                     "costs": {"e0": _number(cells[4]), "e1": _number(cells[5])},
                     "target": cells[6].split()[0]})
    return rows


def _request(i: int, prompt: int) -> InferenceRequest:
    return InferenceRequest(
        request_id=str(i), api=Api.CHAT, model="m", body={"max_tokens": 32}, headers={},
        stream=False, client_wants_usage=False, prompt_token_estimate=prompt, received_at=0.0)


async def test_worked_example_is_what_the_plugin_computes() -> None:
    rows = _rows()
    assert len(rows) == 5
    metrics = EngineMetrics(extra={"kv_capacity_tokens": 16_384.0})
    eps = [Endpoint(id=f"e{i}", url=f"http://e{i}", kind="vllm", metrics=metrics)
           for i in range(2)]
    scorer = KvPlacementScorer("kv-placement-scorer", KvPlacementScorer.Params(), Lookup())
    for i, row in enumerate(rows):
        state = CycleState()
        state.put(TOKEN_IDS, tuple(range(row["prompt"])))
        state.put(PREFIX_MATCH, PrefixMatch(row["prompt"], row["held"], {}, True))
        state.put(SESSION_KEY, row["session"])
        pressure = {ep.id: round(scorer.pressure(ep), 3) for ep in eps}
        scores = scorer.score(_request(i, row["prompt"]), state, eps)
        placement = state.get(PLACEMENT_KEY)
        assert placement is not None
        assert pressure == row["pressure"], row
        assert {e: round(c) for e, c in placement.costs.items()} == row["costs"], row
        best = [e for e, s in scores.items() if s == 1.0]
        assert row["target"] in best and (len(best) == 1 or i == 0), row
        target = eps[int(row["target"][1])]
        await scorer.before_dispatch(_request(i, row["prompt"]), state,
                                     RoutingDecision(target=target))


@pytest.mark.parametrize("link", ["plugins/placement.md", "plugins/kv-events.md",
                                  "plugins/prefix-cache.md"])
def test_linked_pages_exist(link: str) -> None:
    assert link in DOC.read_text()
    assert (DOC.parent / link).is_file()
