"""The contrastive replay inside OpenRLHF 0.11.2 (run by `make test-frameworks`): real
`Experience` objects as its samples generator builds them (one sample each, action mask over
the next-token positions), concatenated by `Experience.concat_experiences` (right-padded), a
left-padded layout, and a multi-turn row whose actions are split by an observation; each gives
the relevance of `mrtpo.replay.api.replay_relevance` on the same rows, and feeds the adapter's
advantages."""

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

pytest.importorskip("openrlhf", reason="OpenRLHF runs in .venv-frameworks (make test-frameworks)")

STUBS = Path(__file__).resolve().parents[1] / "framework_stubs"


def _import_with_stubs(name):
    import peft  # noqa: F401

    sys.path.insert(0, str(STUBS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(STUBS))
        for key in [k for k in sys.modules if k.split(".")[0] in ("flash_attn", "vllm")]:
            del sys.modules[key]


Experience = _import_with_stubs("openrlhf.trainer.ppo_utils.experience").Experience

from mrtpo.integrations import openrlhf  # noqa: E402
from mrtpo.model.loading import TinyConfig, build_tiny_model, build_tokenizer  # noqa: E402
from mrtpo.replay.api import replay_relevance  # noqa: E402

USERS = ['Write about owls. Include the word "blue".', 'Write about rain. End with "bye now".']
TAU = 1.2


def _setup():
    tok = build_tokenizer(USERS * 4 + ["hello blue owls", "rain bye now"], vocab_size=300)
    cfg = TinyConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=2, num_kv_heads=1)  # fmt: skip
    model = build_tiny_model(tok, cfg, seed=0).eval()
    # OpenRLHF's dataset applies the chat template: its prompts are rendered strings
    texts = [tok.apply_chat_template([{"role": "user", "content": u}], tokenize=False,
                                     add_generation_prompt=True) for u in USERS]  # fmt: skip
    prompts = [texts[0], texts[0], texts[1], texts[1]]
    spans = []
    for p in prompts:
        q = p.index('"')
        spans.append([[(q + 1, p.index('"', q + 1))], [] if p is texts[0] else [(0, 3)]])
    responses = [[10, 11, 12, tok.eos_token_id], [13, 14], [15, 16, 17, 18, 19], [20]]
    return tok, model, prompts, spans, responses


def _sample(tok, prompt, response):
    """One Experience as OpenRLHF's samples generator builds it."""
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    seq = torch.tensor([p + response])
    action = torch.zeros(seq.shape[1], dtype=torch.long)
    action[len(p) : len(p) + len(response)] = 1
    return Experience(sequences=seq, attention_mask=torch.ones_like(seq),
                      action_mask=action[1:].bool().unsqueeze(0), prompts=[prompt])  # fmt: skip


def test_samples_and_concatenated_experience_equal_the_neutral_replay():
    tok, model, prompts, spans, responses = _setup()
    want = replay_relevance(model, prompts, responses, spans, tokenizer=tok, temperature=TAU,
                            add_special_tokens=False)  # fmt: skip
    assert bool((want.relevance > 0).any())
    samples = [_sample(tok, p, r) for p, r in zip(prompts, responses)]
    per = [openrlhf.relevance_for_experience(model, e, [s], tokenizer=tok, temperature=TAU)
           for e, s in zip(samples, spans)]  # fmt: skip
    for i, ((rel, info), r) in enumerate(zip(per, responses)):
        got = rel[:, 0][:, samples[i].action_mask[0]]
        torch.testing.assert_close(got, want.relevance[:, i, : len(r)], rtol=1e-5, atol=1e-6)
        assert torch.all(rel[:, 0][:, ~samples[i].action_mask[0]] == 0)
        assert info[0].tolist() == want.has_info[i].tolist()
    batch = Experience.concat_experiences(samples, pad_token_id=tok.pad_token_id)
    rel, info = openrlhf.relevance_for_experience(model, batch, spans, tokenizer=tok,
                                                  temperature=TAU)  # fmt: skip
    assert rel.shape == (2, 4, batch.action_mask.shape[1])
    for i, r in enumerate(responses):
        got = rel[:, i][:, batch.action_mask[i].bool()]
        torch.testing.assert_close(got, want.relevance[:, i, : len(r)], rtol=1e-5, atol=1e-6)
    assert torch.equal(info, want.has_info)
    # the adapter's advantages from it (two prompts of two samples each)
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.5], [0.0, 0.0]])
    adv = openrlhf.mrtpo_token_advantages_from_experience(rewards, 2, batch.action_mask, rel,
                                                          info)  # fmt: skip
    assert torch.isfinite(adv).all() and torch.all(adv[~batch.action_mask.bool()] == 0)


