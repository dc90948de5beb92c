"""Model families. Each one is a module with:

    parse_config(d: dict) -> Config      # from a checkpoint's config.json (its own keys and HF forms)
    build_graph(cfg: Config, **opts) -> deepinfer.ir.Graph

and presets (config.json dicts) come from ``models.presets.preset_config(model, preset)``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from deepinfer.errors import ConfigError

MODEL_MODULES = {
    "deepseek-v4.1-flash": "deepinfer.models.deepseek_v41",
    "deepseek-v4-flash": "deepinfer.models.deepseek_v4",
}
DEFAULT_MODEL = "deepseek-v4.1-flash"


def get_model(name: str) -> ModuleType:
    """The module implementing a model family, by its CLI name."""
    try:
        return importlib.import_module(MODEL_MODULES[name])
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(MODEL_MODULES)}") from None
