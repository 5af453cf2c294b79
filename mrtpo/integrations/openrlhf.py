"""OpenRLHF adapter: MRTPO token advantages from the experience tensors.

OpenRLHF's experience maker samples ``n_samples_per_prompt`` consecutive responses per
prompt, keeps an ``action_mask`` (B, T) over the response tokens and the sequence-level
reward of each sample in ``experience.rewards`` (which its advantage estimators read);
its group estimators ("group_norm", "dr_grpo", ...) normalize rewards
within each run of ``n_samples_per_prompt`` samples and then spread the result over the
action tokens. MRTPO takes the K verifier rewards (B, K) instead of the single reward, and
returns the (B, T) token advantages to store as ``experience.advantages`` (and as the
returns, for an outcome-only estimator). Concatenate the rewards of every experience of a
step first (``torch.cat`` over the micro-batches) so that whole groups are normalized
together, then split the result back. Nothing here imports OpenRLHF.
"""

from __future__ import annotations

import torch

from mrtpo_kernels import AdvantageSettings, advantage_settings

from .common import (
    check_shape,
    check_tensor,
    consecutive_group_ids,
    padded_token_advantages,
)

__all__ = [
    "mrtpo_token_advantages_for_experiences",
    "mrtpo_token_advantages_from_experience",
    "relevance_for_experience",
    "replay_masks_for_experiences",
    "rollout_group_ids",
]


def rollout_group_ids(index, batch_size: int, n_samples_per_prompt: int) -> torch.Tensor:
    """(B,) group ids from OpenRLHF's ``experience.index`` (rollout positions).

    OpenRLHF samples ``n_samples_per_prompt`` consecutive responses per prompt and numbers
    the rollout samples 0 .. B-1 in that order; its group norm puts the rewards back in that
    order (``rewards[indices] = ...``) and groups rows of ``n_samples_per_prompt``. So row i
    belongs to group ``index[i] // n_samples_per_prompt``. ``index`` must hold each of
    0 .. batch_size-1 once (a list, numpy array or integer tensor).
    """
    consecutive_group_ids(batch_size, n_samples_per_prompt)  # checks the group size
    if isinstance(index, torch.Tensor):
        if index.dtype.is_floating_point or index.dtype == torch.bool or index.dim() != 1:
            raise ValueError(
                f"index: expected a 1-D integer tensor, got {index.dtype} {tuple(index.shape)}"
            )
        keys = index.tolist()
    else:
        keys = list(index.tolist() if hasattr(index, "tolist") else index)
    if any(isinstance(k, bool) or not isinstance(k, int) for k in keys):
        raise ValueError("index: expected integer rollout positions (experience.index)")
    if sorted(keys) != list(range(batch_size)):
        raise ValueError(
            f"index: expected each rollout position 0 .. {batch_size - 1} once (OpenRLHF's "
            f"experience.index over the whole step), got {len(keys)} entries"
            + (f" with min {min(keys)}, max {max(keys)}" if keys else "")
        )
    return torch.tensor(keys, dtype=torch.long) // n_samples_per_prompt


