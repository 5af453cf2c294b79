"""Import stub; every function raises when called."""

from vllm import _unavailable

TokensPrompt = _unavailable("inputs.TokensPrompt")
