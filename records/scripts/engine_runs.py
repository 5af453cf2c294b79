"""README quick start 2 under each engine, two CPU processes (issue 39, item 7).

SmolLM2-135M-Instruct, the quick start's two verifiers (``uses_word``, ``ends_with``, each
returning its score and the prompt span it checked) and its settings (20 steps, a global batch
of 8 completions: 4 per process, 4 generations per prompt, 32 completion tokens, lr 2e-5,
fp32), trained by ``MRTPOGRPOTrainer`` once per engine: DDP (the reference), FSDP2 (Accelerate's
``fully_shard`` from ``examples/accelerate/fsdp2.yaml``) and DeepSpeed ZeRO-3 (the Trainer's
``deepspeed`` config, stage 3 with its defaults). Each engine runs in a fresh pair of processes
on a gloo group; the script writes, per engine, the seconds of each step (rank 0's clock,
between the Trainer's step callbacks), each step's all-pass rate (the share of the step's
completions, both processes', that pass both verifiers), the replay's logged figures and a
checksum of the final weights per rank.

On a GPU machine ``accelerate launch --config_file examples/accelerate/<engine>.yaml`` selects
the engine. Accelerate 1.15 selects neither FSDP nor DeepSpeed on a CPU, so this script routes
the CPU processes into Accelerate's own FSDP and DeepSpeed code with the TEST-ONLY shims of
``tests/test_integrations_trl_sharded.py`` (imported from there, used as the tests use them).

    python records/scripts/engine_runs.py --out runs/engines            # ddp fsdp2 zero3
    python records/scripts/engine_runs.py --out runs/engines --engines fsdp2 --steps 3
    python records/scripts/engine_runs.py --table runs/engines          # the record's table

Each engine's results go to OUT/ENGINE.json (an engine whose file is there is not run again).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("ddp", "fsdp2", "zero3")
WORLD = 2
WORDS, ENDS = ["river", "lamp", "cloud", "stone"], ["today", "again"]
ZERO3 = {  # as a user passes it to the Trainer (--deepspeed ds_config.json): stage 3, defaults
    "zero_optimization": {"stage": 3},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}


def quoted(prompt, n):  # the span of the n-th quoted word of the last message (quick start 2)
    text = prompt[-1]["content"]
    start = [i for i, c in enumerate(text) if c == '"'][2 * n] + 1
    return len(prompt) - 1, start, text.index('"', start)


def uses_word(prompts, completions, **kwargs):
    out = []
    for p, c in zip(prompts, completions):
        m, s, e = quoted(p, 0)
        out.append((float(p[m]["content"][s:e] in c[0]["content"]), [(m, s, e)]))
    return out


def ends_with(prompts, completions, **kwargs):
    out = []
    for p, c in zip(prompts, completions):
        m, s, e = quoted(p, 1)
        ok = c[0]["content"].rstrip(" .!").endswith(p[m]["content"][s:e])
        out.append((float(ok), [(m, s, e)]))
    return out


def _rank_main(rank: int, port: int, out: str, engine: str, steps: int) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    os.chdir(ROOT)
    from test_integrations_trl_distributed import _join_group

    _join_group(rank, port)
    os.environ["DS_ACCELERATOR"] = "cpu"  # before DeepSpeed is imported
    import torch
    from datasets import Dataset
    from test_integrations_trl_sharded import (
        _cpu_deepspeed_state,
        _cpu_fsdp_shim,
        _deepspeed_on_gloo,
        engine_env,
    )
    from transformers import TrainerCallback

    from mrtpo.integrations.engine import engine_sharding
    from mrtpo.integrations.trl_trainer import MRTPOConfig, MRTPOGRPOTrainer
    from mrtpo.model.loading import load_model

    if engine == "zero3":  # DeepSpeed's CPU accelerator, not Accelerate's CPU switch
        del os.environ["ACCELERATE_USE_CPU"]
        _deepspeed_on_gloo()
        _cpu_deepspeed_state()
    else:
        _cpu_fsdp_shim()
        os.environ.update(engine_env(engine))
    passed: list[list[float]] = []  # per reward call (one per step): this rank's completions

    def record(fn, k):
        def wrapped(prompts, completions, **kwargs):
            scores = fn(prompts, completions, **kwargs)
            if k == 0:
                passed.append([s[0] for s in scores])
            else:
                last = passed[-1]
                passed[-1] = [float(a == 1.0 and s[0] == 1.0) for a, s in zip(last, scores)]
            return scores

        wrapped.__name__ = fn.__name__
        return wrapped

    class Clock(TrainerCallback):
        def __init__(self):
            self.seconds, self.t0 = [], None

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.seconds.append(time.perf_counter() - self.t0)

    rows = [
        {
            "prompt": [
                {
                    "role": "user",
                    "content": f'Write one sentence that uses the word "{w}" '
                    f'and ends with the word "{e}".',
                }
            ]
        }  # noqa: E131
        for w in WORDS
        for e in ENDS
    ]
    torch.manual_seed(0)
    model, tokenizer = load_model("smollm2-135m-instruct")
    zero3 = engine == "zero3"
    args = MRTPOConfig(
        output_dir=os.path.join(out, engine),
        learning_rate=2e-5,
        max_steps=steps,
        per_device_train_batch_size=8 // WORLD,
        num_generations=4,
        max_completion_length=32,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        bf16=False,
        use_cpu=not zero3,
        deepspeed=dict(ZERO3) if zero3 else None,
        accelerator_config={"use_configured_state": True} if zero3 else None,
    )
    clock = Clock()
    trainer = MRTPOGRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=args,
        reward_funcs=[record(uses_word, 0), record(ends_with, 1)],
        train_dataset=Dataset.from_list(rows),
        callbacks=[clock],
    )
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    checksum = _weights_checksum(trainer.model)
    logs = [
        {k: v for k, v in h.items() if k.startswith(("mrtpo/", "reward", "loss", "step"))}
        for h in trainer.state.log_history
        if "loss" in h
    ]
    with open(os.path.join(out, f"{engine}.rank{rank}.json"), "w") as f:
        json.dump(
            dict(
                engine=engine,
                distributed_type=trainer.accelerator.distributed_type.value,
                sharding=engine_sharding(trainer.model),
                seconds=clock.seconds,
                total_seconds=total,
                passed=passed,
                logs=logs,
                checksum=checksum,
            ),
            f,
        )
    trainer.end_training()


def _weights_checksum(model) -> float:
    """The sum of |w| over the full weights (``full_weights`` of the sharded tests: a
    collective on a sharded engine)."""
    from test_integrations_trl_sharded import full_weights

    return float(sum(w.double().abs().sum() for w in full_weights(model).values()))


def run_engine(out: Path, engine: str, steps: int, deadline_s: float) -> dict:
    import torch.multiprocessing as mp

    sys.path.insert(0, str(ROOT / "tests"))
    from test_integrations_trl_distributed import _free_port

    ctx = mp.start_processes(
        _rank_main,
        args=(_free_port(), str(out), engine, steps),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                raise SystemExit(f"{engine}: no result after {deadline_s:.0f} s (a hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    ranks = [json.loads((out / f"{engine}.rank{r}.json").read_text()) for r in range(WORLD)]
    steps_all = [a + b for a, b in zip(ranks[0]["passed"], ranks[1]["passed"])]
    result = dict(
        engine=engine,
        distributed_type=ranks[0]["distributed_type"],
        sharding=ranks[0]["sharding"],
        step_seconds=ranks[0]["seconds"],
        total_seconds=ranks[0]["total_seconds"],
        all_pass=[sum(s) / len(s) for s in steps_all],
        completions_per_step=[len(s) for s in steps_all],
        checksums=[r["checksum"] for r in ranks],
        logs=ranks[0]["logs"],
        load_before=os.getloadavg(),
    )
    (out / f"{engine}.json").write_text(json.dumps(result, indent=1))
    return result


def table(out: Path) -> str:
    import statistics

    recs = {}
    for e in ENGINES:
        if (out / f"{e}.json").exists():
            recs[e] = json.loads((out / f"{e}.json").read_text())
    if "ddp" not in recs:
        raise SystemExit(f"--table: {out}/ddp.json is missing (DDP is the reference)")
    base = statistics.median(recs["ddp"]["step_seconds"][1:])
    lines = [
        "| engine | Accelerate type | sharding | median step (s, steps 2-N) | vs DDP | all-pass, "
        "steps 1-5 / last 5 | weights equal on both ranks |",
        "|---|---|---|---|---|---|---|",
    ]
    for e, r in recs.items():
        med = statistics.median(r["step_seconds"][1:])
        ap = r["all_pass"]
        c0, c1 = r["checksums"]
        lines.append(
            f"| {e} | {r['distributed_type']} | {r['sharding'] or 'none'} | {med:.2f} | "
            f"{med / base:.2f}x | {sum(ap[:5]) / 5:.3f} / {sum(ap[-5:]) / 5:.3f} | "
            f"{'yes' if c0 == c1 else f'no ({c0:.6g} vs {c1:.6g})'} |"
        )
    lines.append("")
    lines.append("All-pass per step:")
    lines.append("")
    n = max(len(r["all_pass"]) for r in recs.values())
    lines.append("| step | " + " | ".join(recs) + " |")
    lines.append("|---|" + "---|" * len(recs))
    for i in range(n):
        vals = [f"{r['all_pass'][i]:.3f}" if i < len(r["all_pass"]) else "" for r in recs.values()]
        lines.append(f"| {i + 1} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="the folder of the engines' results (created)")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--deadline", type=float, default=7200.0, help="seconds per engine")
    ap.add_argument("--table", metavar="OUT", help="print the record's tables from OUT and stop")
    args = ap.parse_args(argv)
    if args.table:
        print(table(Path(args.table)))
        return
    if not args.out:
        ap.error("--out: required unless --table")
    if args.steps < 1:
        ap.error(f"--steps: expected an int >= 1, got {args.steps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for engine in args.engines:
        if (out / f"{engine}.json").exists():
            print(f"{engine}: done already ({out / f'{engine}.json'})")
            continue
        r = run_engine(out, engine, args.steps, args.deadline)
        n, secs = len(r["step_seconds"]), r["total_seconds"]
        print(
            f"{engine}: {r['distributed_type']}, {n} steps, {secs:.0f} s, all-pass {r['all_pass']}"
        )


if __name__ == "__main__":
    main()
