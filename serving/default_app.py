"""configs/local.yaml's app as an importable `Application`, the form Serve's own tools take:
`serve build serving.default_app:app` writes a Serve config of its deployments, and
`serve run serving.default_app:app` runs it. Config files name `serving.app:app_builder`
with their args instead; this module builds the app from the repository's file when
imported."""

from __future__ import annotations

from pathlib import Path

from serving.app import build_app
from serving.app_config import load_config

CONFIG_FILE = Path(__file__).resolve().parents[1] / "configs" / "local.yaml"

app = build_app(load_config(CONFIG_FILE))
