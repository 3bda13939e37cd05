"""fastgen: a small, fast LLM inference engine (paged KV cache, prefix caching, continuous
batching, CUDA graphs for decode)."""

from fastgen.background import BackgroundEngine, RequestStream
from fastgen.config import EngineConfig
from fastgen.engine import LLMEngine
from fastgen.llm import LLM
from fastgen.outputs import RequestMetrics, RequestOutput
from fastgen.sampling_params import SamplingParams

__all__ = ["LLM", "BackgroundEngine", "RequestStream", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestMetrics"]
__version__ = "0.1.0"
