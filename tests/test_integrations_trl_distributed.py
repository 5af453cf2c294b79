"""MRTPOGRPOTrainer under two processes (gloo, CPU): each replays its own rows, the group
statistics use the rewards gathered over both, and the token advantages equal those of one
process on the same batch (a group spans the two processes here); the fused loss runs through
the DDP wrapper, so both ranks take the same step."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

WORLD, G, PER_DEVICE = 2, 4, 6  # 12 completions per step: groups 0-3, 4-7 (split), 8-11


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_group(rank: int, port: int) -> None:
    """This process as rank ``rank`` of the two-process gloo group on the CPU, one thread."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), ACCELERATE_USE_CPU="yes", OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
    )  # fmt: skip
    torch.set_num_threads(1)


def _config(output_dir: str):
    """One GRPO step at the tests' shape (both two-process tests train under it)."""
    return trl.GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=PER_DEVICE,
        num_generations=G, max_completion_length=6, max_steps=1, learning_rate=1e-2,
        beta=0.0, mask_truncated_completions=True, temperature=1.3, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
    )  # fmt: skip


def _rank_main(rank: int, port: int, out: str):
    _join_group(rank, port)
    import copy

    from test_integrations_trl_replay import (
        PROMPTS,
        WORDS,
        ends_bye,
        length,
        says_word,
        tiny_model,
        word_spans,
    )

    from mrtpo.integrations import trl_trainer

    records = []

    class Recording(trl_trainer.MRTPOGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            state = copy.deepcopy(self.accelerator.unwrap_model(self.model).state_dict())
            o = super()._generate_and_score_completions(inputs)
            records.append(dict(
                state=state, prompts=[x["prompt"] for x in inputs],
                rewards=self._mrtpo_rewards_per_func.cpu(),
                completion_ids=o["completion_ids"].cpu(), mask=o["completion_mask"].cpu(),
                advantages=o["advantages"].cpu(), relevance=self.last_replay["replay"].relevance,
                pairs=self.last_replay["replay"].replayed_pairs.cpu(),
            ))  # fmt: skip
            return o

    torch.manual_seed(0)
    model, tok = tiny_model()
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    ds = datasets.Dataset.from_dict({"prompt": prompts * 3, "topic": WORDS * 3})
    config = _config(os.path.join(out, "run"))
    trainer = Recording(
        model=model, reward_funcs=[says_word, ends_bye, length], args=config, train_dataset=ds,
        processing_class=tok, reward_spans=[word_spans, None, None],
    )  # fmt: skip
    assert trainer.accelerator.num_processes == WORLD
    trainer.train()
    final = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    torch.save(dict(records[0], final=final), os.path.join(out, f"rank{rank}.pt"))
    trainer.end_training()  # the gloo group closed before exit (see its docstring)


@pytest.mark.slow
def test_two_processes_give_the_advantages_of_one(tmp_path):
    from test_integrations_trl_replay import tiny_model, user_text

    from mrtpo.integrations.trl import mrtpo_advantages_for_grpo
    from mrtpo.replay.api import replay_relevance

    mp.spawn(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    recs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    rewards = recs[0]["rewards"]
    assert rewards.shape == (WORLD * PER_DEVICE, 3)
    torch.testing.assert_close(recs[1]["rewards"], rewards, rtol=0, atol=0)
    for key, val in recs[0]["state"].items():  # the same policy on both ranks
        torch.testing.assert_close(recs[1]["state"][key], val, rtol=0, atol=0)
    # one process, the same batch: both ranks' rows, padded to one width
    t = max(r["mask"].shape[1] for r in recs)

    def pad(x):
        return torch.nn.functional.pad(x, (0, t - x.shape[-1]))

    ids = torch.cat([pad(r["completion_ids"]) for r in recs])
    mask = torch.cat([pad(r["mask"]) for r in recs])
    prompts = [p for r in recs for p in r["prompts"]]
    spans = []
    for p in prompts:
        text = user_text(p)
        q = [i for i, ch in enumerate(text) if ch == '"']
        spans.append([[(q[0] + 1, q[1])], [(q[2] + 1, q[3])], []])
    model, tok = tiny_model()
    model.load_state_dict(recs[0]["state"])
    rep = replay_relevance(model.eval(), prompts, ids, spans, response_mask=mask,
                           tokenizer=tok, temperature=1.3)  # fmt: skip
    one = mrtpo_advantages_for_grpo(rewards, G, mask, rep.relevance, rep.has_info)
    two = torch.cat([pad(r["advantages"]) for r in recs])
    assert bool((two != 0).any())
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-6)
    # the pairs each rank replayed (GDPO advantage not 0 over both ranks' rewards) have the
    # one-process relevance; the others were skipped (relevance 0) and moved nothing
    rel_two = torch.cat([pad(r["relevance"]) for r in recs], dim=1)
    pairs = torch.cat([r["pairs"] for r in recs])  # (B, K)
    assert bool(pairs.any())
    keep = pairs.T[:, :, None].expand_as(rel_two)
    torch.testing.assert_close(rel_two[keep], rep.relevance[keep], rtol=1e-5, atol=1e-6)
    assert not bool(rel_two[~keep].any())
    # the fused loss ran through the DDP wrapper: the gradients were averaged, so the two
    # ranks (different rows) took the same step, and it moved the weights
    moved = False
    for key, val in recs[0]["final"].items():
        torch.testing.assert_close(recs[1]["final"][key], val, rtol=1e-6, atol=1e-7)
        moved = moved or not torch.equal(val, recs[0]["state"][key])
    assert moved


# --------------------------------------------------------------------------- no deadlock
# Issue 32, section 1: every collective runs on every rank whatever its rows hold. Each case
# trains one step under two gloo processes in which the two ranks' rows differ in what they
# name; a collective behind a data-dependent branch makes one rank wait forever, so the run
# has a deadline and a hang fails the test.

CASES = ("mixed-spans", "rank1-no-spans", "rank1-truncated-masked", "rank1-eos-only")
DEADLINE_S = 180


def _case_rank_main(rank: int, port: int, out: str):
    _join_group(rank, port)
    from test_integrations_trl_replay import (
        PROMPTS,
        WORDS,
        ends_bye,
        length,
        quoted,
        says_word,
        tiny_model,
        user_text,
    )

    from mrtpo.integrations import trl_trainer

    case = {"name": None}

    def on_rank(r):
        return case["name"] != "mixed-spans" or rank == r

    def word_spans(prompt, **columns):  # rank 0's rows only (mixed), never on rank 1 (no spans)
        if case["name"] == "rank1-no-spans" and rank == 1:
            return []
        return [quoted(user_text(prompt), 0)] if on_rank(0) else []

    def bye(prompts, completions, **kw):  # span-returning; rank 1's rows only in "mixed"
        scores = ends_bye(prompts, completions, **kw)
        if case["name"] == "rank1-no-spans" and rank == 1:
            return [float(s[0] if isinstance(s, tuple) else s.score) for s in scores]
        if not on_rank(1):
            return [(float(s[0] if isinstance(s, tuple) else s.score), []) for s in scores]
        return scores

    class Hostile(trl_trainer.MRTPOGRPOTrainer):
        def _mrtpo_spans(self, inputs, k):  # which (row, reward) name spans on this rank
            spans = super()._mrtpo_spans(inputs, k)
            self.named = None if spans is None else torch.tensor(
                [[bool(x) for x in row] for row in spans])  # fmt: skip
            return spans

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            ids, logps = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            if rank == 1 and case["name"] == "rank1-truncated-masked":
                ids = [[5, 6, 7, 8, 9, 10] for _ in ids]  # no EOS: truncated, then masked
            elif rank == 1 and case["name"] == "rank1-eos-only":
                ids = [[self._tokenizer.eos_token_id] for _ in ids]  # empty completions
            return ids, logps

    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    ds = datasets.Dataset.from_dict({"prompt": prompts * 3, "topic": WORDS * 3})
    for name in CASES:
        case["name"] = name
        torch.manual_seed(0)
        model, tok = tiny_model()
        config = _config(os.path.join(out, name))
        trainer = Hostile(
            model=model, reward_funcs=[says_word, bye, length], args=config, train_dataset=ds,
            processing_class=tok, reward_spans=[word_spans, None, None],
        )  # fmt: skip
        trainer.train()
        logged = trainer.state.log_history[0]
        final = trainer.accelerator.unwrap_model(trainer.model).state_dict()
        torch.save(
            dict(logged=logged, final=final, has_info=trainer.named),
            os.path.join(out, f"{name}.rank{rank}.pt"),
        )  # fmt: skip
    trainer.end_training()  # the gloo group closed before exit (see its docstring)


@pytest.mark.slow
def test_ranks_whose_rows_differ_never_deadlock(tmp_path):
    import time

    ctx = mp.start_processes(_case_rank_main, args=(_free_port(), str(tmp_path)),
                             nprocs=WORLD, join=False, start_method="spawn")  # fmt: skip
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                done = sorted(p.name for p in tmp_path.glob("*.pt"))
                pytest.fail(f"two-process TRL run hung (deadlock) after {DEADLINE_S} s; "
                            f"finished: {done}")  # fmt: skip
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    for name in CASES:
        recs = [torch.load(tmp_path / f"{name}.rank{r}.pt", weights_only=False)
                for r in range(WORLD)]  # fmt: skip
        # both ranks took the same (DDP-averaged) step and logged the same figures
        for key, val in recs[0]["final"].items():
            torch.testing.assert_close(recs[1]["final"][key], val, rtol=1e-6, atol=1e-7)
        assert recs[0]["logged"].keys() == recs[1]["logged"].keys(), name
        for key, val in recs[0]["logged"].items():  # MRTPO's figures: the same on every rank
            if key.startswith("mrtpo/"):
                assert recs[1]["logged"][key] == pytest.approx(val, rel=1e-12), (name, key)
        info = [r["has_info"] for r in recs]
        # every pair that names spans was replayed or skipped (its GDPO advantage is 0),
        # counted over both ranks
        named = sum(int(i.sum()) for i in info if i is not None)
        got = recs[0]["logged"]
        assert got["mrtpo/replay/pairs"] + got["mrtpo/replay/skipped"] == named, name
        if got["mrtpo/replay/pairs"] > 0:
            assert "mrtpo/replay_seconds" in got, name
        if name == "mixed-spans":  # says_word's spans on rank 0, ends_bye's on rank 1
            assert info[0][:, 0].all() and not info[0][:, 1].any()
            assert info[1][:, 1].all() and not info[1][:, 0].any()
            for reward in ("says_word", "bye"):
                assert recs[0]["logged"][f"mrtpo/relevance/{reward}"] >= 0
        elif name == "rank1-no-spans":  # rank 1 replayed nothing, yet took part
            assert info[0][:, :2].all() and info[1] is None
        else:
            assert info[0][:, :2].all() and info[1][:, :2].all()
