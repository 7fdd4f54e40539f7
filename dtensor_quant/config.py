"""Every environment variable the library reads, in one table (``dq.config``); the README lists it too."""

from ._core.config import SETTINGS, ConfigError, Setting, describe, get

__all__ = ["SETTINGS", "ConfigError", "Setting", "describe", "get"]
