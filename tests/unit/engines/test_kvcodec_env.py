"""What the gateway side hands the engine-side codec process: a PYTHONPATH with only
``kvgate/engines/kvcodec`` (never the rest of kvgate) and an offline Hugging Face environment."""

from __future__ import annotations

from pathlib import Path

import kvgate.engines.kvcodec
from kvgate.engines.kvcodec.venv import engine_env, engine_side_path


def test_engine_side_path_holds_only_the_codec_and_is_removed_after() -> None:
    with engine_side_path() as path:
        root = Path(path)
        assert sorted(p.name for p in root.iterdir()) == ["kvgate"]
        assert sorted(p.name for p in (root / "kvgate").iterdir()) == ["__init__.py", "engines"]
        engines = root / "kvgate" / "engines"
        assert sorted(p.name for p in engines.iterdir()) == ["__init__.py", "kvcodec"]
        assert (root / "kvgate" / "__init__.py").read_text() == ""
        assert (engines / "__init__.py").read_text() == ""
        codec = (engines / "kvcodec").resolve()
        assert codec == Path(kvgate.engines.kvcodec.__file__).resolve().parent
        env = engine_env(path)
        assert env["PYTHONPATH"] == path
        assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert not root.exists()