@torch.no_grad()
def mrtpo_token_advantages_from_experience(
    rewards: torch.Tensor,
    n_samples_per_prompt: int,
    action_mask: torch.Tensor,
    relevance: torch.Tensor,
    has_info: torch.Tensor,
    *,
    reward_weights: torch.Tensor | None = None,
    index=None,
    settings: AdvantageSettings | None = None,
    **options,
) -> torch.Tensor:
    """(B, T) MRTPO token advantages for OpenRLHF experiences.

    Args:
        rewards: (B, K) sequence-level rewards, one column per verifier.
        n_samples_per_prompt: G; samples g*G .. g*G+G-1 answer the same prompt.
        action_mask: (B, T), 1 on response (action) tokens.
        relevance: (K, B, T) per-token relevance (``relevance_from_hidden``).
        has_info: (B, K) bool, whether reward k's verifier names spans of sample i's prompt.
        reward_weights: optional (K,) lambda_k (``mrtpo_token_advantages``'s ``weights``).
        index: optional (B,) position of each row in the rollout order, OpenRLHF's
            ``experience.index`` (``split_rollout_samples`` numbers the rollout samples
            0 .. B-1 before it batches them). With ``--dynamic_batch_enable`` it reorders
            samples into length-balanced micro-batches, so consecutive rows are not groups;
            pass the index then: row i belongs to group ``index[i] // n_samples_per_prompt``,
            as in OpenRLHF's own group norm. It must hold each of 0 .. B-1 once.
        settings: the advantage settings as one ``AdvantageSettings`` (default
            ``ADVANTAGE_DEFAULTS``); ``options``, its fields as keywords (alpha, gamma, eps,
            eps_batch, batch_norm, delta, clip, nan, scale_rewards), are put over it. Any
            other keyword is a ValueError naming it.

    Returns:
        (B, T) token advantages (float32, float64 for float64 rewards), 0 where
        ``action_mask`` is 0.
    """
    s = advantage_settings(settings, options, where="mrtpo_token_advantages_from_experience")
    check_tensor("rewards", rewards, ndim=2, floating=True)
    if index is None:
        group_ids = consecutive_group_ids(rewards.shape[0], n_samples_per_prompt, rewards.device)
    else:
        group_ids = rollout_group_ids(index, rewards.shape[0], n_samples_per_prompt)
        group_ids = group_ids.to(rewards.device)
    return padded_token_advantages(
        rewards,
        group_ids,
        action_mask,
        relevance,
        has_info,
        mask_name="action_mask",
        weights=reward_weights,
        settings=s,
    ).token


@torch.no_grad()
def mrtpo_token_advantages_for_experiences(
    rewards: list[torch.Tensor],
    n_samples_per_prompt: int,
    action_masks: list[torch.Tensor],
    relevance: list[torch.Tensor],
    has_info: list[torch.Tensor],
    index: list | None = None,
    **options,
) -> list[torch.Tensor]:
    """The same over a step's micro-batch experiences, whose action widths A_j may differ.

    Each list holds one entry per experience, in sampling order: rewards (B_j, K),
    action_masks (B_j, A_j), relevance (K, B_j, A_j), has_info (B_j, K). The experiences are
    padded to the widest A, normalized together (groups may span experiences, as OpenRLHF
    concatenates their rewards) and split back. ``options`` as in
    ``mrtpo_token_advantages_from_experience``.

    ``index``: optional, one list of rollout positions per experience (``experience.index``);
    required in effect under dynamic batching, where consecutive rows are not groups.

    Returns one (B_j, A_j) tensor per experience.
    """
    n = len(rewards)
    if not (len(action_masks) == len(relevance) == len(has_info) == n) or n == 0:
        raise ValueError(
            f"rewards, action_masks, relevance, has_info: expected one entry per experience "
            f"in each (>= 1), got {len(rewards)}, {len(action_masks)}, {len(relevance)}, "
            f"{len(has_info)}"
        )
    for j in range(n):
        check_tensor(f"action_masks[{j}]", action_masks[j], ndim=2)
        check_tensor(f"relevance[{j}]", relevance[j], ndim=3, floating=True)
        _, b, a = relevance[j].shape
        check_shape(f"action_masks[{j}]", action_masks[j], (b, a), "(B_j, A_j) from relevance")
    width = max(m.shape[1] for m in action_masks)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[-1]))

    adv = mrtpo_token_advantages_from_experience(
        torch.cat(rewards),
        n_samples_per_prompt,
        torch.cat([pad(m.long()) for m in action_masks]),
        torch.cat([pad(r) for r in relevance], dim=1),
        torch.cat(has_info),
        index=None if index is None else _cat_index(index),
        **options,
    )
    out, start = [], 0
    for m in action_masks:
        out.append(adv[start : start + m.shape[0], : m.shape[1]])
        start += m.shape[0]
    return out


def _cat_index(index) -> list:
    keys = []
    for part in index:
        keys.extend(part.tolist() if isinstance(part, torch.Tensor) else list(part))
    return keys


