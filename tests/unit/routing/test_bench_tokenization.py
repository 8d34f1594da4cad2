"""bench/tokenization.py runs end to end and writes its JSON (a smoke run, no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import tokenization

FIGURES = {"encode", "chat_cold", "chat_next_turn", "loop_blocked_inline",
           "loop_blocked_offloaded"}


def test_quick_run_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "tok.json"
    assert tokenization.main(["--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "tokenization" and doc["command"].endswith(f"--out {out}")
    names = [b["backend"] for b in doc["backends"]]
    assert names == ["sim tokenizer (pure Python)", "HF byte-level BPE, vocab 4096"]
    for backend in doc["backends"]:
        assert 1_500 <= backend["tokens"] <= 2_500  # --quick measures ~2k tokens
        assert set(backend["us_per_10k_tokens"]) == FIGURES
        assert all(v > 0 for v in backend["us_per_10k_tokens"].values())
    assert set(doc["hashing"]["block_hash_us_per_10k_tokens"]) == {"16", "64", "128"}
    assert doc["hashing"]["index_match_us"] > 0
