"""verl adapter, the contrastive replay in verl's actor workers (re-exported by
``mrtpo.integrations.verl``).

``fill_mrtpo_relevance`` runs ``mrtpo.replay.api.replay_relevance`` on a verl batch (a padded
DataProto or the remove-padding TensorDict verl 0.9's workers receive) and writes the keys
the advantage estimator of ``mrtpo.integrations.verl`` reads:

    data.batch["mrtpo_relevance"]  (bs, K, response_length)
    data.batch["mrtpo_has_info"]   (bs, K) bool

Replay only what can move: when the batch already holds the K rewards (``mrtpo_rewards``)
and the group keys (``non_tensor_batch["uid"]``) as the replay starts, the driver hook
writes ``mrtpo_replay_mask`` (bs, K) (``set_replay_mask``: the pairs whose GDPO advantage
is not 0, over the whole batch) and each worker replays only those pairs of its rows; the
token advantages are the same bit for bit.

``mrtpo_actor_worker_class`` registers it on verl's actor worker (``compute_mrtpo_relevance``,
dispatched like ``compute_log_prob``) and ``install_replay_hook`` calls it after the old
log-probs, when ``actor_rollout_ref.mrtpo.replay.enable`` is true (``replay_options``).
verl is imported only inside the functions that need it.
"""

from __future__ import annotations

import torch

from .common import config_value, require

__all__ = [
    "HAS_INFO_KEY",
    "RELEVANCE_KEY",
    "REPLAY_MASK_KEY",
    "REPLAY_METHOD",
    "REWARDS_KEY",
    "SPANS_KEY",
    "fill_mrtpo_relevance",
    "install_replay_hook",
    "mrtpo_actor_worker_class",
    "replay_options",
    "set_replay_mask",
    "worker_compute_relevance",
]

RELEVANCE_KEY = "mrtpo_relevance"
HAS_INFO_KEY = "mrtpo_has_info"
REWARDS_KEY = "mrtpo_rewards"
REPLAY_MASK_KEY = "mrtpo_replay_mask"
SPANS_KEY = "mrtpo_spans"
PROMPT_KEY = "raw_prompt"
REPLAY_METHOD = "compute_mrtpo_relevance"


def _rows_from(t: torch.Tensor, mask: torch.Tensor | None = None) -> list[list[int]]:
    if t.is_nested:
        return [r.tolist() for r in t.unbind()]
    if mask is None:
        return [r.tolist() for r in t]
    return [r[m.bool()].tolist() for r, m in zip(t, mask)]


def _non_tensor(data, key: str, where: str):
    ntb = getattr(data, "non_tensor_batch", None)
    if ntb is not None:
        if key not in ntb:
            raise ValueError(f"{where}: data.non_tensor_batch has no {key!r}")
        return list(ntb[key])
    keys = set(data.keys())
    if key not in keys:
        raise ValueError(f"{where}: the batch has no {key!r}")
    value = data[key] if not hasattr(data, "get_non_tensor") else data.get(key)
    return value.tolist() if hasattr(value, "tolist") else list(value)