# --------------------------------------------------------------------------- the replay


def replay_masks_for_experiences(
    rewards: list[torch.Tensor],
    n_samples_per_prompt: int,
    index: list | None = None,
    *,
    reward_weights: torch.Tensor | None = None,
    settings: AdvantageSettings | None = None,
    **options,
) -> list[torch.Tensor]:
    """Per experience, the (B_j, K) bool ``replay_mask`` of ``relevance_for_experience``:
    the pairs whose GDPO advantage can move a token (``mrtpo.replay.api.replay_mask_from_rewards``),
    over the whole step's rewards (groups may span experiences; ``index`` as in
    ``mrtpo_token_advantages_for_experiences``). Give the ``reward_weights`` and the
    advantage settings (``settings`` and/or their fields as keywords, as in
    ``mrtpo_token_advantages_from_experience``; eps, nan and scale_rewards decide) the
    advantages are computed with. The rewards are known before the replay runs: replaying
    only these pairs leaves the token advantages the same bit for bit."""
    from mrtpo.replay.api import replay_mask_from_rewards

    s = advantage_settings(settings, options, where="replay_masks_for_experiences")
    if not isinstance(rewards, (list, tuple)) or not rewards:
        raise ValueError("rewards: expected a list of (B_j, K) tensors, one per experience")
    for j, r in enumerate(rewards):
        check_tensor(f"rewards[{j}]", r, ndim=2, floating=True)
    allr = torch.cat(list(rewards))
    if index is None:
        gids = consecutive_group_ids(allr.shape[0], n_samples_per_prompt, allr.device)
    else:
        gids = rollout_group_ids(_cat_index(index), allr.shape[0], n_samples_per_prompt)
    mask = replay_mask_from_rewards(
        allr,
        gids.to(allr.device),
        weights=reward_weights,
        settings=s,
    )
    return list(torch.split(mask, [r.shape[0] for r in rewards]))


