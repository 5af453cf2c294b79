"""Import stub; every function raises when called."""

from flash_attn import _unavailable

all_gather = _unavailable("utils.distributed.all_gather")
