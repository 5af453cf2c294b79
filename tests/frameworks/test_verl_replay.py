"""The contrastive replay inside verl 0.9.1 (run by `make test-frameworks`): a real DataProto
with a real Hugging Face model on the CPU, in verl's padded layout and in the remove-padding
TensorDict its workers receive (``left_right_2_no_padding``), gives the same relevance as
``mrtpo.replay.api.replay_relevance`` on the same rows; the worker method and the driver hook
fill the batch the advantage step reads."""

from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl runs in .venv-frameworks (make test-frameworks)")

from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.single_controller.base.decorator import MAGIC_ATTR  # noqa: E402
from verl.trainer.ppo import ray_trainer  # noqa: E402
from verl.workers import engine_workers  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from mrtpo.integrations import verl  # noqa: E402
from mrtpo.model.loading import TinyConfig, build_tiny_model, build_tokenizer  # noqa: E402
from mrtpo.replay.api import replay_relevance  # noqa: E402

USERS = ['Write about owls. Include the word "blue".', 'Write about rain. End with "bye now".']
SYSTEM = {"role": "system", "content": "be brief"}
TAU = 0.9


def _setup():
    tok = build_tokenizer(USERS * 4 + ["hello blue owls", "rain bye now", "be brief"],
                          vocab_size=300)  # fmt: skip
    cfg = TinyConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=2, num_kv_heads=1)  # fmt: skip
    return tok, build_tiny_model(tok, cfg, seed=0).eval()


def _batch(tok):
    """A verl batch after generation: 2 prompts x 2 responses, chat prompts with and without
    a system message, an empty (masked) and a truncated response."""
    msgs = [
        [{"role": "user", "content": USERS[0]}],
        [SYSTEM, {"role": "user", "content": USERS[1]}],
    ]
    raw = [msgs[0], msgs[0], msgs[1], msgs[1]]
    u0, u1 = USERS
    spans = [
        [[(0, u0.index('"'), len(u0))], []],
        [[(0, u0.index('"'), len(u0))], []],
        [[(1, u1.index("End"), len(u1))], [(0, 0, 8)]],
        [[(1, u1.index("End"), len(u1))], [(0, 0, 8)]],
    ]
    responses = [[10, 11, 12, tok.eos_token_id], [13, 14, 15, 16, 17], [], [18, 19]]
    prompt_ids = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)["input_ids"]
                  for m in raw]  # fmt: skip
    b, p, t = 4, max(map(len, prompt_ids)), 5
    prompts = torch.full((b, p), tok.pad_token_id)
    resp = torch.full((b, t), tok.pad_token_id)
    att = torch.zeros((b, p + t), dtype=torch.long)
    for i, (q, r) in enumerate(zip(prompt_ids, responses)):
        prompts[i, p - len(q) :] = torch.tensor(q)
        att[i, p - len(q) : p] = 1
        if r:
            resp[i, : len(r)] = torch.tensor(r)
        att[i, p : p + len(r)] = 1
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    data = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": resp, "input_ids": torch.cat([prompts, resp], 1),
                 "attention_mask": att, "position_ids": pos, "response_mask": att[:, p:]},
        non_tensors={"raw_prompt": np.array(raw + [None], dtype=object)[:-1],
                     "mrtpo_spans": np.array(spans + [None], dtype=object)[:-1],
                     "uid": np.array(["a", "a", "b", "b"], dtype=object)},
    )  # fmt: skip
    return data, raw, spans, responses


def _want(model, tok, raw, spans, responses):
    return replay_relevance(model, raw, responses, spans, tokenizer=tok, temperature=TAU)


def test_padded_and_remove_padding_layouts_equal_the_neutral_replay():
    tok, model = _setup()
    data, raw, spans, responses = _batch(tok)
    want = _want(model, tok, raw, spans, responses)
    assert bool((want.relevance > 0).any())
    verl.fill_mrtpo_relevance(data, model, tok, temperature=TAU)
    rel = data.batch[verl.RELEVANCE_KEY]
    assert tuple(rel.shape) == (4, 2, 5)
    torch.testing.assert_close(rel.transpose(0, 1), want.relevance, rtol=1e-5, atol=1e-6)
    assert torch.all(rel[2] == 0)  # the empty response
    assert data.batch[verl.HAS_INFO_KEY].tolist() == want.has_info.tolist()
    # the TensorDict verl's actor worker receives (remove-padding layout, nested input_ids)
    td = left_right_2_no_padding(data.to_tensordict())
    assert td["input_ids"].is_nested
    verl.fill_mrtpo_relevance(td, model, tok, temperature=TAU)
    torch.testing.assert_close(td[verl.RELEVANCE_KEY], rel, rtol=1e-5, atol=1e-6)
    # the advantage step reads what the replay wrote
    data.batch[verl.REWARDS_KEY] = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.5]])
    verl.compute_mrtpo_advantage_for_batch(data, batch_norm="sequence")
    assert torch.isfinite(data.batch["advantages"]).all()


