"""The OpenRLHF adapter inside OpenRLHF 0.11.2 itself (run by `make test-frameworks`).

Rollout samples go through OpenRLHF's own `RemoteExperienceMaker.split_rollout_samples`
with dynamic batching (length-balanced micro-batches that reorder the samples) and
`Experience.concat_experiences`; the adapter groups the rows by `experience.index`, and
OpenRLHF's own `compute_advantages_and_returns` (group_norm) on the same experiences checks
the grouping. Skipped where OpenRLHF is not installed (the project's main environment).
"""

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

pytest.importorskip("openrlhf", reason="OpenRLHF runs in .venv-frameworks (make test-frameworks)")

STUBS = Path(__file__).resolve().parents[1] / "framework_stubs"


def _import_with_stubs(*names):
    """Import OpenRLHF modules that import flash_attn / vllm (GPU-only) at the top.

    The stubs (tests/framework_stubs) are on sys.path only during these imports and are
    dropped from sys.modules afterwards, so transformers never sees a fake flash_attn.
    """
    import peft  # noqa: F401  transformers' flash-attention checks run (and cache) first

    sys.path.insert(0, str(STUBS))
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        sys.path.remove(str(STUBS))
        for key in [k for k in sys.modules if k.split(".")[0] in ("flash_attn", "vllm")]:
            del sys.modules[key]


experience_maker, experience_mod = _import_with_stubs(
    "openrlhf.trainer.ppo_utils.experience_maker", "openrlhf.trainer.ppo_utils.experience"
)
Experience = experience_mod.Experience

from mrtpo.integrations import openrlhf  # noqa: E402

N_PER_PROMPT, PROMPTS, K, PAD = 4, 3, 2, 0
B = N_PER_PROMPT * PROMPTS


def _maker(dynamic: bool, estimator="group_norm"):
    args = NS(
        algo=NS(advantage=NS(estimator=estimator, gamma=1.0, lambd=1.0)),
        train=NS(dynamic_batch_enable=dynamic),
        actor=NS(num_nodes=1, num_gpus_per_node=2),
        ds=NS(ring_attn_size=1, tensor_parallel_size=1),
        rollout=NS(max_tokens_per_gpu=40, micro_batch_size=4, n_samples_per_prompt=N_PER_PROMPT),
        reward=NS(clip_range=None, overlong_buffer_len=None, stop_properly_penalty_coef=None),
    )
    return experience_maker.RemoteExperienceMaker(
        None, None, None, None, NS(value=0.0), NS(args=args), NS(pad_token_id=PAD)
    )


def _rollout(seed=0):
    """B single-sample experiences in sampling order (4 answers per prompt)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = 5
    actions = torch.randint(2, 14, (B,), generator=g)
    rewards = torch.rand(B, K, generator=g) * torch.tensor([1.0, 5.0])
    relevance = [torch.rand(K, int(a), generator=g) for a in actions]
    has_info = torch.rand(B, K, generator=g) > 0.3
    samples = []
    for i, a in enumerate(actions.tolist()):
        seq = torch.randint(1, 50, (1, prompt_len + a), generator=g)
        samples.append(
            Experience(
                sequences=seq,
                attention_mask=torch.ones_like(seq),
                action_mask=torch.ones(1, a, dtype=torch.bool),
                kl=torch.zeros(1, a),
                rewards=rewards[i, :1].clone(),
                total_length=torch.tensor([prompt_len + a]),
                response_length=torch.tensor([a]),
            )
        )
    return samples, rewards, relevance, has_info


def _per_experience(experiences, rewards, relevance, has_info):
    """The adapter's inputs for each micro-batch experience, rows in its order."""
    out = {"rewards": [], "masks": [], "relevance": [], "info": [], "index": []}
    k = relevance[0].shape[0]
    for e in experiences:
        idx = list(e.index)
        width = e.action_mask.shape[1]
        rel = torch.zeros(k, len(idx), width)
        for row, i in enumerate(idx):
            rel[:, row, : relevance[i].shape[1]] = relevance[i]
        out["rewards"].append(rewards[idx])
        out["masks"].append(e.action_mask)
        out["relevance"].append(rel)
        out["info"].append(has_info[idx])
        out["index"].append(e.index)
    return out


def _ordered(rewards, relevance, has_info, **options):
    width = max(r.shape[1] for r in relevance)
    mask = torch.zeros(B, width, dtype=torch.bool)
    rel = torch.zeros(K, B, width)
    for i, r in enumerate(relevance):
        mask[i, : r.shape[1]] = True
        rel[:, i, : r.shape[1]] = r
    adv = openrlhf.mrtpo_token_advantages_from_experience(
        rewards, N_PER_PROMPT, mask, rel, has_info, **options
    )
    return adv


