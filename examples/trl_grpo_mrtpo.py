"""GRPO with MRTPO credit assignment in TRL: MRTPOGRPOTrainer replays each reward's spans itself.

A conversational dataset (system + user messages) and three verifiers:
- ``says_word``: the response contains the quoted word; its span is named by a span function
  (``reward_spans``), from the prompt alone;
- ``ends_with``: the response ends with the word the prompt asks for; the reward function
  returns ``(score, spans)`` per sample, spans as (message index, start, end);
- ``short``: a length reward that names no span (spread uniformly over tokens, as in GDPO).
Or, with ``--task NAME``, a built-in task's dataset and verifiers (constraints, sql, tools,
tools-bfcl, ...: ``verifier_reward``), which name their spans themselves.
No relevance code is written here: the trainer removes each reward's spans from the prompt,
re-renders it with the chat template and teacher-forces the responses after it.

    python examples/trl_grpo_mrtpo.py                 # tiny model built in code, CPU
    python examples/trl_grpo_mrtpo.py --model smollm2-135m-instruct --task constraints-real \
        --warm-steps 30 --warm-noise 0.6 --steps 20 --batch 16 --generations 8 \
        --max-completion 48 --lr 2e-5                 # warm-started first (cached)
    python examples/trl_grpo_mrtpo.py --model PATH    # any local Hugging Face causal LM
    torchrun --nproc_per_node 2 examples/trl_grpo_mrtpo.py   # two processes (gloo on CPU)

After training it prints, for a few samples of the last batch, each reward's top-relevance
response tokens beside the prompt text its verifier names.
"""

from __future__ import annotations

import argparse
import re

import torch

WORDS = ["blue", "gold", "owls", "rain", "cat", "tree", "salt", "moon"]
ENDS = ["now", "then", "here", "soon"]
SYSTEM = {"role": "system", "content": "Answer in one short line."}


def make_prompt(i: int) -> list[dict]:
    w, e = WORDS[i % len(WORDS)], ENDS[i % len(ENDS)]
    user = f'Write a line that says the word "{w}" and ends with "{e}".'
    return [SYSTEM, {"role": "user", "content": user}]


def quoted(text: str, n: int) -> tuple[int, int]:
    m = list(re.finditer(r'"([^"]+)"', text))[n]
    return m.start(1), m.end(1)


def _text(completion) -> str:  # conversational completions are [{"role", "content"}]
    return completion if isinstance(completion, str) else completion[0]["content"]


def says_word(prompts, completions, **kwargs):
    return [float(p[-1]["content"][slice(*quoted(p[-1]["content"], 0))] in _text(c))
            for p, c in zip(prompts, completions)]  # fmt: skip


def says_word_spans(prompt, **columns):
    """What says_word checks: the quoted word of the user message (message index 1)."""
    return [(len(prompt) - 1, *quoted(prompt[-1]["content"], 0))]


def ends_with(prompts, completions, **kwargs):
    out = []
    for p, c in zip(prompts, completions):
        s, e = quoted(p[-1]["content"], 1)
        score = float(_text(c).rstrip(" .!").endswith(p[-1]["content"][s:e]))
        out.append((score, [(len(p) - 1, s, e)]))  # the score and the span it checked
    return out


def short(completions, **kwargs):
    return [1.0 - min(len(_text(c)), 60) / 60.0 for c in completions]