def test_truncated_prompt_is_an_error():
    tok, model = _setup()
    data, *_ = _batch(tok)
    data.batch["prompts"][0, -3] = 7  # not what the chat template renders
    with pytest.raises(ValueError, match="prompt_ids: row 0"):
        verl.fill_mrtpo_relevance(data, model, tok, temperature=TAU)


def _worker(model, tok, enable=True):
    cfg = OmegaConf.create({"mrtpo": {"replay": {"enable": enable, "micro_batch": 2}},
                            "rollout": {"temperature": TAU}, "model": {}})  # fmt: skip
    return NS(config=cfg, actor=NS(engine=NS(module=model), model_config=NS(tokenizer=tok)))


def test_worker_method_and_driver_hook(monkeypatch):
    tok, model = _setup()
    data, raw, spans, responses = _batch(tok)
    want = _want(model, tok, raw, spans, responses)
    worker = _worker(model, tok)
    # the worker class: one more registered method, dispatched like compute_log_prob
    cls = verl.mrtpo_actor_worker_class()
    assert issubclass(cls, engine_workers.ActorRolloutRefWorker)
    method = getattr(cls, verl.REPLAY_METHOD)
    base = getattr(engine_workers.ActorRolloutRefWorker.compute_log_prob, MAGIC_ATTR)
    assert getattr(method, MAGIC_ATTR)["dispatch_mode"] is base["dispatch_mode"]
    # the driver hook around RayPPOTrainer._compute_old_log_prob (verl's own old-log-prob
    # step is stood in for; the hook adds the replay after it)
    calls = []
    monkeypatch.setattr(ray_trainer.RayPPOTrainer, "_compute_old_log_prob",
                        lambda self, batch: calls.append("old") or "old-out")  # fmt: skip
    verl.install_replay_hook()
    wg = NS(**{verl.REPLAY_METHOD: lambda td: method(worker, td)})
    trainer = NS(config=OmegaConf.create({"actor_rollout_ref": worker.config}),
                 actor_rollout_wg=wg)  # fmt: skip
    out = ray_trainer.RayPPOTrainer._compute_old_log_prob(trainer, data)
    assert out == "old-out" and calls == ["old"]
    rel = data.batch[verl.RELEVANCE_KEY]
    torch.testing.assert_close(rel.transpose(0, 1), want.relevance, rtol=1e-5, atol=1e-6)
    # switched off in the config: no replay, no keys
    data2, *_ = _batch(tok)
    trainer.config = OmegaConf.create({"actor_rollout_ref": _worker(model, tok, False).config})
    ray_trainer.RayPPOTrainer._compute_old_log_prob(trainer, data2)
    assert verl.RELEVANCE_KEY not in set(data2.batch.keys())


def test_version_check(monkeypatch):
    import verl as verl_pkg

    monkeypatch.setattr(verl_pkg, "__version__", "0.0.1")
    with pytest.raises(RuntimeError, match="verl 0.0.1"):
        verl.install_replay_hook()


