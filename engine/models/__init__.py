"""Model definitions written for paged attention, and the registry of supported architectures."""

from engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig"]
