"""The ``mrtpo`` command line: ``train``, ``compare`` and ``demo``.

mrtpo train --task constraints --algo mrtpo --steps 30 --out runs/train
mrtpo compare --task constraints-full --algos grpo,gdpo,mrtpo --seeds 3
mrtpo demo            # a small table of JS relevance and token advantages

The flags of ``train`` and ``compare`` are built from the fields of `TrainConfig` and
`CompareConfig` (mrtpo/training/config.py) by mrtpo/training/cli_args.py; a built-in
``--model`` fills the flags a command line leaves out with the settings its recorded runs
used. Every bad argument ends the command with one line that names it and exit status 2,
before any model is built.
(The benchmark suite runs from a checkout with ``python -m bench``.)
"""

from __future__ import annotations

import argparse
import sys

from .model.builtin import check_available, is_builtin
from .training.cli_args import add_flags, flag_for_error, given_flags
from .training.cli_args import from_namespace as config_from_namespace
from .training.config import COMPARE_FIXED, CompareConfig, TrainConfig


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line (naming the flag) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mrtpo",
        description="MRTPO: multi-reward token-level policy optimization with fused kernels.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    p = sub.add_parser(
        "train",
        help="train on a built-in task",
        description="Train a causal LM with GRPO, GDPO or MRTPO on a built-in task. Writes "
        "metrics.jsonl (per-step pass rates and relevance), curves.png, tokens.html and a "
        "checkpoint under --out.",
    )
    add_flags(p, TrainConfig())
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar or per-step lines (what --resume found is still printed)",
    )
    p = sub.add_parser(
        "compare",
        help="compare algorithms over seeds on a built-in task",
        description="Train every algorithm with every seed on a built-in task and report "
        "steps to a target all-pass rate, final per-reward pass rates and credit precision; "
        "writes a markdown table and a plot.",
    )
    default = CompareConfig()
    groups: dict = {}
    add_flags(p, default, skip=("train",), groups=groups)
    add_flags(p, default.train, skip=COMPARE_FIXED, prefix="train.", groups=groups)
    sub.add_parser(
        "demo", help="print a small table of JS relevance and token advantages", add_help=False
    )
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig | CompareConfig:
    """The typed config of a parsed ``train`` or ``compare`` command line."""
    if args.command == "compare":
        cfg = config_from_namespace(CompareConfig(), args)
        return cfg.with_model_defaults(given_flags(args, prefix="train."))
    return config_from_namespace(TrainConfig(), args).with_model_defaults(given_flags(args))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:]) or 0
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    try:
        cfg.validate()
        _check_builtin_installed(cfg.train.model if isinstance(cfg, CompareConfig) else cfg.model)
    except ValueError as err:
        _refuse(parser, args.command, err, cfg)
    threads = cfg.train.threads if isinstance(cfg, CompareConfig) else cfg.threads
    if threads:
        import torch

        torch.set_num_threads(threads)
    if args.command == "train":
        note = oversubscription_note(threads)
        if note:
            print(note, file=sys.stderr, flush=True)
    from .training.trainer import NonFiniteWeightsError

    try:
        if args.command == "train":
            return _train(cfg, quiet=args.quiet)
        from .training.compare import run_compare

        run_compare(cfg)
    except ValueError as err:
        _refuse(parser, args.command, err, cfg)
    except NonFiniteWeightsError as err:  # the run failed, not its arguments: status 1
        parser.exit(1, f"mrtpo {args.command}: error: {' '.join(str(err).split())}\n")
    return 0


def oversubscription_note(threads: int, *, cpus: int | None = None, load=None) -> str | None:
    """A note when this run's CPU threads (``threads``; 0: torch's default) outnumber the
    cores other processes leave free (the 1-minute load average), else None: OpenMP threads
    that outnumber free cores wait on each other, and a step runs several times slower."""
    import os

    import torch

    from .training.config import usable_cpus

    used = threads or torch.get_num_threads()
    cpus = usable_cpus() if cpus is None else cpus
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average on this system
            return None
    free = max(cpus - load, 1.0)
    if used <= 1 or used <= free + 0.5:
        return None
    return (
        f"note: {used} CPU threads on {cpus} CPUs with a load average of {load:.1f} (other "
        f"processes hold about {min(load, cpus):.0f}): threads that outnumber free cores wait "
        "on each other and a step runs several times slower (27-94 s against 7-8 s beside "
        "one other run); --threads 1 avoids it. The step line prints each step's seconds."
    )


def _check_builtin_installed(model) -> None:
    """A ``--model`` that names a built-in model must be installed here (its extra), asked
    before any model is built; a path was checked by the settings."""
    if is_builtin(model):
        problem = check_available(model)
        if problem:
            raise ValueError(f"model: {problem}")


def _refuse(parser, command: str, err: ValueError, cfg) -> None:
    """Exit 2 with the error on one line, naming the flag of the field it starts with."""
    message = " ".join(flag_for_error(str(err), cfg).split())
    parser.exit(2, f"mrtpo {command}: error: {message}\n")


def _train(cfg: TrainConfig, *, quiet: bool) -> int:
    from .training.trainer import train

    def log(msg: str) -> None:
        if not quiet or msg.startswith("resume"):  # what --resume found is always said
            print(msg, flush=True)

    res = train(cfg, progress=not quiet, log=log)
    last = res.metrics[-1] if res.metrics else {}
    print(
        f"\ndone: {len(res.metrics)} steps, final all-pass rate "
        f"{last.get('all_pass', float('nan')):.2f}"
    )
    print(f"outputs in {res.out}/:")
    for path in (res.metrics_path, res.curves_path, res.html_path, res.checkpoint):
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
