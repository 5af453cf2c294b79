"""Models and their caches: what a run trains and where it comes from.

- ``loading``: the built-in byte-level tokenizer and tiny causal LM, ``load_model`` (a
  folder, a Hub name or a built-in name) and ``default_model``;
- ``access``: a causal LM's decoder, last hidden states, LM head and logit transform, for
  every caller (the trainer, the replay, the integrations);
- ``builtin``: the registry of built-in pretrained models and the cache directory;
- ``pretrained``: their offline conversion; ``folder``: a saved model folder, written
  once under a lock and checked; ``initial``: the folder a run starts from;
- ``warm_start``: the supervised warm start on a task's references.

The names of ``mrtpo.model.loading`` import from here too (``from mrtpo.model import
load_model``, the path the docs and README use).
"""

from __future__ import annotations

from mrtpo._lazy import lazy_exports

_LOADING = (
    "CHAT_TEMPLATE LOGIT_SCALE_FIELDS SOFTCAP_FIELD SPECIAL_TOKENS UNSUPPORTED_LOGIT_FIELDS"
    " WARM_MARKER TinyConfig build_tiny_model build_tokenizer count_parameters decoder"
    " decoder_layers default_model gradient_checkpointing last_hidden lm_head load_model"
    " logit_transform same_training save_model supervised_batch task_texts train_digest"
    " warm_start"
)
_EXPORTS = dict.fromkeys(_LOADING.split(), "loading")
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
