"""Pieces shared by the TRL, verl and OpenRLHF adapters.

Everything here works on plain tensors in the layouts those trainers keep (padded (B, T)
responses with a 0/1 mask) and uses only the public API of ``mrtpo_kernels``. No trainer
framework is imported here; ``require`` imports one lazily where an adapter needs it.

Layouts:
    B responses (rows), T response positions (padded), d hidden size, V vocabulary,
    K rewards (one per verifier). Relevance is (K, B, T), reward k's JS distance at each
    response token, 0 at padding.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import numpy as np
import torch

from mrtpo_kernels import (
    AdvantageSettings,
    TokenAdvantages,
    advantage_settings,
    check_tensor,
    linear_js_distance,
    mrtpo_token_advantages,
)

__all__ = [
    "config_value",
    "consecutive_group_ids",
    "group_ids_from_index",
    "has_info_from_spans",
    "padded_from_packed",
    "padded_token_advantages",
    "relevance_from_hidden",
    "require",
]


# --------------------------------------------------------------------------- checks


def check_shape(name: str, t: torch.Tensor, shape, what: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({what}), got {tuple(t.shape)}")


def check_num_rewards(rewards: torch.Tensor, relevance: torch.Tensor, has_info: torch.Tensor):
    """The same K in rewards (B, K), relevance (K, B, T) and has_info (B, K)."""
    k = rewards.shape[1]
    if relevance.shape[0] != k:
        raise ValueError(
            f"relevance: expected K = {k} rewards in dimension 0 (from rewards (B, K)), "
            f"got {relevance.shape[0]} (relevance is (K, B, T))"
        )
    if has_info.dim() != 2 or has_info.shape[1] != k:
        raise ValueError(
            f"has_info: expected shape ({rewards.shape[0]}, {k}) (B, K like rewards), "
            f"got {tuple(has_info.shape)}"
        )


def check_padded_inputs(rewards, mask, relevance, has_info, *, mask_name: str):
    """Common checks of the padded adapters; returns B, K, T."""
    check_tensor("rewards", rewards, ndim=2, floating=True)
    check_tensor(mask_name, mask, ndim=2)
    check_tensor("relevance", relevance, ndim=3, floating=True)
    check_tensor("has_info", has_info, ndim=2)
    b, k = rewards.shape
    t = mask.shape[1]
    if mask.shape[0] != b:
        raise ValueError(
            f"{mask_name}: expected {b} rows (one per response, from rewards (B, K)), "
            f"got shape {tuple(mask.shape)}"
        )
    check_num_rewards(rewards, relevance, has_info)
    check_shape("relevance", relevance, (k, b, t), f"(K, B, T) with T from {mask_name}")
    return b, k, t


# --------------------------------------------------------------------------- imports


def require(package: str, feature: str):
    """Import ``package`` (a trainer framework) or raise an ImportError that names it."""
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        top = package.split(".")[0]
        raise ImportError(
            f"{feature} needs the '{top}' package, which is not importable here "
            f"({exc}). Install it, or use the standalone functions of "
            f"mrtpo.integrations, which need no framework."
        ) from exc


def config_value(config, key: str, default):
    """``config[key]`` of a mapping (an OmegaConf DictConfig, a dict) or ``config.key`` of
    any other object; ``default`` where the config is None or the value is None or absent."""
    if config is None:
        return default
    value = config.get(key, None) if hasattr(config, "get") else getattr(config, key, None)
    return default if value is None else value


# --------------------------------------------------------------------------- groups


def group_ids_from_index(index, device=None) -> torch.Tensor:
    """(B,) int64 group ids from per-sample group keys, numbered in order of first
    appearance. ``index`` may be a numpy array (verl keeps uid strings in an object
    array), a list of hashable keys, or an integer tensor."""
    if isinstance(index, torch.Tensor):
        if index.dim() != 1:
            raise ValueError(f"index: expected a 1-D tensor, got shape {tuple(index.shape)}")
        if index.dtype.is_floating_point or index.dtype == torch.bool:
            raise ValueError(f"index: expected integer group ids, got {index.dtype}")
        keys = index.tolist()
    elif isinstance(index, np.ndarray):
        if index.ndim != 1:
            raise ValueError(f"index: expected a 1-D array, got shape {index.shape}")
        keys = index.tolist()
    elif isinstance(index, Sequence) and not isinstance(index, (str, bytes)):
        keys = list(index)
    else:
        raise ValueError(
            f"index: expected a 1-D numpy array, list or tensor of group keys, "
            f"got {type(index).__name__}"
        )
    ids: dict = {}
    try:
        out = [ids.setdefault(key, len(ids)) for key in keys]
    except TypeError as exc:
        raise ValueError(f"index: group keys must be hashable ({exc})") from exc
    return torch.tensor(out, dtype=torch.long, device=device)


def consecutive_group_ids(batch_size: int, group_size: int, device=None) -> torch.Tensor:
    """(B,) group ids when every ``group_size`` consecutive samples share a prompt, as TRL
    (``num_generations``) and OpenRLHF (``n_samples_per_prompt``) order them."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group size: expected a positive int, got {group_size!r}")
    if batch_size % group_size:
        raise ValueError(
            f"group size: the batch of {batch_size} samples is not a whole number of groups "
            f"of {group_size} consecutive samples"
        )
    return torch.arange(batch_size, device=device) // group_size