def test_example_config_switches_the_replay_on():
    """examples/verl: its config turns the replay on, and its task runner gives the actor role
    the worker class that replays."""
    import importlib.util
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    here = Path(__file__).resolve().parents[2] / "examples" / "verl"
    spec = importlib.util.spec_from_file_location("main_mrtpo", here / "main_mrtpo.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with initialize_config_dir(config_dir=str(here), version_base=None):
        config = compose("mrtpo_trainer")
    opts = verl.replay_options(config.actor_rollout_ref)
    assert opts == {"spans_key": "mrtpo_spans", "prompt_key": "raw_prompt", "micro_batch": 16}
    runner = example.task_runner_class()()
    runner.add_actor_rollout_worker(config)
    (worker,) = runner.role_worker_mapping.values()
    assert issubclass(worker.__ray_metadata__.modified_class, verl.mrtpo_actor_worker_class())


def test_worker_method_on_an_fsdp_module():
    """The actor's module as verl holds it, wrapped by FSDP (one gloo rank on the CPU): the
    worker replays through the engine (sharded_replay) and gives the same relevance."""
    import os
    import socket

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("gloo")
    try:
        tok, model = _setup()
        data, raw, spans, responses = _batch(tok)
        want = _want(model, tok, raw, spans, responses)
        fsdp = FSDP(model, device_id=torch.device("cpu"), use_orig_params=False)
        td = left_right_2_no_padding(data.to_tensordict())
        out = verl.worker_compute_relevance(_worker(fsdp, tok), td)
        rel = out[verl.RELEVANCE_KEY].transpose(0, 1)
        torch.testing.assert_close(rel, want.relevance, rtol=1e-5, atol=1e-6)
        assert torch.equal(out[verl.HAS_INFO_KEY], want.has_info)
    finally:
        dist.destroy_process_group()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_driver_hook_around_verls_own_old_log_prob_step(monkeypatch):
    """verl's own RayPPOTrainer._compute_old_log_prob (its TensorDict round trip; the worker
    group stood in for, the actor's log-probs being zeros), with the hook: the old log-probs
    come back as verl makes them and the batch gets the replay's keys."""
    from verl.utils import tensordict_utils as tu

    tok, model = _setup()
    data, raw, spans, responses = _batch(tok)
    data.meta_info["temperature"] = TAU
    want = _want(model, tok, raw, spans, responses)
    worker = _worker(model, tok)
    method = getattr(verl.mrtpo_actor_worker_class(), verl.REPLAY_METHOD)

    def compute_log_prob(td):
        ids = td["input_ids"]
        zeros = torch.nested.nested_tensor_from_jagged(torch.zeros(ids.values().shape[0]),
                                                       offsets=ids.offsets())  # fmt: skip
        return tu.get_tensordict({"log_probs": zeros, "entropy": zeros},
                                 non_tensor_dict={"metrics": {"mfu": 0.0}})  # fmt: skip

    wg = NS(compute_log_prob=compute_log_prob,
            **{verl.REPLAY_METHOD: lambda td: method(worker, td)})  # fmt: skip
    original = ray_trainer.RayPPOTrainer._compute_old_log_prob
    monkeypatch.setattr(ray_trainer.RayPPOTrainer, "_compute_old_log_prob",
                        getattr(original, "original", original))  # fmt: skip
    verl.install_replay_hook()
    cfg = OmegaConf.create({"actor_rollout_ref": OmegaConf.merge(
        worker.config, {"actor": {"calculate_sum_pi_squared": False}})})  # fmt: skip
    trainer = NS(config=cfg, actor_rollout_wg=wg)
    old, mfu = ray_trainer.RayPPOTrainer._compute_old_log_prob(trainer, data)
    assert tuple(old.batch["old_log_probs"].shape) == (4, 5) and mfu == 0.0
    rel = data.batch[verl.RELEVANCE_KEY]
    torch.testing.assert_close(rel.transpose(0, 1), want.relevance, rtol=1e-5, atol=1e-6)
    assert torch.equal(data.batch[verl.HAS_INFO_KEY], want.has_info)


def _two_rank_main(rank: int, port: int, out: str, kind: str):
    """One rank of a two-process gloo group: the actor's module sharded (FSDP1 with one unit
    per decoder layer, or FSDP2's fully_shard on each layer and the root); rank 0's rows
    name spans, rank 1's none (it replays nothing and runs fewer forwards)."""
    import os

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        tok, model = _setup()
        data, raw, spans, responses = _batch(tok)
        if rank == 1:
            data.non_tensor_batch["mrtpo_spans"] = np.array(
                [[[], []] for _ in spans] + [None], dtype=object)[:-1]  # fmt: skip
        layer_cls = type(model.model.layers[0])
        if kind == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            module = FSDP(model, device_id=torch.device("cpu"), use_orig_params=False,
                          auto_wrap_policy=ModuleWrapPolicy({layer_cls}))  # fmt: skip
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (2,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            module = fully_shard(model, mesh=mesh)
        td = left_right_2_no_padding(data.to_tensordict())
        got = verl.worker_compute_relevance(_worker(module, tok), td)
        torch.save({k: got[k] for k in (verl.RELEVANCE_KEY, verl.HAS_INFO_KEY)},
                   os.path.join(out, f"{kind}.rank{rank}.pt"))  # fmt: skip
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
def test_worker_method_on_a_sharded_module_two_ranks_one_without_spans(kind, tmp_path):
    """Two gloo ranks, the module sharded with one unit per decoder layer, rank 1's rows
    naming no span: no hang (each layer's forward is a collective; the replay runs them in
    lockstep, mrtpo.integrations.engine), and rank 0's relevance is the unsharded one."""
    import socket
    import time

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_two_rank_main, args=(port, str(tmp_path), kind), nprocs=2,
                             join=False, start_method="spawn")  # fmt: skip
    deadline = time.monotonic() + 180
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{kind}: the two-rank replay hung")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    tok, model = _setup()
    _, raw, spans, responses = _batch(tok)
    want = _want(model, tok, raw, spans, responses)
    r0, r1 = (torch.load(tmp_path / f"{kind}.rank{r}.pt") for r in (0, 1))
    torch.testing.assert_close(r0[verl.RELEVANCE_KEY].transpose(0, 1), want.relevance,
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    assert torch.equal(r0[verl.HAS_INFO_KEY], want.has_info)
    assert not r1[verl.HAS_INFO_KEY].any() and not r1[verl.RELEVANCE_KEY].any()
