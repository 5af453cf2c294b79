"""mrtpo: a thin MRTPO training loop on Hugging Face transformers, built on mrtpo_kernels.

Uses only the public API of mrtpo_kernels.
"""

__version__ = "0.1.0"
