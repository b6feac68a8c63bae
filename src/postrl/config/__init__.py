"""The validated run configuration: one model per component, loaded from YAML with overrides."""

from postrl.config.run import ConfigError, RunConfig, load_config

__all__ = ["ConfigError", "RunConfig", "load_config"]
