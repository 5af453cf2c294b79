"""Launch verl 0.9.1 PPO with MRTPO advantages: ``algorithm.adv_estimator=mrtpo``.

    python examples/verl/main_mrtpo.py data.train_files=... actor_rollout_ref.model.path=...
    python examples/verl/main_mrtpo.py --check   # CPU, no ray: the wiring on a toy batch

The training run is verl's own (``verl.trainer.main_ppo``): it needs what verl needs (ray,
GPUs, a rollout engine such as vllm, a model and data), plus ``mrtpo_rewards`` (bs, K) and
each sample's spans (``non_tensor_batch["mrtpo_spans"]``) in the batch (docs/integrations.md,
"verl"). This launcher makes verl's task runner, the process that computes advantages,
install ``register_with_verl(patch_compute_advantage=True, **config.mrtpo)`` and, with
``actor_rollout_ref.mrtpo.replay.enable: true`` (this directory's config), the replay: the
actor workers are ``mrtpo_actor_worker_class()`` and ``install_replay_hook()`` fills
``mrtpo_relevance`` / ``mrtpo_has_info`` after the old log-probs.
``--check`` composes this directory's config and runs verl's ``compute_advantage`` on a
toy ``DataProto`` in this process, as the task runner would.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _options(config) -> dict:
    from omegaconf import OmegaConf

    return dict(OmegaConf.to_container(config.get("mrtpo", {}), resolve=True))


def _replay_on(config) -> bool:
    from mrtpo.integrations.verl import replay_options

    return replay_options(config.actor_rollout_ref) is not None


def check() -> None:
    import numpy as np
    import torch
    from hydra import compose, initialize_config_dir
    from verl import DataProto
    from verl.trainer.ppo import ray_trainer

    from mrtpo.integrations.verl import HAS_INFO_KEY, RELEVANCE_KEY, REWARDS_KEY, register_with_verl

    with initialize_config_dir(config_dir=HERE, version_base=None):
        config = compose("mrtpo_trainer")
    register_with_verl(patch_compute_advantage=True, **_options(config))
    g = torch.Generator().manual_seed(0)
    n, b, k, p, t = config.actor_rollout_ref.rollout.n, 16, 2, 4, 6
    response_mask = torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=g)[:, None]
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.zeros(b, p, dtype=torch.long),
            "responses": torch.zeros(b, t, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(b, p), response_mask.float()], 1).long(),
            "token_level_rewards": torch.zeros(b, t),
            REWARDS_KEY: torch.rand(b, k, generator=g),
            RELEVANCE_KEY: torch.rand(b, k, t, generator=g) * response_mask[:, None],
            HAS_INFO_KEY: torch.ones(b, k, dtype=torch.bool),
        },
        non_tensors={"uid": np.array([f"p{i // n}" for i in range(b)], dtype=object)},
    )
    data = ray_trainer.compute_advantage(
        data, adv_estimator=config.algorithm.adv_estimator, gamma=config.algorithm.gamma,
        lam=config.algorithm.lam, num_repeat=n,
        norm_adv_by_std_in_grpo=config.algorithm.norm_adv_by_std_in_grpo,
        config=config.algorithm,
    )  # fmt: skip
    adv = data.batch["advantages"]
    print(f"adv_estimator={config.algorithm.adv_estimator} options={_options(config)}")
    print(
        f"advantages {tuple(adv.shape)}, mean over response tokens "
        f"{adv[response_mask].mean().item():+.2e}, std {adv[response_mask].std().item():.3f}"
    )


def task_runner_class():
    """verl's v0 task runner that installs MRTPO in the process that computes advantages and,
    with the replay on, gives the actor role the worker class that replays (the plain
    class; ``ray.remote`` of it is what ``run_ppo`` takes)."""
    import ray
    from verl.trainer.main_ppo_v0 import TaskRunner

    class MRTPOTaskRunner(TaskRunner.__ray_actor_class__):
        def add_actor_rollout_worker(self, config):
            out = super().add_actor_rollout_worker(config)
            if _replay_on(config):  # the actor workers get compute_mrtpo_relevance
                from mrtpo.integrations.verl import mrtpo_actor_worker_class

                worker = ray.remote(mrtpo_actor_worker_class())
                for role in list(self.role_worker_mapping):
                    if "Actor" in getattr(role, "name", str(role)):
                        self.role_worker_mapping[role] = worker
            return out

        def run(self, config):
            from mrtpo.integrations.verl import install_replay_hook, register_with_verl

            register_with_verl(patch_compute_advantage=True, **_options(config))
            if _replay_on(config):  # the replay after the old log-probs, in this driver
                install_replay_hook()
            return super().run(config)

    return MRTPOTaskRunner


def main() -> None:
    import hydra
    import ray
    from verl.trainer import main_ppo

    runner = ray.remote(task_runner_class())

    @hydra.main(config_path=HERE, config_name="mrtpo_trainer", version_base=None)
    def run(config):
        if config.trainer.use_v1:
            raise SystemExit(
                "trainer.use_v1=true: the compute_advantage patch reaches only "
                "verl's RayPPOTrainer; see docs/integrations.md"
            )
        main_ppo.auto_set_device(config)
        main_ppo.validate_config(
            config=config, use_reference_policy=main_ppo.need_reference_policy(config),
            use_critic=main_ppo.need_critic(config),
        )  # fmt: skip
        main_ppo.run_ppo(config, task_runner_class=runner)

    run()


if __name__ == "__main__":
    if "--check" in sys.argv:
        check()
    else:
        main()