@torch.no_grad()
def relevance_for_experience(
    model,
    experience,
    spans,
    *,
    temperature: float,
    tokenizer=None,
    encode=None,
    prompts=None,
    add_special_tokens: bool = False,
    micro_batch: int = 16,
    max_tokens: int | None = None,
    check_prompt_ids: bool = True,
    replay_mask=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(relevance (K, B, A), has_info (B, K)) of an OpenRLHF ``Experience`` (or its samples)
    in the action layout, from ``mrtpo.replay.api.replay_relevance`` run on ``model``: the
    actor's Hugging Face module, its DeepSpeed engine, or OpenRLHF's ``Actor`` (whose
    ``model`` is either).

    On DeepSpeed ZeRO-3 (parameters partitioned) the replay runs through the engine
    (``mrtpo.integrations.engine.sharded_replay``): the LM head gathered by DeepSpeed once,
    the decoder forwards in lockstep over the ranks (a rank with fewer forwards runs
    one-token dummy ones), never the whole model at once. It is then a collective: every
    rank calls it as many times, in the same order (for instance once per step on its
    experiences concatenated), whether or not its rows have anything to replay. ZeRO-1/2
    and one process replay on the unwrapped module with no collective.

    Layout read: ``sequences`` (B, L) prompt + response, left- or right-padded, with
    ``attention_mask`` (B, L); ``action_mask`` (B, A) over the last A next-token positions
    (OpenRLHF 0.11: A = L - 1, ``action_mask[i, t]`` marks token t + 1). Row i's prompt is
    its tokens before its first action token; every token from there to its last action token
    is teacher-forced (tokens between actions, such as an environment's observation in a
    multi-turn rollout, too) and relevance is written at the action positions only. A row
    without action tokens is empty (zeros).

    Args:
        spans: (B, K) per sample, per reward, spans of its prompt (``mrtpo.replay.spans``).
        prompts: (B,) the prompts the spans refer to; default ``experience.prompts`` (the
            dataset's prompt text after OpenRLHF's chat templating: plain strings, tokenized
            with ``add_special_tokens=False`` as OpenRLHF does). Chat messages are rendered
            with the tokenizer's chat template.
        micro_batch, max_tokens: the replay's chunks (``replay_relevance``).
        check_prompt_ids: each prompt, rendered, must equal the row's prompt tokens.
        replay_mask: optional (B, K) bool, this experience's entry of
            ``replay_masks_for_experiences``: only those pairs are replayed (the others get
            relevance 0; the token advantages are the same bit for bit).
    """
    seq, att, act = experience.sequences, experience.attention_mask, experience.action_mask
    check_tensor("sequences", seq, ndim=2)
    check_tensor("action_mask", act, ndim=2)
    b, width = seq.shape
    a = act.shape[1]
    att = torch.ones_like(seq) if att is None else att
    check_shape("attention_mask", att, (b, width), "(B, L) like sequences")
    if act.shape[0] != b or a > width - 1:
        raise ValueError(
            f"action_mask: expected (B, A) with B = {b} and A <= L - 1 = "
            f"{width - 1}, got {tuple(act.shape)}"
        )
    if prompts is None:
        prompts = list(getattr(experience, "prompts", None) or [])
    if len(prompts) != b:
        raise ValueError(
            f"prompts: expected {b} (one per row; experience.prompts or "
            f"prompts=), got {len(prompts)}"
        )
    offset = width - a  # action column j is token offset + j
    prompt_rows, conts, firsts = [], [], []
    for i in range(b):
        cols = act[i].bool().nonzero().flatten()
        valid = att[i].bool()
        if cols.numel() == 0:  # nothing to replay; its prompt is not checked
            prompt_rows.append(None)
            conts.append([])
            firsts.append(None)
            continue
        first, last = offset + int(cols[0]), offset + int(cols[-1])
        pre = valid.clone()
        pre[first:] = False
        prompt_rows.append(seq[i][pre].tolist())
        span = valid.clone()
        span[:first] = False
        span[last + 1 :] = False
        conts.append(seq[i][span].tolist())
        firsts.append(first)
    if encode is None and tokenizer is not None:
        from mrtpo.replay.api import _prompt_encoder

        encode = _prompt_encoder(
            tokenizer,
            chat_template=False,
            add_special_tokens=add_special_tokens,
            chat_template_kwargs=None,
        )
    from mrtpo.replay.api import replay_relevance

    from .engine import _inner, sharded_replay

    if encode is not None:
        prompt_rows = [list(encode(p)) if r is None else r for p, r in zip(prompts, prompt_rows)]
    k = len(spans[0]) if b else 0
    engine = _actor_engine(model)
    with sharded_replay(engine, device=seq.device) as lm:
        rep = replay_relevance(
            _inner(engine) if lm is None else lm,
            prompts,
            conts,
            spans,
            encode=encode,
            temperature=temperature,
            prompt_ids=prompt_rows if check_prompt_ids else None,
            num_rewards=k,
            micro_batch=micro_batch,
            max_tokens=max_tokens,
            pad_token_id=None if tokenizer is None else tokenizer.pad_token_id,
            replay_mask=replay_mask,
        )
    out = torch.zeros((k, b, a), dtype=torch.float32, device=act.device)
    for i, first in enumerate(firsts):
        if first is None:
            continue
        n = len(conts[i])
        rel = rep.relevance[:, i, :n].to(act.device)
        valid_idx = att[i].bool().nonzero().flatten()
        tok_idx = valid_idx[(valid_idx >= first)][:n]  # the sequence index of each token
        keep = act[i, tok_idx - offset].bool()
        out[:, i, tok_idx[keep] - offset] = rel[:, keep]
    return out, rep.has_info.to(act.device)


def _actor_engine(model):
    """The module that runs the actor: OpenRLHF's ``Actor`` holds it as ``model`` (its
    DeepSpeed engine after ``strategy.prepare``, or the Hugging Face module); anything else
    is that module already."""
    inner = getattr(model, "model", None)
    if (
        isinstance(model, torch.nn.Module)
        and not hasattr(model, "get_output_embeddings")
        and isinstance(inner, torch.nn.Module)
    ):
        return inner
    return model