@torch.no_grad()
def fill_mrtpo_relevance(
    data,
    model,
    tokenizer=None,
    *,
    temperature: float,
    spans_key: str = SPANS_KEY,
    prompt_key: str = PROMPT_KEY,
    encode=None,
    chat_template_kwargs: dict | None = None,
    micro_batch: int = 16,
    max_tokens: int | None = None,
    check_prompt_ids: bool = True,
    replay_mask=None,
):
    """Fill ``mrtpo_relevance`` (bs, K, response_length) and ``mrtpo_has_info`` (bs, K) of a
    verl batch with ``mrtpo.replay.api.replay_relevance`` run on ``model`` (the actor's Hugging
    Face module, or the ``EngineLM`` of ``mrtpo.integrations.engine.sharded_replay`` on a
    sharded engine).

    ``data`` is a ``DataProto`` in verl's padded layout (``prompts`` (bs, P) left-padded,
    ``responses`` (bs, T), ``attention_mask`` (bs, P + T)) or the TensorDict verl 0.9's
    workers receive after ``left_right_2_no_padding`` (the remove-padding layout: nested
    ``input_ids``; ``prompts`` and ``responses`` padded with ``attention_mask``, or nested).
    Per sample, ``non_tensor_batch[prompt_key]`` holds the prompt (chat messages, verl's
    ``raw_prompt``, or a string) and ``non_tensor_batch[spans_key]`` its K span lists
    (``mrtpo.replay.spans``; None or [] for a reward without spans). Prompts are rendered with the
    tokenizer's chat template (``apply_chat_template_kwargs`` of verl's data config as
    ``chat_template_kwargs``), or by ``encode``; with ``check_prompt_ids`` each must equal
    the prompt ids in the batch (a truncated prompt is an error: its spans would not match).
    ``replay_mask`` (bs, K) bool, default the batch's ``mrtpo_replay_mask`` when it has one
    (``set_replay_mask``): only those pairs are replayed (``replay_relevance``).

    Returns ``data``.
    """
    batch = data.batch if hasattr(data, "non_tensor_batch") else data
    keys = set(batch.keys())
    for need in ("prompts", "responses"):
        if need not in keys:
            raise ValueError(f"data: the batch has no {need!r} (verl's prompt / response ids)")
    prompts_t, responses_t = batch["prompts"], batch["responses"]
    if responses_t.is_nested:
        responses = _rows_from(responses_t)
        width = int(max((len(r) for r in responses), default=0))
        if hasattr(data, "get_non_tensor") or "max_response_len" in keys:
            width = max(width, int(_max_response_len(data, width)))
        prompt_rows = _rows_from(prompts_t)
        mask = torch.zeros((len(responses), width), dtype=torch.bool)
        for i, r in enumerate(responses):
            mask[i, : len(r)] = True
        ids = torch.zeros((len(responses), width), dtype=torch.long)
        for i, r in enumerate(responses):
            ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    else:
        if "attention_mask" not in keys:
            raise ValueError("data: padded prompts/responses need the batch's attention_mask")
        att = batch["attention_mask"]
        p = prompts_t.shape[1]
        prompt_rows = _rows_from(prompts_t, att[:, :p])
        ids, mask = responses_t, att[:, p:].bool()
    prompts = _non_tensor(data, prompt_key, "prompt_key")
    spans = _non_tensor(data, spans_key, "spans_key")
    spans = [list(s) if s is not None else [] for s in spans]
    k = len(spans[0]) if spans else 0
    if tokenizer is None and encode is None:
        raise ValueError("tokenizer: needed to render the prompts (or pass encode=)")
    if encode is None:
        kw = dict(chat_template_kwargs or {})

        def encode(prompt):
            if isinstance(prompt, str):
                return tokenizer(prompt, add_special_tokens=False)["input_ids"]
            out = tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, **kw
            )
            return out["input_ids"] if hasattr(out, "keys") else out

    from mrtpo.replay.api import replay_relevance

    if replay_mask is None and REPLAY_MASK_KEY in keys:
        replay_mask = batch[REPLAY_MASK_KEY]
    rep = replay_relevance(
        model,
        prompts,
        ids,
        spans,
        response_mask=mask,
        encode=encode,
        prompt_ids=prompt_rows if check_prompt_ids else None,
        temperature=temperature,
        micro_batch=micro_batch,
        max_tokens=max_tokens,
        num_rewards=k,
        pad_token_id=None if tokenizer is None else tokenizer.pad_token_id,
        replay_mask=replay_mask,
    )
    batch[RELEVANCE_KEY] = rep.relevance.transpose(0, 1).contiguous().cpu()
    batch[HAS_INFO_KEY] = rep.has_info.cpu()
    return data


