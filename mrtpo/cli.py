"""The ``mrtpo`` command line: ``train``, ``compare``, ``demo`` and ``bench``.

mrtpo train --task constraints --algo mrtpo --steps 30 --out runs/train
mrtpo compare --algos grpo,gdpo,mrtpo --seeds 3
mrtpo demo            # a small table of JS relevance and token advantages
mrtpo bench ...       # the benchmark suite (arguments go to it unchanged)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from .model import TinyConfig
from .trainer import ALGOS, TASKS, TrainConfig

DEFAULTS = TrainConfig()


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _float(lo: float | None = None, hi: float | None = None, *, open_lo: bool = False):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if (
            v != v
            or (lo is not None and (v < lo or (open_lo and v == lo)))
            or (hi is not None and v > hi)
        ):
            lo_s = "(" if open_lo else "["
            raise argparse.ArgumentTypeError(
                f"expected a number in {lo_s}{lo if lo is not None else '-inf'}, "
                f"{hi if hi is not None else 'inf'}], got {text}"
            )
        return v

    return parse


def _algos(text: str) -> list[str]:
    names = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in names if a not in ALGOS]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(ALGOS)}, got {text!r}"
        )
    return names


def add_train_flags(p: argparse.ArgumentParser, *, with_task: bool = True):
    """The flags shared by ``train`` and ``compare`` (compare fixes task, algo and seed)."""
    d = DEFAULTS
    if with_task:
        p.add_argument(
            "--task", choices=TASKS, default=d.task, help="built-in task (default: %(default)s)"
        )
        p.add_argument(
            "--algo",
            choices=ALGOS,
            default=d.algo,
            help="advantage estimator: grpo (summed reward), gdpo (per-reward "
            "normalization), mrtpo (GDPO reallocated to tokens by contrastive "
            "replay) (default: %(default)s)",
        )
        p.add_argument(
            "--seed",
            type=_non_negative_int,
            default=d.seed,
            help="seed of sampling and data order and, unless --init-seed is given, of the task's "
            "examples and the built-in model (default: %(default)s)",
        )
        p.add_argument(
            "--init-seed",
            type=_non_negative_int,
            default=None,
            help="seed of the task's examples and of the built-in model's init and warm "
            "start (default: --seed)",
        )
        p.add_argument(
            "--steps",
            type=_positive_int,
            default=d.steps,
            help="training steps (default: %(default)s)",
        )
        p.add_argument(
            "--out",
            default=d.out,
            help="output folder for metrics.jsonl, curves.png, tokens.html and the "
            "checkpoint (default: %(default)s)",
        )
        p.add_argument(
            "--resume",
            action="store_true",
            help="continue from the checkpoint in --out (same metrics as an uninterrupted run)",
        )
    p.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="a local Hugging Face causal LM folder (default: the built-in tiny "
        "model, warm-started and cached under --cache-dir)",
    )
    g = p.add_argument_group("rollouts")
    g.add_argument(
        "--prompts-per-step",
        type=_positive_int,
        default=d.prompts_per_step,
        help="prompts per step, B (default: %(default)s)",
    )
    g.add_argument(
        "--group-size",
        type=_positive_int,
        default=d.group_size,
        help="sampled responses per prompt, G >= 2 (default: %(default)s)",
    )
    g.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=d.max_new_tokens,
        help="response length cap in tokens (default: %(default)s)",
    )
    g.add_argument(
        "--temperature",
        type=_float(0.0, open_lo=True),
        default=d.temperature,
        help="sampling temperature, also used for log-probs and relevance (default: %(default)s)",
    )
    g.add_argument(
        "--top-k",
        type=_non_negative_int,
        default=d.top_k,
        help="top-k sampling, 0 = off (default: %(default)s)",
    )
    g.add_argument(
        "--top-p",
        type=_float(0.0, 1.0, open_lo=True),
        default=d.top_p,
        help="nucleus sampling, 1.0 = off (default: %(default)s)",
    )
    g = p.add_argument_group("optimization")
    g.add_argument(
        "--lr",
        type=_float(0.0, open_lo=True),
        default=d.lr,
        help="AdamW learning rate (default: %(default)s)",
    )
    g.add_argument(
        "--weight-decay",
        type=_float(0.0),
        default=d.weight_decay,
        help="AdamW weight decay (default: %(default)s)",
    )
    g.add_argument(
        "--ppo-epochs",
        type=_positive_int,
        default=d.ppo_epochs,
        help="passes over each step's responses (default: %(default)s)",
    )
    g.add_argument(
        "--minibatches",
        type=_positive_int,
        default=d.minibatches,
        help="optimizer steps per PPO epoch (default: %(default)s)",
    )
    g.add_argument(
        "--micro-batch",
        type=_positive_int,
        default=d.micro_batch,
        help="responses per forward; gradients accumulate over a minibatch (default: %(default)s)",
    )
    g.add_argument(
        "--clip-low",
        type=_float(0.0),
        default=d.clip_low,
        help="ratio clipped below at 1 - clip_low (default: %(default)s)",
    )
    g.add_argument(
        "--clip-high",
        type=_float(0.0),
        default=d.clip_high,
        help="ratio clipped above at 1 + clip_high (default: %(default)s)",
    )
    g.add_argument(
        "--max-grad-norm",
        type=_float(0.0),
        default=d.max_grad_norm,
        help="gradient-norm clip, 0 = off (default: %(default)s)",
    )
    g.add_argument(
        "--kl-beta",
        type=_float(0.0),
        default=d.kl_beta,
        help="weight of the k3 KL to the initial model, 0 = off (default: %(default)s)",
    )
    g = p.add_argument_group("MRTPO")
    g.add_argument(
        "--alpha",
        type=_float(0.0, 1.0),
        default=d.alpha,
        help="share of each reward's advantage reallocated by relevance; 0 gives "
        "GDPO (default: %(default)s)",
    )
    g.add_argument(
        "--gamma",
        type=_float(0.0, open_lo=True),
        default=d.gamma,
        help="sharpening exponent on the JS distance (default: %(default)s)",
    )
    g.add_argument(
        "--batch-norm",
        choices=("sequence", "token"),
        default=d.batch_norm,
        help="batch statistics over responses or over tokens (default: %(default)s)",
    )
    g.add_argument(
        "--no-baseline-replay",
        action="store_true",
        help="skip contrastive replay under grpo/gdpo (it only feeds the relevance metrics there)",
    )
    g = p.add_argument_group("run")
    g.add_argument(
        "--checkpoint-every",
        type=_positive_int,
        default=d.checkpoint_every,
        help="steps between checkpoints (default: %(default)s)",
    )
    g.add_argument(
        "--html-samples",
        type=_non_negative_int,
        default=d.html_samples,
        help="responses shown in tokens.html (default: %(default)s)",
    )
    g.add_argument("--device", default=d.device, help="cpu, cuda or auto (default: %(default)s)")
    g.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=d.dtype,
        help="model dtype (default: %(default)s)",
    )
    g.add_argument(
        "--cache-dir",
        default=d.cache_dir,
        help="where the warm-started built-in model is cached (default: %(default)s)",
    )
    g.add_argument(
        "--warm-steps",
        type=_non_negative_int,
        default=TinyConfig().warm_steps,
        help="supervised warm-start steps of the built-in model (default: %(default)s)",
    )
    g.add_argument(
        "--threads",
        type=_non_negative_int,
        default=0,
        help="torch CPU threads, 0 = torch's default (default: %(default)s)",
    )
    g.add_argument("--quiet", action="store_true", help="no progress bar or per-step lines")


def config_from_args(args, **override) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    d = {k: v for k, v in vars(args).items() if k in names}
    d["replay_for_baselines"] = not args.no_baseline_replay
    d["tiny"] = TinyConfig(warm_steps=args.warm_steps)
    d.update(override)
    return TrainConfig(**d)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mrtpo",
        description="MRTPO: multi-reward token-level policy optimization with fused kernels.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser(
        "train",
        help="train on a built-in task",
        description="Train a causal LM with GRPO, GDPO or MRTPO on a built-in task. Writes "
        "metrics.jsonl (per-step pass rates and relevance), curves.png, tokens.html and a "
        "checkpoint under --out.",
    )
    add_train_flags(p)
    p = sub.add_parser(
        "compare",
        help="compare algorithms over seeds on the constraints task",
        description="Train every algorithm with every seed on the built-in constraints task "
        "and report steps to a target all-constraints pass rate, final per-reward pass rates "
        "and credit precision; writes a markdown table and a plot.",
    )
    p.add_argument(
        "--algos",
        type=_algos,
        default=["grpo", "gdpo", "mrtpo"],
        help="comma-separated algorithms (default: grpo,gdpo,mrtpo)",
    )
    p.add_argument(
        "--seeds",
        type=_positive_int,
        default=3,
        help="number of seeds, 0..N-1 (default: %(default)s)",
    )
    from .compare import COMPARE_DEFAULTS as cd

    p.add_argument(
        "--steps",
        type=_positive_int,
        default=cd["steps"],
        help="training steps per run (default: %(default)s)",
    )
    p.add_argument(
        "--target",
        type=_float(0.0, 1.0, open_lo=True),
        default=cd["target"],
        help="target all-constraints pass rate (default: %(default)s)",
    )
    p.add_argument(
        "--window",
        type=_positive_int,
        default=cd["window"],
        help="steps in the moving average of the pass rate compared with the "
        "target (default: %(default)s)",
    )
    p.add_argument(
        "--out", default="runs/compare", help="folder for the runs (default: %(default)s)"
    )
    p.add_argument(
        "--results",
        default="docs/results",
        help="folder for compare_constraints.md and .png (default: %(default)s)",
    )
    p.add_argument(
        "--init-seed",
        type=_non_negative_int,
        default=cd["init_seed"],
        help="seed of the task's examples and of the built-in model's warm start, shared by "
        "all runs so that every algorithm and seed starts from the same model (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--jobs",
        type=_positive_int,
        default=1,
        help="seeds trained in parallel processes (results do not depend on it; default: "
        "%(default)s)",
    )
    add_train_flags(p, with_task=False)
    fixed = ("steps", "target", "window", "init_seed")
    p.set_defaults(**{k: v for k, v in cd.items() if k not in fixed})
    sub.add_parser(
        "demo", help="print a small table of JS relevance and token advantages", add_help=False
    )
    sub.add_parser(
        "bench", help="run the benchmark suite (arguments are passed to it)", add_help=False
    )
    return parser


def _forward(command: str, argv: list[str]) -> int:
    if command == "demo":
        try:
            from .demo import main as demo_main
        except ImportError as err:
            print(f"mrtpo demo: the demo module is not available ({err})", file=sys.stderr)
            return 2
        return demo_main(argv) or 0
    try:
        from bench.__main__ import main as bench_main
    except ImportError as err:
        print(
            f"mrtpo bench: the benchmark package is not available ({err}); run from the "
            "repository root, where bench/ lives",
            file=sys.stderr,
        )
        return 2
    return bench_main(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("demo", "bench"):
        return _forward(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "compare":
            from .compare import run_compare

            run_compare(args)
            return 0
    except ValueError as err:
        parser.exit(2, f"mrtpo {args.command}: error: {err}\n")
    return 0


def _train(args) -> int:
    from .trainer import train

    cfg = config_from_args(args)
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, flush=True))
    res = train(cfg, progress=not args.quiet, log=log)
    last = res.metrics[-1] if res.metrics else {}
    print(
        f"\ndone: {len(res.metrics)} steps, final all-constraints pass rate "
        f"{last.get('all_pass', float('nan')):.2f}"
    )
    print(f"outputs in {res.out}/:")
    for path in (res.metrics_path, res.curves_path, res.html_path, res.checkpoint):
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