def test_left_padded_and_multi_turn_layouts():
    tok, model, prompts, spans, responses = _setup()
    want = replay_relevance(model, prompts, responses, spans, tokenizer=tok, temperature=TAU,
                            add_special_tokens=False)  # fmt: skip
    # left-padded prompts, right-padded responses, the action mask over the last A positions
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    pw, a = max(map(len, ids)), max(map(len, responses))
    seq = torch.full((4, pw + a), tok.pad_token_id)
    att = torch.zeros((4, pw + a), dtype=torch.long)
    act = torch.zeros((4, a), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(ids, responses)):
        seq[i, pw - len(p) : pw] = torch.tensor(p)
        seq[i, pw : pw + len(r)] = torch.tensor(r)
        att[i, pw - len(p) : pw + len(r)] = 1
        act[i, : len(r)] = True
    exp = NS(sequences=seq, attention_mask=att, action_mask=act, prompts=prompts)
    rel, _ = openrlhf.relevance_for_experience(model, exp, spans, tokenizer=tok, temperature=TAU)
    torch.testing.assert_close(rel[:, :, : want.relevance.shape[2]], want.relevance,
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    # multi-turn: an observation (not an action) between two actions of row 2 is
    # teacher-forced but gets no relevance
    row = _sample(tok, prompts[2], responses[2])
    obs = row.action_mask.clone()
    gap = int(obs[0].nonzero()[1])
    obs[0, gap] = False
    row.action_mask = obs
    rel, _ = openrlhf.relevance_for_experience(model, row, [spans[2]], tokenizer=tok,
                                               temperature=TAU)  # fmt: skip
    assert torch.all(rel[:, 0, gap] == 0)
    full = want.relevance[:, 2, : len(responses[2])]
    keep = torch.ones(len(responses[2]), dtype=torch.bool)
    keep[1] = False
    torch.testing.assert_close(rel[:, 0][:, obs[0]], full[:, keep], rtol=1e-5, atol=1e-6)


def test_prompt_mismatch_and_empty_rows():
    tok, model, prompts, spans, responses = _setup()
    e = _sample(tok, prompts[0], responses[0])
    with pytest.raises(ValueError, match="prompt_ids: row 0"):
        openrlhf.relevance_for_experience(model, e, [spans[0]], tokenizer=tok, temperature=TAU,
                                          prompts=[prompts[2]])  # fmt: skip
    e.action_mask = torch.zeros_like(e.action_mask)  # no action token: an empty row
    rel, info = openrlhf.relevance_for_experience(model, e, [spans[0]], tokenizer=tok,
                                                  temperature=TAU)  # fmt: skip
    assert torch.all(rel == 0) and info.shape == (1, 2)


# --------------------------------------------------------------------------- ZeRO-3
# OpenRLHF's actor on DeepSpeed ZeRO-3 (as its strategy prepares it: ``actor.model`` the
# engine), two gloo processes on the CPU: rank 0's experience names spans, rank 1's names
# none (it still joins every collective). Every parameter is partitioned (DeepSpeed keeps
# parameters under 1e5 elements whole by default: all of the tiny model's).


def _zero3_rank(rank: int, port: int, out: str):
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      DS_ACCELERATOR="cpu")  # fmt: skip
    torch.set_num_threads(1)
    import copy

    import deepspeed

    # test-only: no shared-memory all-reduce, which DeepSpeed compiles on first use
    # (minutes): its collectives go to gloo as they are
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    actor_mod = _import_with_stubs("openrlhf.models.actor")
    deepspeed.init_distributed(dist_backend="gloo")
    tok, model, prompts, spans, responses = _setup()
    base = copy.deepcopy(model)
    actor = actor_mod.Actor(model)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=actor.model, config=config,
                                      model_parameters=actor.model.parameters())  # fmt: skip
    actor.model = engine  # as OpenRLHF's DeepspeedStrategy._ds_init_train_model does
    head = engine.module.get_output_embeddings().weight
    partitioned = head.numel() == 0 and head.ds_tensor.numel() < head.ds_numel
    batch = Experience.concat_experiences(
        [_sample(tok, p, r) for p, r in zip(prompts, responses)], pad_token_id=tok.pad_token_id
    )
    mine = spans if rank == 0 else [[[], []] for _ in spans]  # rank 1: no span anywhere
    engine.eval()
    rel, info = openrlhf.relevance_for_experience(actor, batch, mine, tokenizer=tok,
                                                  temperature=TAU)  # fmt: skip
    # a second call: the ranks stay in step call after call
    rel2, _ = openrlhf.relevance_for_experience(actor, batch, mine, tokenizer=tok,
                                                temperature=TAU)  # fmt: skip
    want = openrlhf.relevance_for_experience(base.eval(), batch, spans, tokenizer=tok,
                                             temperature=TAU)  # fmt: skip
    torch.save(dict(rel=rel, rel2=rel2, info=info, want=want, partitioned=partitioned),
               os.path.join(out, f"rank{rank}.pt"))  # fmt: skip
    torch.distributed.barrier()


@pytest.mark.slow
def test_replay_on_a_zero3_actor_two_ranks_one_without_spans(tmp_path):
    import socket
    import time

    import torch.multiprocessing as mp

    pytest.importorskip("deepspeed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_zero3_rank, args=(port, str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")  # fmt: skip
    deadline = time.monotonic() + 300
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail("the replay on ZeRO-3 hung (the ranks ran different collectives)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["partitioned"] and r1["partitioned"]
    want_rel, want_info = r0["want"]
    assert bool((want_rel > 0).any())
    for rel in (r0["rel"], r0["rel2"]):  # rank 0: the unsharded model's relevance
        torch.testing.assert_close(rel, want_rel, rtol=1e-5, atol=1e-6)
    assert torch.equal(r0["info"], want_info)
    assert torch.all(r1["rel"] == 0) and not bool(r1["info"].any())