def set_replay_mask(data, *, reward_weights=None):
    """Write ``data.batch["mrtpo_replay_mask"]`` (bs, K) bool, the pairs whose GDPO advantage
    can move a token (``mrtpo.replay.api.replay_mask_from_rewards``), from the batch's
    ``mrtpo_rewards`` ((bs, K), or (bs, K, T) summed over T as the estimator does) and
    ``non_tensor_batch["uid"]``; on the driver, over the whole batch, before the replay.
    Nothing (and None returned) where either is missing: then every pair is replayed.
    NaN rewards count as 0 here (where the estimator refuses them, it does so anyway).
    Pass the estimator's ``reward_weights`` to skip the rewards weighted 0 too. Local
    computation only (no collective)."""
    from mrtpo.replay.api import replay_mask_from_rewards

    from .common import group_ids_from_index

    batch = data.batch
    ntb = getattr(data, "non_tensor_batch", None) or {}
    if REWARDS_KEY not in set(batch.keys()) or "uid" not in ntb:
        return None
    rewards = batch[REWARDS_KEY]
    if not isinstance(rewards, torch.Tensor) or rewards.dim() not in (2, 3):
        raise ValueError(f"{REWARDS_KEY}: expected a (bs, K) or (bs, K, T) tensor")
    rewards = rewards.sum(dim=-1) if rewards.dim() == 3 else rewards
    group_ids = group_ids_from_index(ntb["uid"], device=rewards.device)
    mask = replay_mask_from_rewards(rewards, group_ids, weights=reward_weights, nan="zero")
    batch[REPLAY_MASK_KEY] = mask
    return mask


def _max_response_len(data, default):
    try:
        from verl.utils import tensordict_utils as tu

        return tu.get_non_tensor_data(data=data, key="max_response_len", default=default)
    except ImportError:  # pragma: no cover - verl absent: nested input comes from verl only
        return default


# verl releases whose worker / driver / task runner this module's replay hook was written
# against (engine workers taking TensorDicts, RayPPOTrainer._compute_old_log_prob).
HOOKED_VERL_VERSIONS = ("0.9.1",)


def _check_version(feature: str, allow_unknown_version: bool):
    verl = require("verl", feature)
    version = getattr(verl, "__version__", "unknown")
    if version not in HOOKED_VERL_VERSIONS and not allow_unknown_version:
        raise RuntimeError(
            f"{feature}: verl {version} is not a version this hook was written against "
            f"({', '.join(HOOKED_VERL_VERSIONS)}); check ActorRolloutRefWorker.compute_log_prob "
            "and RayPPOTrainer._compute_old_log_prob, then pass allow_unknown_version=True"
        )


def replay_options(config) -> dict | None:
    """The ``mrtpo.replay.api`` section of a verl config (None when absent or disabled):
    ``enable``, ``spans_key``, ``prompt_key``, ``micro_batch``, ``max_tokens``,
    ``check_prompt_ids`` and
    ``chat_template_kwargs`` (as verl's ``data.apply_chat_template_kwargs``)."""
    section = config_value(config, "mrtpo", None)
    replay = config_value(section, "replay", None)
    if replay is None or not bool(config_value(replay, "enable", False)):
        return None
    out = {}
    for key in (
        "spans_key",
        "prompt_key",
        "micro_batch",
        "max_tokens",
        "check_prompt_ids",
        "chat_template_kwargs",
    ):
        value = config_value(replay, key, None)
        if value is not None:
            if key == "chat_template_kwargs" and not isinstance(value, dict):
                from omegaconf import OmegaConf

                value = OmegaConf.to_container(value, resolve=True)
            out[key] = value
    return out


def worker_compute_relevance(worker, data):
    """The body of the actor worker's ``compute_mrtpo_relevance``: the replay on this rank's
    rows of ``data`` (verl's remove-padding TensorDict) with the actor's module. On FSDP
    (1 or 2) every rank runs the replay's forwards through the wrapped module in lockstep,
    dummy forwards where it has fewer, and gathers only the LM head
    (``mrtpo.integrations.engine.sharded_replay``; docs/trl.md, "Sharded engines"). Options
    come from the worker's config (``actor_rollout_ref.mrtpo.replay``; see
    ``replay_options``); the temperature from the batch (``temperature``, which verl sets
    from the rollout config)."""
    from .engine import sharded_replay

    options = replay_options(worker.config) or {}
    actor = worker.actor
    module = actor.engine.module
    tokenizer = actor.model_config.tokenizer
    temperature = _temperature(data, worker)
    inner = getattr(module, "module", module)  # FSDP1 / DDP keep the model under .module
    was_training = module.training
    module.eval()
    try:
        with sharded_replay(module) as lm:
            fill_mrtpo_relevance(
                data, inner if lm is None else lm, tokenizer, temperature=temperature, **options
            )
    finally:
        module.train(was_training)
    from tensordict import TensorDict

    return TensorDict(
        {RELEVANCE_KEY: data[RELEVANCE_KEY], HAS_INFO_KEY: data[HAS_INFO_KEY]},
        batch_size=[data[RELEVANCE_KEY].shape[0]],
    )


