"""What the contrastive replay costs per step in each framework path, at K = 3 rewards.

    python -m bench.replay_cost --out DIR [--threads 1] [--model PATH|smollm2-135m-instruct]
    PYTHONPATH=. .venv-frameworks/bin/python -m bench.replay_cost --out DIR \
        --frameworks verl,openrlhf   # verl's and OpenRLHF's rows, merged into DIR

One row per framework path, each measured side by side (with and without the replay on the
same batch, interleaved A B B A over the repeats, medians reported):

- ``train``: ``mrtpo train``'s steps in process (``Trainer.train_step``, the per-phase
  timings of metrics.jsonl): ``--algo mrtpo`` against ``--algo gdpo --no-baseline-replay``.
  Before each pair the model, optimizer, RNG and prompt sampler are saved and restored, so
  both variants sample the same rollouts from the same weights.
- ``trl``: one step of the real ``MRTPOGRPOTrainer`` with ``reward_spans`` (replay on)
  against the same trainer without spans (every reward spread uniformly: GDPO); step wall
  time from a callback (generation, rewards, replay, loss, optimizer), beside TRL's logged
  ``mrtpo/replay_seconds``. Each repeat builds both trainers from the same initial weights
  and seed, so they see the same batch.
- ``verl`` and ``openrlhf`` (a proxy, stated in the row): ``fill_mrtpo_relevance`` on a
  padded ``DataProto`` / ``relevance_for_experience`` on an ``Experience``, against the same
  batch's policy forward + backward through the adapter's fused loss
  (``policy_loss_from_hidden`` / ``linear_policy_loss``). A real step also generates and
  computes old log-probs, so its ratio is lower than this one.

A framework that the running interpreter cannot import gets a row "not installed here". The
rows go to ``DIR/replay_cost.json`` (merged with the rows already there: a measured row
replaces one that was not installed), ``DIR/replay_cost.csv`` and ``DIR/replay_cost.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import importlib.util
import io
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

FRAMEWORKS = ("train", "trl", "verl", "openrlhf")
TARGET = 1.5
K = 3
ROOT = Path(__file__).resolve().parents[1]
FIELDS = (
    "framework", "status", "what", "with_s", "without_s", "ratio", "target", "replay_s",
    "repeats", "prompts", "group", "tokens", "k", "model", "threads", "load_1m", "python",
    "date", "note",
)  # fmt: skip
NOT_INSTALLED = "not installed here"

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


def load_1m() -> float:
    return round(os.getloadavg()[0], 2)


def venv_name() -> str:
    """The running environment, as its folder name (.venv, .venv-frameworks) and Python."""
    return f"{Path(sys.prefix).name} (Python {platform.python_version()})"


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
    from mrtpo.model import build_tiny_model, build_tokenizer, load_model

    if args.model:
        return load_model(args.model, cache_dir=args.cache_dir)
    from mrtpo.config import TinyConfig

    tok = build_tokenizer(texts, vocab_size=TinyConfig().vocab_size)
    return build_tiny_model(tok, TinyConfig(), seed=args.seed), tok


# --------------------------------------------------------------------------------------------
# mrtpo train


def run_train(args) -> dict:
    """``Trainer.train_step`` under algo mrtpo and gdpo (no baseline replay), same batch."""
    import torch

    from mrtpo.checkpoint import rng_state, set_rng_state
    from mrtpo.config import TinyConfig, TrainConfig
    from mrtpo.trainer import Trainer

    out = Path(args.work) / "train"
    cfg = TrainConfig(
        task="constraints", algo="mrtpo", seed=args.seed, steps=10**6, out=str(out),
        overwrite=True, model=args.model, prompts_per_step=args.prompts,
        group_size=args.group, max_new_tokens=args.tokens, device="cpu", threads=args.threads,
        checkpoint_every=10**6, html_samples=0, cache_dir=args.cache_dir,
        tiny=TinyConfig(warm_steps=0) if args.model is None else TinyConfig(),
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
        what="mrtpo train: Trainer.train_step (rollout + replay + update), --algo mrtpo vs "
        "--algo gdpo --no-baseline-replay, same rollouts",
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
        clock = Clock()
        trainer = MRTPOGRPOTrainer(
            model=copy.deepcopy(base), reward_funcs=rewards, args=config, train_dataset=ds,
            processing_class=tok, reward_spans=spans if with_replay else None,
            mrtpo_alpha=1.0, callbacks=[clock],
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

    from mrtpo.model import last_hidden, lm_head

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


# --------------------------------------------------------------------------------------------
# Rows and reports


def measure(framework: str, args) -> dict:
    import torch

    row = {f: "" for f in FIELDS}
    row.update(
        framework=framework, k=K, prompts=args.prompts, group=args.group, tokens=args.tokens,
        repeats=args.repeats, model=args.model or "tiny (built in code)", threads=args.threads,
        target=TARGET, load_1m=load_1m(), python=venv_name(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )  # fmt: skip
    missing = [m for m in NEEDS[framework] if not importable(m)]
    if missing:
        row.update(status=NOT_INSTALLED, note=f"{', '.join(missing)} not importable by "
                   f"{sys.executable}")  # fmt: skip
        return row
    torch.manual_seed(args.seed)
    try:
        got = RUNNERS[framework](args)
    except Exception as err:  # a row that says what failed; the other rows still run
        if args.strict:
            raise
        row.update(status="error", note=f"{type(err).__name__}: {' '.join(str(err).split())}"[:300])
        return row
    row.update({k: v for k, v in got.items() if k in FIELDS})
    row["status"] = "ok"
    w, wo = row["with_s"], row["without_s"]
    row["ratio"] = w / wo if wo and wo > 0 else float("nan")
    for key in ("with_s", "without_s", "replay_s"):
        row[key] = round(float(row[key]), 6)
    row["ratio"] = round(float(row["ratio"]), 4)
    row["extra"] = {k: v for k, v in got.items() if k not in FIELDS}
    return row


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """``new`` over ``old`` by framework; a row that was not installed never replaces a
    measured one."""
    by = {r["framework"]: r for r in old}
    for r in new:
        prev = by.get(r["framework"])
        if prev is not None and r["status"] == NOT_INSTALLED and prev["status"] != NOT_INSTALLED:
            continue
        by[r["framework"]] = r
    order = {f: i for i, f in enumerate(FRAMEWORKS)}
    return sorted(by.values(), key=lambda r: order.get(r["framework"], len(order)))


def _fmt(x, nd=3) -> str:
    if isinstance(x, float):
        return "-" if math.isnan(x) else f"{x:.{nd}f}"
    return str(x) if x != "" else "-"


def markdown(rows: list[dict], header: dict) -> str:
    lines = [
        "# Contrastive replay cost per step, K = 3 (`python -m bench.replay_cost`)",
        "",
        f"Command(s): {'; '.join(header['commands'])}",
        "",
        "| framework | status | with replay s | without s | ratio | target | replay s | "
        "load (1 min) at start | what |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = r["status"] == "ok"
        verdict = ""
        if ok and isinstance(r["ratio"], float) and not math.isnan(r["ratio"]):
            verdict = " (meets)" if r["ratio"] <= TARGET else " (over)"
        lines.append(
            f"| {r['framework']} | {r['status']} | {_fmt(r['with_s'])} | {_fmt(r['without_s'])} "
            f"| {_fmt(r['ratio'], 2)}{verdict} | <= {TARGET} | {_fmt(r['replay_s'])} | "
            f"{r['load_1m']} | {r['what'] or r['note']} |"
        )
    lines += ["", "Per row:", ""]
    for r in rows:
        lines.append(
            f"- {r['framework']}: B = {r['prompts']} prompts x {r['group']} responses, at most "
            f"{r['tokens']} response tokens, {r['repeats']} repeats, model {r['model']}, "
            f"threads {r['threads']}, {r['python']}, {r['date']}"
            + (f"; {r['note']}" if r["note"] and r["status"] == "ok" else "")
        )
    lines += [
        "",
        "Seconds are medians over the repeats, the two variants interleaved (A B, B A, ...) on",
        "the same batch. The machine is shared: the load column is `uptime`'s 1-minute",
        "average when the row started; ratios are meaningful, absolute seconds are not.",
        "",
    ]
    return "\n".join(lines)


def write(out: Path, rows: list[dict], commands: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "replay_cost.json").write_text(json.dumps({"commands": commands, "rows": rows},
                                                     indent=1, default=str) + "\n")  # fmt: skip
    with open(out / "replay_cost.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "replay_cost.md").write_text(markdown(rows, {"commands": commands}))


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.replay_cost", description=__doc__.split(
        "\n\n")[0])  # fmt: skip
    ap.add_argument("--out", required=True, help="folder for replay_cost.{json,csv,md}")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                    help=f"comma-separated subset of {','.join(FRAMEWORKS)}")  # fmt: skip
    ap.add_argument("--model", default=None, help="a local causal LM folder or a built-in name "
                    "(smollm2-135m-instruct); default: a tiny Qwen2 built in code")  # fmt: skip
    ap.add_argument("--cache-dir", default="runs/cache", help="where built-in models are cached")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="responses per prompt")
    ap.add_argument("--tokens", type=int, default=32, help="response length cap in tokens")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repeats first")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strict", action="store_true", help="raise instead of an error row")
    args = ap.parse_args(argv)
    names = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    bad = [f for f in names if f not in FRAMEWORKS]
    if bad or not names:
        ap.error(f"argument --frameworks: expected names from {','.join(FRAMEWORKS)}, got "
                 f"{args.frameworks!r}")  # fmt: skip
    args.frameworks = names
    for name in ("prompts", "group", "tokens", "repeats"):
        if getattr(args, name) < (2 if name == "group" else 1):
            ap.error(f"argument --{name}: expected at least {2 if name == 'group' else 1}")
    if args.warmup < 0 or args.threads < 0:
        ap.error("argument --warmup/--threads: expected a non-negative integer")
    return args


def main(argv=None) -> list[dict]:
    args = parse(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    command = " ".join(["python -m bench.replay_cost", *(sys.argv[1:] if argv is None else argv)])
    print(f"load at start: {os.getloadavg()}  ({platform.node()}, {sys.executable})", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        args.work = work
        for name in args.frameworks:
            row = measure(name, args)
            print(f"{name}: {row['status']} with {row['with_s']} s, without {row['without_s']} s,"
                  f" ratio {row['ratio']} ({row['note']})", flush=True)  # fmt: skip
            rows.append(row)
    old, commands = [], []
    if (out / "replay_cost.json").exists():
        prev = json.loads((out / "replay_cost.json").read_text())
        old, commands = prev["rows"], prev["commands"]
    write(out, merge(old, rows), commands + [command])
    print((out / "replay_cost.md").read_text())
    return rows


if __name__ == "__main__":
    main()