def test_dynamic_batching_groups_by_experience_index():
    samples, rewards, relevance, has_info = _rollout()
    experiences = _maker(dynamic=True).split_rollout_samples(samples)
    order = [i for e in experiences for i in e.index]
    assert sorted(order) == list(range(B))
    assert order != list(range(B)), "OpenRLHF's dynamic batching should reorder the samples"
    assert len(experiences) >= 2
    inputs = _per_experience(experiences, rewards, relevance, has_info)
    got = openrlhf.mrtpo_token_advantages_for_experiences(
        inputs["rewards"], N_PER_PROMPT, inputs["masks"], inputs["relevance"], inputs["info"],
        index=inputs["index"], alpha=0.8,
    )  # fmt: skip
    want = _ordered(rewards, relevance, has_info, alpha=0.8)
    for e, adv in zip(experiences, got):
        assert adv.shape == e.action_mask.shape
        for row, i in enumerate(e.index):
            a = relevance[i].shape[1]
            torch.testing.assert_close(adv[row, :a], want[i, :a], rtol=1e-6, atol=1e-6)
            assert (adv[row, a:] == 0).all()
    # grouping consecutive rows of the reordered micro-batches is wrong
    wrong = openrlhf.mrtpo_token_advantages_for_experiences(
        inputs["rewards"], N_PER_PROMPT, inputs["masks"], inputs["relevance"], inputs["info"]
    )
    assert max((w - a).abs().max().item() for w, a in zip(wrong, got)) > 0.1


def test_groups_match_openrlhfs_own_group_norm():
    """K = 1, alpha = 0: each group's normalized reward, a positive multiple of OpenRLHF's."""
    samples, rewards, relevance, has_info = _rollout(seed=1)
    maker = _maker(dynamic=True)
    experiences = maker.split_rollout_samples(samples)
    inputs = _per_experience(
        experiences, rewards[:, :1], [r[:1] for r in relevance], has_info[:, :1]
    )
    ours = openrlhf.mrtpo_token_advantages_for_experiences(
        inputs["rewards"], N_PER_PROMPT, inputs["masks"], inputs["relevance"], inputs["info"],
        index=inputs["index"], alpha=0.0,
    )  # fmt: skip
    experiences = maker.compute_advantages_and_returns(experiences)  # OpenRLHF's group_norm
    theirs = torch.cat([e.advantages[e.action_mask] for e in experiences])
    ours = torch.cat([a[e.action_mask] for a, e in zip(ours, experiences)]).to(theirs.dtype)
    scale = (ours * theirs).sum() / (theirs * theirs).sum()
    assert scale > 0
    # population vs sample std and the epsilons differ by a constant factor only
    torch.testing.assert_close(ours, scale * theirs, rtol=1e-4, atol=1e-5)


def test_without_dynamic_batching_consecutive_rows_are_groups():
    samples, rewards, relevance, has_info = _rollout(seed=2)
    experiences = _maker(dynamic=False).split_rollout_samples(samples)
    assert [i for e in experiences for i in e.index] == list(range(B))
    inputs = _per_experience(experiences, rewards, relevance, has_info)
    plain = openrlhf.mrtpo_token_advantages_for_experiences(
        inputs["rewards"], N_PER_PROMPT, inputs["masks"], inputs["relevance"], inputs["info"]
    )
    indexed = openrlhf.mrtpo_token_advantages_for_experiences(
        inputs["rewards"], N_PER_PROMPT, inputs["masks"], inputs["relevance"], inputs["info"],
        index=inputs["index"],
    )  # fmt: skip
    for a, b in zip(plain, indexed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_policy_loss_on_fused_logprobs_matches_openrlhf():
    """OpenRLHF's PolicyLoss on log-probs from linear_logprobs equals it on plain logits."""
    from mrtpo_kernels import linear_logprobs

    (loss_mod,) = _import_with_stubs("openrlhf.models.loss")
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, dtype=torch.float64) * 0.3
    labels = torch.randint(0, 40, (3, 7), generator=g)
    old = torch.randn(3, 7, generator=g, dtype=torch.float64) * 0.2 - 3.6
    adv = torch.randn(3, 7, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:] = False
    fn = loss_mod.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28)

    def loss_of(logp):
        out = fn(logp, old, adv, action_mask=mask)
        return out[0] if isinstance(out, tuple) else out

    fused = linear_logprobs(hidden, weight, labels)
    (g_fused,) = torch.autograd.grad(loss_of(fused), hidden)
    plain = torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels[..., None])[..., 0]
    (g_plain,) = torch.autograd.grad(loss_of(plain), hidden)
    torch.testing.assert_close(fused.double(), plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_fused, g_plain, rtol=1e-5, atol=1e-7)
