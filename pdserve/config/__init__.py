"""Configuration: EngineConfig and its parts, the engine's flags generated from them, and the
checks that name the field at fault."""

from pdserve.config.cache import CacheConfig
from pdserve.config.engine import EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.config.model import ModelConfig

__all__ = ["CacheConfig", "EngineConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig"]
