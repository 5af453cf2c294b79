"""Import stub; every function raises when called."""

from vllm import _unavailable

random_uuid = _unavailable("utils.random_uuid")
