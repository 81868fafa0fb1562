"""Fake ``moe_infinity.utils``."""

from moe_infinity.utils.config import ArcherConfig

__all__ = ["ArcherConfig"]
