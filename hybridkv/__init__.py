"""hybridkv: an inference engine for hybrid LLMs.

Its paged cache decouples the page the cache manager allocates from the kernel block an attention
kernel indexes (see the README). Heavy parts import lazily: `hybridkv plan` imports torch only
for the families hybridkv runs, whose cache it collects from the model built on the meta device.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from hybridkv.entrypoints.llm import LLM
    from hybridkv.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from hybridkv.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from hybridkv.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'hybridkv' has no attribute {name!r}")
