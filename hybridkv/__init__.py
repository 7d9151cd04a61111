"""hybridkv: an inference engine for hybrid LLMs.

Its paged cache decouples the page the cache manager allocates from the kernel block an attention
kernel indexes (see DESIGN.md). Heavy parts import lazily so that `hybridkv plan` needs no torch.
"""

__version__ = "0.1.0"
