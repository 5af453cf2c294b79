"""The contrastive replay's cost, per framework path: the measurements behind
``python -m bench.replay_cost`` (its docstring says what each path times). Each runner takes
the parsed arguments and returns seconds with and without the replay on the same batch;
``bench/replay_cost.py`` turns them into rows, tables and files.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import re
import statistics
import sys
import time
from pathlib import Path

K = 3  # rewards
ROOT = Path(__file__).resolve().parents[1]
# three verifiers, each checking one quoted phrase of the prompt: K = 3 rewards with spans
STARTS = ["Sure", "Well", "Today", "Yes"]
WORDS = ["blue", "owls", "rain", "gold", "stone", "river"]
ENDS = ["bye", "done", "the end", "thanks"]


def prompt_texts(n: int) -> list[str]:
    return [
        f'Start with "{STARTS[i % len(STARTS)]}", use the word "{WORDS[i % len(WORDS)]}" '
        f'and end with "{ENDS[i % len(ENDS)]}".'
        for i in range(n)
    ]


def quoted(text: str, n: int) -> tuple[int, int]:
    m = list(re.finditer(r'"([^"]+)"', text))[n]
    return (m.start(1), m.end(1))


def median(xs) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# --------------------------------------------------------------------------------------------
# Models


def build_model(args, texts):
    """(model, tokenizer): ``--model`` (a folder or a built-in name) or a tiny Qwen2 built in
    code with the built-in model's shape, its tokenizer trained on ``texts``."""
    from mrtpo.model.loading import build_tiny_model, build_tokenizer, load_model

    if args.model:
        return load_model(args.model, cache_dir=args.cache_dir)
    from mrtpo.training.config import TinyConfig

    tok = build_tokenizer(texts, vocab_size=TinyConfig().vocab_size)
    return build_tiny_model(tok, TinyConfig(), seed=args.seed), tok


# --------------------------------------------------------------------------------------------
# mrtpo train