# --------------------------------------------------------------------------- spans


def has_info_from_spans(spans, *, num_rewards: int | None = None, device=None) -> torch.Tensor:
    """(B, K) bool: whether reward k's verifier named any prompt span for sample i.

    Args:
        spans: per sample, per reward, a list of (start, end) character spans of the prompt
            (empty where the verifier checks no specific part). The same K for every sample.
        num_rewards: K, checked against every sample when given (needed when B = 0).
    """
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence):
        raise ValueError(
            f"spans: expected a list (per sample) of lists (per reward) of spans, "
            f"got {type(spans).__name__}"
        )
    rows = []
    for i, per_reward in enumerate(spans):
        if isinstance(per_reward, (str, bytes)) or not isinstance(per_reward, Sequence):
            raise ValueError(f"spans: sample {i}: expected a list of per-reward span lists")
        k = num_rewards if num_rewards is not None else len(spans[0])
        if len(per_reward) != k:
            raise ValueError(
                f"spans: sample {i} has {len(per_reward)} rewards, expected K = {k}"
                + (" (num_rewards)" if num_rewards is not None else " (like sample 0)")
            )
        rows.append([bool(s) for s in per_reward])  # None or [] means no spans
    k = num_rewards if num_rewards is not None else (len(spans[0]) if len(spans) else 0)
    if not rows:
        return torch.zeros((0, k), dtype=torch.bool, device=device)
    return torch.tensor(rows, dtype=torch.bool, device=device).reshape(len(rows), k)


# --------------------------------------------------------------------------- relevance


def padded_from_packed(values: torch.Tensor, mask: torch.Tensor, *, fill: float = 0.0):
    """Scatter packed per-token values (..., N) into a padded (..., B, T) tensor.

    Tokens are taken in row-major order of the 1 entries of ``mask`` (B, T), which is how
    ``mrtpo.replay.api.contrastive_replay`` packs its (K, N) relevance for right-padded
    responses; ``fill`` goes everywhere else.
    """
    check_tensor("values", values, ndim=(1, 2))
    check_tensor("mask", mask, ndim=2)
    m = mask.to(device=values.device).bool()
    n = int(m.sum())
    if values.shape[-1] != n:
        raise ValueError(
            f"values: expected {n} tokens in the last dimension (the 1 entries of mask), "
            f"got {values.shape[-1]}"
        )
    out = values.new_full(tuple(values.shape[:-1]) + tuple(m.shape), fill)
    out[..., m] = values
    return out


