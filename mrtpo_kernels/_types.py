"""Result types of the advantage ops, the advantage and policy-loss settings with their
defaults, and the one rule for the dtype of computed outputs.

A leaf module: it imports nothing from the package, so the public ops, the references
and the backends can all import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class GDPOAdvantages(NamedTuple):
    """Result of GDPO normalization (docs/METHOD.md section 1).

    per_reward: (n, K) group-normalized advantage of each reward.
    sequence:   (n,) batch-normalized GDPO advantage (S - mean) / (std + eps_batch).
    mean, std:  () batch statistics of S = sum_k lambda_k A_k.
    """

    per_reward: torch.Tensor
    sequence: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


class TokenAdvantages(NamedTuple):
    """Result of MRTPO reallocation (docs/METHOD.md sections 4-5).

    token:      per-token advantages, (B, T) padded (0 at padding) or (N,) packed.
    allocation: per-reward allocation weights w_k, (K, B, T) or (K, N); 1 where uniform.
    per_reward, sequence, mean, std: as in GDPOAdvantages.
    """

    token: torch.Tensor
    allocation: torch.Tensor
    per_reward: torch.Tensor
    sequence: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


@dataclass(frozen=True)
class AdvantageSettings:
    """The advantage ops' hyper-parameters (docs/METHOD.md sections 1, 4, 5), defined once:
    ``gdpo_advantages``, ``mrtpo_token_advantages`` (keywords, or ``settings=`` one of these),
    their float64 references and the framework adapters take their defaults from
    ``ADVANTAGE_DEFAULTS``, check them in one place (``advantage_settings``) and carry them
    down as one value.

    alpha: share of each reward's advantage reallocated by relevance, in [0, 1].
    gamma: sharpening exponent on the relevance d, > 0.
    eps: added to each group's reward std (eps_group); eps_batch: to the batch std of S
        (None: eps).
    scale_rewards: what each reward's group-centred value is divided by before the sum:
        "group" (its group's std + eps, GDPO), "batch" (the batch std of that reward +
        eps) or "none" (nothing; the rewards' own units).
    batch_norm: "sequence" (one entry per response) or "token" (T_i entries).
    delta: a mean d^gamma below it keeps uniform weights.
    clip: optional (w_min, w_max) for the normalized weights.
    nan: "error" or "zero" for non-finite rewards.
    """

    alpha: float = 1.0
    gamma: float = 1.0
    eps: float = 1e-6
    eps_batch: float | None = None
    scale_rewards: str = "group"
    batch_norm: str = "sequence"
    delta: float = 1e-8
    clip: tuple[float, float] | None = None
    nan: str = "error"

    @property
    def batch_eps(self) -> float:
        """The eps of the batch std: eps_batch, or eps where it is None."""
        return self.eps if self.eps_batch is None else self.eps_batch


ADVANTAGE_DEFAULTS = AdvantageSettings()


# the token conventions every op shares: the default temperature, and the label of tokens
# that are not scored (PyTorch's cross-entropy convention)
TEMPERATURE = 1.0
IGNORE_INDEX = -100
# the LM head's logit transform (``LogitCap``): no scaling, no final-logit softcapping
LOGIT_SCALE = 1.0
SOFTCAP = None


@dataclass(frozen=True)
class LogitCap:
    """The transform of the LM head's logits before the temperature, in the order Hugging
    Face models apply it (Cohere's ``logit_scale`` multiplies the head's output, Gemma 2 / 3's
    ``final_logit_softcapping`` caps the logits the model returns, and generation divides
    those by the temperature afterwards):

        r = h W^T + b,   z = softcap tanh(scale r / softcap)   (z = scale r without a cap),
        softmax(z / temperature),
        dz/dr = scale (1 - (z / softcap)^2)                    (scale without a cap)

    scale: finite and non-zero (Granite's ``logits_scaling`` divides: scale = 1 / it).
    softcap: > 0, or 0 for none (the public keyword takes None for none).
    The identity (scale 1, no cap) is the ops' plain path, bit for bit."""

    scale: float = 1.0
    softcap: float = 0.0

    @property
    def active(self) -> bool:
        return self.scale != 1.0 or self.softcap != 0.0


@dataclass(frozen=True)
class PolicyLossSettings:
    """The scalar settings of the clipped policy loss (docs/METHOD.md section 6), defined
    once: ``linear_policy_loss`` and its float64 references take their keyword defaults
    from ``POLICY_LOSS_DEFAULTS``, and a validated call's settings travel as one value to
    the vocabulary-parallel path.

    temperature: the sampling temperature.
    clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
    beta: weight of the k3 KL penalty to the reference policy.
    ignore_index: the label of tokens that are not scored.
    clip_ratio_c: the dual clip, inf for none (the public keyword takes None for none).
    kl_importance_weight: the KL term times the importance ratio.
    logit_scale, softcap: the LM head's logit transform (``LogitCap``; softcap 0 for none).
    """

    temperature: float = TEMPERATURE
    clip_low: float = 0.2
    clip_high: float = 0.2
    beta: float = 0.0
    ignore_index: int = IGNORE_INDEX
    clip_ratio_c: float = float("inf")
    kl_importance_weight: bool = False
    logit_scale: float = 1.0
    softcap: float = 0.0

    @property
    def logit_cap(self) -> LogitCap:
        return LogitCap(self.logit_scale, self.softcap)


POLICY_LOSS_DEFAULTS = PolicyLossSettings()


def acc_dtype(t: torch.Tensor | torch.dtype) -> torch.dtype:
    """Dtype of computed outputs and accumulations: float64 stays float64 (gradcheck, the
    references), every other input dtype computes in float32."""
    dtype = t if isinstance(t, torch.dtype) else t.dtype
    return torch.float64 if dtype == torch.float64 else torch.float32
