"""The functional decoders (docs/design.md §4). Importing the package registers every architecture
(models/registry.py); each module below adds its own."""

from . import gemma2, llama, qwen  # noqa: F401 (each registers its architecture)