@torch.no_grad()
def relevance_from_hidden(
    hidden_with_info: torch.Tensor,
    hidden_without_info: torch.Tensor,
    lm_head_weight: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float,
    lm_head_bias: torch.Tensor | None = None,
    has_info: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token relevance d_k (METHOD.md section 3) from padded teacher-forced hidden states.

    Only the tokens where ``response_mask`` is 1 go through the LM head (one-vs-many: P's
    logits once per token chunk, compared with each of the K streams), so padding costs
    nothing. With ``has_info``, responses without any verifier span are skipped too.

    Args:
        hidden_with_info: (B, T, d) hidden states that predict response token t after the
            full prompt (the old-log-prob forward).
        hidden_without_info: (K, B, T, d), the same after the prompt with reward k's spans
            removed (rows of a reward without spans may repeat ``hidden_with_info``).
        lm_head_weight: (V, d); lm_head_bias: optional (V,).
        response_mask: (B, T), 1 on response tokens.
        temperature: the sampling temperature.
        has_info: optional (B, K) bool from ``has_info_from_spans``.

    Returns:
        (K, B, T) float32 in [0, 1], 0 at padding (and where ``has_info`` is False).
    """
    check_tensor("hidden_with_info", hidden_with_info, ndim=3, floating=True)
    check_tensor("hidden_without_info", hidden_without_info, ndim=4, floating=True)
    check_tensor("response_mask", response_mask, ndim=2)
    b, t, d = hidden_with_info.shape
    k = hidden_without_info.shape[0]
    check_shape("hidden_without_info", hidden_without_info, (k, b, t, d), "(K, B, T, d)")
    check_shape("response_mask", response_mask, (b, t), "(B, T) from hidden_with_info")
    if response_mask.device != hidden_with_info.device:
        raise ValueError(
            f"response_mask: expected a tensor on {hidden_with_info.device} "
            f"(like hidden_with_info), got {response_mask.device}"
        )
    mask = response_mask.bool()
    if has_info is not None:
        check_tensor("has_info", has_info, ndim=2)
        check_shape("has_info", has_info, (b, k), "(B, K) with K from hidden_without_info")
        has_info = has_info.to(device=mask.device, dtype=torch.bool)
        mask = mask & has_info.any(dim=1, keepdim=True)
    out = torch.zeros((k, b, t), dtype=torch.float32, device=hidden_with_info.device)
    if not bool(mask.any()):
        return out
    d_packed = linear_js_distance(
        hidden_with_info[mask],
        hidden_without_info[:, mask],
        lm_head_weight,
        bias=lm_head_bias,
        temperature=temperature,
    )
    out[:, mask] = d_packed
    if has_info is not None:
        out = out * has_info.t().unsqueeze(-1).to(out.dtype)
    return out


# --------------------------------------------------------------------------- advantages


def padded_token_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    relevance: torch.Tensor,
    has_info: torch.Tensor,
    *,
    mask_name: str = "response_mask",
    weights: torch.Tensor | None = None,
    settings: AdvantageSettings | None = None,
    **options,
) -> TokenAdvantages:
    """``mrtpo_token_advantages`` on padded (B, T) responses, tolerating empty rows.

    Trainers keep rows whose mask is all 0 (TRL masks truncated completions that way); such a
    row still takes part in its group's reward statistics but has no token to carry an
    advantage. It is passed to the library with one placeholder token of relevance 0 (whatever
    its padding holds) and no verifier spans (so nothing about it is reallocated), and comes
    back as a row of zeros. Under
    ``batch_norm="token"`` an empty row would weigh 1 instead of 0, so there it is an error.

    ``settings`` (an ``AdvantageSettings``, default ``ADVANTAGE_DEFAULTS``) with ``options``
    (its fields as keywords: alpha, gamma, eps, eps_batch, batch_norm, delta, clip, nan,
    scale_rewards) put over it: checked once (``mrtpo_kernels.advantage_settings``) and
    handed to ``mrtpo_token_advantages`` as one value.

    Returns the library's TokenAdvantages; ``token`` is (B, T), 0 wherever ``mask`` is 0.
    """
    s = advantage_settings(settings, options, where="padded_token_advantages")
    check_padded_inputs(rewards, mask, relevance, has_info, mask_name=mask_name)
    if weights is not None and not isinstance(weights, torch.Tensor):
        weights = torch.as_tensor(weights, dtype=rewards.dtype, device=rewards.device)
    m = mask.to(device=rewards.device).bool()
    has_info = has_info.to(device=rewards.device).bool()
    empty = ~m.any(dim=1)
    if m.shape[1] == 0:
        raise ValueError(f"{mask_name}: expected at least one response position (T >= 1)")
    if bool(empty.any()):
        if s.batch_norm == "token":
            raise ValueError(
                f"{mask_name}: response {int(empty.nonzero()[0])} has no valid token, which "
                "batch_norm='token' cannot weigh; use batch_norm='sequence'"
            )
        m = m.clone()
        m[empty, 0] = True
        has_info = has_info & ~empty[:, None]
        # the placeholder reads the row's padding, whose values are not the caller's to keep
        # clean (NaN or negative there must not fail the step): it gets relevance 0
        relevance = relevance.clone()
        relevance[:, empty.to(relevance.device), 0] = 0
    out = mrtpo_token_advantages(
        rewards,
        group_ids.to(rewards.device),
        relevance,
        has_info=has_info,
        response_mask=m,
        weights=weights,
        settings=s,
    )
    keep = mask.to(device=rewards.device).bool()
    token = torch.where(keep, out.token, torch.zeros_like(out.token))
    return out._replace(token=token)