def _temperature(data, worker) -> float:
    value = None
    try:
        from verl.utils import tensordict_utils as tu

        value = tu.get_non_tensor_data(data=data, key="temperature", default=None)
    except (ImportError, KeyError):
        value = None
    if value is None:
        rollout = config_value(worker.config, "rollout", None)
        value = config_value(rollout, "temperature", 1.0)
    return float(value)


_WORKER_CLASS = None


def mrtpo_actor_worker_class(*, allow_unknown_version: bool = False):
    """verl's ``ActorRolloutRefWorker`` with one more registered method,
    ``compute_mrtpo_relevance`` (``worker_compute_relevance``), dispatched like
    ``compute_log_prob`` (each data-parallel rank replays its own rows). A subclass, so that
    ray ships it to the workers by value; put it in the task runner's
    ``role_worker_mapping`` in place of verl's class (``examples/verl/main_mrtpo.py``)."""
    global _WORKER_CLASS
    _check_version("mrtpo_actor_worker_class", allow_unknown_version)
    if _WORKER_CLASS is None:
        engine_workers = require("verl.workers.engine_workers", "mrtpo_actor_worker_class")
        from verl.single_controller.base.decorator import register

        base = engine_workers.ActorRolloutRefWorker
        dispatch = _dispatch_of(base.compute_log_prob)

        def compute_mrtpo_relevance(self, data):
            return worker_compute_relevance(self, data)

        _WORKER_CLASS = type(
            "MRTPOActorRolloutRefWorker",
            (base,),
            {
                REPLAY_METHOD: register(dispatch_mode=dispatch)(compute_mrtpo_relevance),
                "__doc__": "verl's ActorRolloutRefWorker with the MRTPO contrastive replay.",
            },
        )
    return _WORKER_CLASS


def install_replay_hook(*, allow_unknown_version: bool = False):
    """Switch the contrastive replay into verl 0.9.1's training loop (opt-in, version-checked).

    Wraps ``RayPPOTrainer._compute_old_log_prob`` (driver side): after the old log-probs,
    when the config has ``actor_rollout_ref.mrtpo.replay.enable: true``, it sends the same
    remove-padding batch to the actor workers' ``compute_mrtpo_relevance`` (workers of
    ``mrtpo_actor_worker_class``; with ``mrtpo_rewards`` and ``uid`` already in the batch,
    ``set_replay_mask`` first, so they replay only the pairs that can move) and writes
    ``mrtpo_relevance`` / ``mrtpo_has_info`` into the batch, where
    ``compute_mrtpo_advantage_for_batch`` reads them. Installed once.
    Returns the worker class to register for the actor role.
    """
    worker_cls = mrtpo_actor_worker_class(allow_unknown_version=allow_unknown_version)
    ray_trainer = require("verl.trainer.ppo.ray_trainer", "install_replay_hook")
    trainer_cls = ray_trainer.RayPPOTrainer
    current = trainer_cls._compute_old_log_prob
    if not hasattr(current, "original"):

        def _compute_old_log_prob(self, batch, *args, **kwargs):
            out = current(self, batch, *args, **kwargs)
            if replay_options(self.config.actor_rollout_ref) is not None:
                from verl.workers.utils.padding import left_right_2_no_padding

                set_replay_mask(batch)  # driver-local; every worker is called below
                td = left_right_2_no_padding(batch.to_tensordict())
                res = getattr(self.actor_rollout_wg, REPLAY_METHOD)(td)
                batch.batch[RELEVANCE_KEY] = res[RELEVANCE_KEY]
                batch.batch[HAS_INFO_KEY] = res[HAS_INFO_KEY]
            return out

        _compute_old_log_prob.original = current
        trainer_cls._compute_old_log_prob = _compute_old_log_prob
    return worker_cls


def _dispatch_of(method):
    from verl.single_controller.base.decorator import MAGIC_ATTR

    attrs = getattr(method, MAGIC_ATTR, None)
    if not attrs or "dispatch_mode" not in attrs:
        raise RuntimeError(
            "install_replay_hook: ActorRolloutRefWorker.compute_log_prob carries no registered "
            "dispatch mode in this verl; the hook cannot dispatch like it"
        )
    return attrs["dispatch_mode"]