def run_train(args) -> dict:
    """``Trainer.train_step`` under algo mrtpo and gdpo (no baseline replay), same batch."""
    import torch

    from mrtpo.training.checkpoint import rng_state, set_rng_state
    from mrtpo.training.config import TinyConfig, TrainConfig
    from mrtpo.training.trainer import Trainer

    out = Path(args.work) / "train"
    cfg = TrainConfig(
        task="constraints", algo="mrtpo", seed=args.seed, steps=10**6, out=str(out),
        overwrite=True, model=args.model, prompts_per_step=args.prompts,
        group_size=args.group, max_new_tokens=args.tokens, device="cpu", threads=args.threads,
        checkpoint_every=10**6, html_samples=0, cache_dir=args.cache_dir,
        tiny=TinyConfig(warm_steps=0) if args.model is None else TinyConfig(),
        replay_all=True,  # the replay's full cost: every pair with spans, none skipped
    )  # fmt: skip
    trainer = Trainer(cfg)
    if trainer.k != K:
        raise RuntimeError(f"the constraints task has {trainer.k} rewards, expected {K}")
    variants = {"with": ("mrtpo", True), "without": ("gdpo", False)}
    steps = {"with": [], "without": []}
    replays = {"with": [], "without": []}
    same_batch = True
    try:
        for r in range(args.warmup + args.repeats):
            saved = dict(
                model=copy.deepcopy(trainer.model.state_dict()),
                opt=copy.deepcopy(trainer.opt.state_dict()), rng=rng_state(),
                sampler=trainer.sampler.state(), step=trainer.step,
            )  # fmt: skip
            order = ("with", "without") if r % 2 == 0 else ("without", "with")
            rewards = []
            for i, name in enumerate(order):
                if i:
                    trainer.model.load_state_dict(saved["model"])
                    trainer.opt.load_state_dict(saved["opt"])
                    set_rng_state(saved["rng"])
                    trainer.sampler.load(saved["sampler"])
                    trainer.step = saved["step"]
                trainer.cfg.algo, trainer.cfg.replay_for_baselines = variants[name]
                row = trainer.train_step()
                rewards.append(row["mean_reward"])
                t = row["time"]
                if r >= args.warmup:
                    steps[name].append(t["rollout"] + t["replay"] + t["update"])
                    replays[name].append((t["replay"], t["replays"]))
            same_batch = same_batch and rewards[0] == rewards[1]
    finally:
        trainer.run_dir.unlock()
    with_s, without_s = median(steps["with"]), median(steps["without"])
    phase = median([a - b for (a, _), (b, _) in zip(replays["with"], replays["without"])])
    forwards = {k: max(n for _, n in v) for k, v in replays.items()}
    del torch
    return dict(
        what="mrtpo train: Trainer.train_step (rollout + replay + update), --algo mrtpo "
        "--replay-all (every pair replayed: the full cost, before the skip of pairs whose "
        "advantage is 0) vs --algo gdpo --no-baseline-replay, same rollouts",
        with_s=with_s, without_s=without_s, replay_s=phase,
        replay_forwards_with=forwards["with"], replay_forwards_without=forwards["without"],
        note=f"replay_s: replay phase of mrtpo minus gdpo's (old log-probs only); "
        f"replayed forwards {forwards['with']} vs {forwards['without']}; same batch: "
        f"{'yes' if same_batch else 'NO (rewards differ)'}",
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# TRL


def _reward_fns():
    def part(prompt):
        return prompt if isinstance(prompt, str) else prompt[-1]["content"]

    def completion(c):
        return c if isinstance(c, str) else c[0]["content"]

    def starts(prompts, completions, **kw):
        out = []
        for p, c in zip(prompts, completions):
            want = part(p)[slice(*quoted(part(p), 0))]
            out.append(sum(ch in want for ch in completion(c)[:4]) / 4.0)
        return out

    def word(prompts, completions, **kw):
        out = []
        for p, c in zip(prompts, completions):
            text, want = completion(c), part(p)[slice(*quoted(part(p), 1))]
            out.append(sum(ch in want for ch in text) / (1 + len(text)))
        return out

    def ends(prompts, completions, **kw):
        out = []
        for p, c in zip(prompts, completions):
            want = part(p)[slice(*quoted(part(p), 2))]
            out.append(sum(ch in want for ch in completion(c)[-4:]) / 4.0)
        return out

    def span_fn(n):
        def spans(prompt, **columns):
            return [quoted(part(prompt), n)]

        return spans

    return [starts, word, ends], [span_fn(0), span_fn(1), span_fn(2)]


def run_trl(args) -> dict:
    import datasets
    import torch
    import trl
    from transformers import TrainerCallback

    from mrtpo.integrations.trl_trainer import MRTPOGRPOTrainer

    texts = prompt_texts(args.prompts)
    base, tok = build_model(args, texts * 4 + [" ".join(WORDS + ENDS + STARTS)])
    rewards, spans = _reward_fns()
    ds = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": t}] for t in texts]})

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    def one_step(with_replay: bool):
        torch.manual_seed(args.seed)
        config = trl.GRPOConfig(
            output_dir=str(Path(args.work) / "trl"), per_device_train_batch_size=len(texts)
            * args.group, num_generations=args.group, max_completion_length=args.tokens,
            max_steps=1, learning_rate=1e-5, beta=0.0, loss_type="grpo", logging_steps=1,
            report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=args.seed,
            disable_tqdm=True, shuffle_dataset=False,
        )  # fmt: skip
        config.mrtpo_replay_all = True  # the replay's full cost: no pair skipped
        clock = Clock()
        trainer = MRTPOGRPOTrainer(
            model=copy.deepcopy(base), reward_funcs=rewards, args=config, train_dataset=ds,
            processing_class=tok, reward_spans=spans if with_replay else None,
            callbacks=[clock],  # alpha: MRTPOConfig's default, 1.0
        )  # fmt: skip
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
        logged = next(h for h in trainer.state.log_history if "mrtpo/replay_seconds" in h or
                      "loss" in h)  # fmt: skip
        return clock.times[0], logged.get("mrtpo/replay_seconds", 0.0)

    steps = {"with": [], "without": []}
    replay_logged = []
    for r in range(args.warmup + args.repeats):
        order = (True, False) if r % 2 == 0 else (False, True)
        for with_replay in order:
            secs, logged = one_step(with_replay)
            if r >= args.warmup:
                steps["with" if with_replay else "without"].append(secs)
                if with_replay:
                    replay_logged.append(logged)
    return dict(
        what="TRL: one MRTPOGRPOTrainer step (generate, rewards, replay, loss, optimizer) "
        "with reward_spans vs without spans (GDPO), same initial weights and batch",
        with_s=median(steps["with"]), without_s=median(steps["without"]),
        replay_s=median(replay_logged),
        note="replay_s: TRL's logged mrtpo/replay_seconds; step time from a callback",
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# verl and OpenRLHF: the replay against the policy forward + backward (a proxy)


def _batch_rows(args, tok):
    """Chat prompts (message lists), their K = 3 spans and sampled-looking responses: the
    same rows for verl and OpenRLHF."""
    import torch

    texts = prompt_texts(args.prompts)
    gen = torch.Generator().manual_seed(args.seed)
    specials = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in specials]
    msgs, spans, responses = [], [], []
    for t in texts:
        for _ in range(args.group):
            msgs.append([{"role": "user", "content": t}])
            spans.append([[(0, *quoted(t, n))] for n in range(K)])
            n = int(torch.randint(max(1, args.tokens // 2), args.tokens + 1, (1,), generator=gen))
            picks = torch.randint(0, len(vocab), (n,), generator=gen).tolist()
            responses.append([vocab[j] for j in picks])
    return msgs, spans, responses


def _fwd_bwd(model, ids, att, responses, a, loss_fn):
    """One policy forward + backward on the last ``a`` positions through ``loss_fn``."""
    import torch

    from mrtpo.model.loading import last_hidden, lm_head

    weight, _ = lm_head(model)
    labels = torch.full((len(responses), a), -100, dtype=torch.long)
    for i, r in enumerate(responses):
        labels[i, : len(r)] = torch.tensor(r)
    gen = torch.Generator().manual_seed(1)
    adv = torch.randn(labels.shape, generator=gen)
    old = -torch.rand(labels.shape, generator=gen) * 5
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    hidden = last_hidden(model, ids, att)[:, -a - 1 : -1]
    loss, _ = loss_fn(hidden, weight, labels, old, adv)
    loss.backward()
    return time.perf_counter() - t0


def _proxy(args, replay, fwd_bwd) -> dict:
    with_s, without_s, rep_s = [], [], []
    for r in range(args.warmup + args.repeats):
        parts = {}
        for name in ("replay", "update") if r % 2 == 0 else ("update", "replay"):
            parts[name] = replay() if name == "replay" else fwd_bwd()
        if r >= args.warmup:
            rep_s.append(parts["replay"])
            without_s.append(parts["update"])
            with_s.append(parts["update"] + parts["replay"])
    return dict(with_s=median(with_s), without_s=median(without_s), replay_s=median(rep_s))


def run_verl(args) -> dict:
    import numpy as np
    import torch
    from verl import DataProto

    from mrtpo.integrations import verl

    model, tok = build_model(args, prompt_texts(args.prompts) * 4 + [" ".join(WORDS + ENDS)])
    msgs, spans, responses = _batch_rows(args, tok)
    prompt_ids = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
                  ["input_ids"] for m in msgs]  # fmt: skip
    b, p, t = len(msgs), max(map(len, prompt_ids)), args.tokens
    pad = tok.pad_token_id
    prompts = torch.full((b, p), pad)
    resp = torch.full((b, t), pad)
    att = torch.zeros((b, p + t), dtype=torch.long)
    for i, (q, r) in enumerate(zip(prompt_ids, responses)):
        prompts[i, p - len(q) :] = torch.tensor(q)
        resp[i, : len(r)] = torch.tensor(r)
        att[i, p - len(q) : p + len(r)] = 1

    def batch():
        obj = np.empty(b, dtype=object)
        sp = np.empty(b, dtype=object)
        for i in range(b):
            obj[i], sp[i] = msgs[i], spans[i]
        return DataProto.from_dict(
            tensors={"prompts": prompts, "responses": resp, "input_ids": torch.cat([prompts, resp],
                     1), "attention_mask": att, "position_ids": (att.cumsum(-1) - 1).clamp(min=0),
                     "response_mask": att[:, p:]},
            non_tensors={"raw_prompt": obj, "mrtpo_spans": sp,
                         "uid": np.array([str(i // args.group) for i in range(b)], dtype=object)},
        )  # fmt: skip

    def replay():
        data = batch()
        model.eval()
        t0 = time.perf_counter()
        verl.fill_mrtpo_relevance(data, model, tok, temperature=1.0)
        secs = time.perf_counter() - t0
        assert tuple(data.batch[verl.RELEVANCE_KEY].shape) == (b, K, t)
        return secs

    def loss_fn(hidden, weight, labels, old, adv):
        return verl.policy_loss_from_hidden(hidden, weight, labels, old, adv,
                                            loss_agg_mode="token-mean")  # fmt: skip

    def fwd_bwd():
        model.train()
        return _fwd_bwd(model, torch.cat([prompts, resp], 1), att, responses, t, loss_fn)

    out = _proxy(args, replay, fwd_bwd)
    out.update(
        what="verl (proxy): fill_mrtpo_relevance on a padded DataProto vs the same batch's "
        "policy forward + backward through policy_loss_from_hidden",
        note="no rollout engine and no old log-prob forward in the base: a real step's "
        "ratio is lower",
    )  # fmt: skip
    return out


def _openrlhf_experience():
    """OpenRLHF's Experience class (imported with the test stubs for flash_attn and vllm,
    which it imports at module level), or None."""
    stubs = ROOT / "tests" / "framework_stubs"
    try:
        import peft  # noqa: F401

        sys.path.insert(0, str(stubs))
        try:
            mod = importlib.import_module("openrlhf.trainer.ppo_utils.experience")
        finally:
            sys.path.remove(str(stubs))
            for key in [k for k in sys.modules if k.split(".")[0] in ("flash_attn", "vllm")]:
                del sys.modules[key]
        return mod.Experience
    except ImportError:
        return None


def run_openrlhf(args) -> dict:
    import torch

    from mrtpo.integrations import openrlhf
    from mrtpo_kernels import linear_policy_loss

    Experience = _openrlhf_experience()
    model, tok = build_model(args, prompt_texts(args.prompts) * 4 + [" ".join(WORDS + ENDS)])
    msgs, spans_msg, responses = _batch_rows(args, tok)
    # OpenRLHF's prompts are the chat-templated text; spans in its coordinates
    prompts, spans = [], []
    for m, sp in zip(msgs, spans_msg):
        text = tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        off = text.index(m[0]["content"])
        prompts.append(text)
        spans.append([[(off + s, off + e) for _, s, e in row] for row in sp])
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    b, pw, a = len(prompts), max(map(len, ids)), args.tokens
    seq = torch.full((b, pw + a), tok.pad_token_id)
    att = torch.zeros((b, pw + a), dtype=torch.long)
    act = torch.zeros((b, a), dtype=torch.bool)
    for i, (q, r) in enumerate(zip(ids, responses)):
        seq[i, pw - len(q) : pw] = torch.tensor(q)
        seq[i, pw : pw + len(r)] = torch.tensor(r)
        att[i, pw - len(q) : pw + len(r)] = 1
        act[i, : len(r)] = True
    fields = dict(sequences=seq, attention_mask=att, action_mask=act, prompts=prompts)
    if Experience is not None:
        exp = Experience(**fields)
    else:
        from types import SimpleNamespace

        exp = SimpleNamespace(**fields)

    def replay():
        model.eval()
        t0 = time.perf_counter()
        rel, _ = openrlhf.relevance_for_experience(model, exp, spans, tokenizer=tok,
                                                   temperature=1.0)  # fmt: skip
        secs = time.perf_counter() - t0
        assert tuple(rel.shape) == (K, b, a)
        return secs

    def loss_fn(hidden, weight, labels, old, adv):
        return linear_policy_loss(hidden, weight, labels, old, adv, aggregation="token-mean")

    def fwd_bwd():
        model.train()
        return _fwd_bwd(model, seq, att, responses, a, loss_fn)

    out = _proxy(args, replay, fwd_bwd)
    layout = "Experience" if Experience is not None else "Experience-shaped namespace"
    out.update(
        what=f"OpenRLHF (proxy): relevance_for_experience on a left-padded {layout} vs the "
        "same batch's policy forward + backward through linear_policy_loss",
        note="no rollout engine and no old log-prob forward in the base: a real step's "
        "ratio is lower",
    )  # fmt: skip
    return out


RUNNERS = {"train": run_train, "trl": run_trl, "verl": run_verl, "openrlhf": run_openrlhf}
NEEDS = {"train": (), "trl": ("trl", "datasets"), "verl": ("verl",), "openrlhf": ("openrlhf",)}
