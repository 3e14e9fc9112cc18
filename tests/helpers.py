"""Paths and small builders shared by tests."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).parent / "data"
REAL_MODELS = DATA / "models"
QWEN3_30B = REAL_MODELS / "qwen3-30b-a3b"
QWEN3_6_35B = REAL_MODELS / "qwen3.6-35b-a3b"
