"""tokenmill's engine: ``from engine import LLM, SamplingParams``.

Importing this package stays cheap (no torch): frontends import
``engine.protocol`` through it, so the heavy parts load on first use.
"""

from engine.beam_search import BeamSearchParams
from engine.config import EngineConfig
from engine.protocol import SamplingParams

__all__ = ["BeamSearchParams", "LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        from engine import llm

        return getattr(llm, name)
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    raise AttributeError(name)