def tiny_model(texts=None):
    from mrtpo.model import TinyConfig, build_tiny_model, build_tokenizer

    if texts is None:
        texts = [m["content"] for i in range(len(WORDS)) for m in make_prompt(i)] * 8
        texts += [" ".join(WORDS + ENDS)] * 8
    tok = build_tokenizer(texts)
    cfg = TinyConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                     num_kv_heads=1, max_positions=512)  # fmt: skip
    model = build_tiny_model(tok, cfg, seed=0)
    # an untrained model rarely stops: favour EOS so that some completions end in time
    head = torch.nn.Linear(cfg.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.get_output_embeddings().weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 4.0
    model.config.tie_word_embeddings = False
    model.lm_head = head
    return model, tok


def show_top_tokens(trainer, tok, samples: int = 3, top: int = 3) -> list[str]:
    """Each reward's top-relevance response tokens beside the prompt text it names."""
    last = getattr(trainer, "last_replay", None)
    if last is None:
        return []
    rep, lines = last["replay"], []
    names = trainer.reward_func_names
    shown = 0
    for i in range(len(last["prompts"])):
        mask = rep.response_mask[i]
        ids = last["completion_ids"][i][mask.to(last["completion_ids"].device)].tolist()
        if not ids:  # a truncated completion, masked
            continue
        if shown == samples:
            break
        shown += 1
        lines.append(f"sample {i}: {tok.decode(ids)!r}")
        for k, name in enumerate(names):
            spans = last["spans"][i][k]
            if not spans:
                lines.append(f"  {name}: no span (uniform)")
                continue
            prompt = last["prompts"][i]
            named = [prompt[sp[0]]["content"][sp[1] : sp[2]] if len(sp) == 3
                     else prompt[-1]["content"][sp[0] : sp[1]] for sp in spans]  # fmt: skip
            rel = rep.relevance[k, i][mask]
            best = rel.topk(min(top, rel.numel())).indices.tolist()
            toks = [f"{tok.decode([ids[t]])!r}:{rel[t].item():.3f}" for t in best]
            lines.append(f"  {name}: names {named}; top tokens {', '.join(toks)}")
    if not shown:
        lines.append("(every completion of the last batch was truncated, hence masked: "
                     "raise --max-completion)")  # fmt: skip
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None,
                    help="a local model path or a built-in name (default: tiny)")  # fmt: skip
    ap.add_argument("--task", default=None,
                    help="a built-in task (mrtpo.tasks): its prompts and verifiers")  # fmt: skip
    ap.add_argument(
        "--warm-steps",
        type=int,
        default=0,
        help="with a built-in --model and a --task: first warm-start it this many "
        "supervised steps on the task's references (built once, cached)",
    )
    ap.add_argument(
        "--warm-noise",
        type=float,
        default=0.0,
        help="the warm start's reference noise (as mrtpo train's --warm-noise)",
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="per-device train batch size")
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--max-completion", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default="runs/trl_grpo_mrtpo")
    ap.add_argument(
        "--replay-all",
        action="store_true",
        help="replay pairs whose advantage is 0 too (relevance on every pair)",
    )
    args = ap.parse_args(argv)
    if args.warm_steps < 0:
        ap.error(f"--warm-steps: expected an int >= 0, got {args.warm_steps}")
    if not 0.0 <= args.warm_noise <= 1.0:
        ap.error(f"--warm-noise: expected a probability in [0, 1], got {args.warm_noise}")
    if args.warm_steps:
        from mrtpo.model.builtin import is_builtin

        if args.task is None or not is_builtin(args.model):
            ap.error("--warm-steps: needs a built-in --model (smollm2-135m-instruct) and a "
                     f"--task, got --model {args.model} --task {args.task}")  # fmt: skip

    import datasets

    from mrtpo.integrations.trl_trainer import (
        MRTPOConfig,
        MRTPOGRPOTrainer,
        example_row,
        verifier_reward,
    )

    task = None
    if args.task is not None:
        from mrtpo.tasks import load_task

        task = load_task(args.task)
    torch.manual_seed(0)
    if args.model is None:
        if task is None:
            model, tok = tiny_model()
        else:
            from mrtpo.model import task_texts

            model, tok = tiny_model(task_texts(task))
    else:
        from mrtpo.model import load_model

        path = args.model
        if args.warm_steps:  # the built-in model after a supervised warm start on the task
            from mrtpo.model.builtin import user_cache_dir
            from mrtpo.model.initial import initial_folder

            path = initial_folder(
                args.model,
                task,
                seed=0,
                cache_dir=user_cache_dir(),
                warm_steps=args.warm_steps,
                warm_noise=args.warm_noise,
            )
        model, tok = load_model(path)
    # beta > 0: TRL's reference model; a model built in code (no name TRL can load) gets a
    # frozen copy of itself
    config = MRTPOConfig(
        output_dir=args.out, per_device_train_batch_size=args.batch,
        num_generations=args.generations, max_completion_length=args.max_completion,
        max_steps=args.steps, learning_rate=args.lr, beta=args.beta,
        temperature=args.temperature, mask_truncated_completions=True, logging_steps=1,
        report_to=[], save_strategy="no", seed=0,  # on a CPU: use_cpu, bf16 off
        mrtpo_alpha=args.alpha, mrtpo_replay_all=args.replay_all,
    )  # fmt: skip
    if task is None:
        dataset = datasets.Dataset.from_dict({"prompt": [make_prompt(i) for i in range(32)]})
        rewards = dict(
            reward_funcs=[says_word, ends_with, short], reward_spans=[says_word_spans, None, None]
        )  # ends_with names its own
    else:  # the task's examples as rows; each verifier returns its score and spans
        dataset = datasets.Dataset.from_list([example_row(ex) for ex in task.train])
        rewards = dict(reward_funcs=[verifier_reward(v) for v in task.verifiers])
    trainer = MRTPOGRPOTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tok, **rewards
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if trainer.accelerator.is_main_process:
        state = trainer.accelerator.state
        print(f"processes: {state.num_processes} ({state.distributed_type.value}, "
              f"backend {state.backend or 'none'})")  # fmt: skip
    for h in logs if trainer.accelerator.is_main_process else []:
        rel = " ".join(f"{k.split('/')[-1]} {v:.4f}" for k, v in h.items()
                       if k.startswith("mrtpo/relevance/"))  # fmt: skip
        secs = h.get("mrtpo/replay_seconds", float("nan"))
        print(f"step {h['step']}: loss {h['loss']:.4f} reward {h.get('reward', float('nan')):.3f}"
              f" replay {secs:.3f}s relevance {rel}")  # fmt: skip
    if trainer.accelerator.is_main_process:
        for line in show_top_tokens(trainer, tok):
            print(line)
    # several processes: every rank waits for the others, then the process group closes
    # (MRTPOGRPOTrainer.end_training says why a gloo group must not be left to exit)
    trainer.end_training()
    return logs


if __name__ == "__main__":
    main()
