"""The validated run configuration: one model per component, loaded from YAML with overrides."""

from postrl.config.loading import load_config
from postrl.config.run import ConfigError, RunConfig

__all__ = ["ConfigError", "RunConfig", "load_config"]
