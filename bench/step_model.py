"""A small model of one training step, MRTPO's over GDPO's, from its measured parts.

    python -m bench.step_model check        predicted beside measured, every record row
    python -m bench.step_model gpu-table    the ratio on a GPU by generation share, pairs
                                            kept, K and response length
    python -m bench.step_model record --out bench/results/step-model-DATE.md

One step of either arm is generation, the update and what comes between them. With n
responses, K rewards and ``kept`` of the n K (response, reward) pairs replayed:

    GDPO   = G + U + A_gdpo  + (F  if the old log-probs need their own forward, else H)
    MRTPO  = G + U + A_mrtpo + (F  if the with-information side needs its own forward,
                                    else 0; H where the old log-probs are the update's own)
                 + kept x u                         the replay's unit forwards
                 + (n + kept) x j                   the JS: one P side per response,
                                                    one Q side per kept pair

- G: generation (the rollout), U: the policy's forward with gradient, the fused policy
  loss and the backward (the same code in both arms), A: the advantage op (GDPO's
  per-response one, MRTPO's token advantages);
- F: the with-information no-grad forward of the n responses and their old log-probs;
- H: the update's extra head pass for the old log-probs where they are its own, detached;
- u: one replay unit's forward per kept pair (the prompt without the reward's spans, past
  the prefix it shares with the full prompt, then the teacher-forced response);
- j: the fused JS per side and response (a head GEMM over the response's tokens, V x d
  per token, and its row work).

Which of F runs (``mrtpo.training.trainer.separate_old_forward`` and
``Trainer.replay_from_update``):
``separate`` (several PPO epochs or minibatches, and every record below, which predate
issue 43 item 1): both arms run F. ``own-forward`` (one epoch, one minibatch, the batch
more than one update micro-batch: ``replay_from_update="auto"``): GDPO runs none, MRTPO
runs F for the with-information hidden states (its log-prob op no longer runs: F less the
head pass). ``from-update`` (one epoch, one minibatch, one micro-batch): neither arm runs F.

The model carries only two numbers from one measurement to another, both relative to f =
F / n (the with-information forward per response, measured in the same place): u / f and
j / f. ``check`` predicts each record row's ratio from the row's own GDPO step (G, U, A,
F), its pairs kept and those two numbers taken from a *different* measurement (the other
variant of the same case, else the same model at the nearest other length, else for the
K = 4 training runs the replay profile of the same batch), so a prediction that is right
says that the replay scales with the pairs kept and the JS with its sides as the model
says. ``gpu_ratio`` builds every part from FLOP counts and GPU rates instead (the measured
H200 rates of the fused ops; the decoder's rate assumed: no GPU step is measured in this
project yet).

Public API only: this reads committed records (bench/results/) and imports nothing of
mrtpo_kernels or mrtpo.

The modules, by concern: ``bench.step_model_parts`` (the arithmetic above: ``Parts``,
``step_times``, ``transfer``), ``bench.step_model_records`` (reading the records into
``Case`` rows), ``bench.step_model_check`` (the CPU check: ``check_rows``, its table and
summary), ``bench.step_model_gpu`` (the GPU parts from FLOP counts, ``gpu_ratio`` and its
tables) and ``bench.step_model_report`` (the record). Every name they define for use
elsewhere is importable from here too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .step_model_check import MIN_TOKENS, TOLERANCE, check_rows, check_table, summary
from .step_model_gpu import (
    GEN_SHARES,
    KEEPS,
    LENGTHS,
    GpuRates,
    Shape,
    gpu_parts,
    gpu_ratio,
    gpu_tables,
    h200_rates,
    needed_share,
    sensitivity,
    smollm2_shape,
    target_shape,
)
from .step_model_parts import MODES, Parts, step_times, transfer
from .step_model_records import (
    GPU_RECORD,
    K4_PROFILE,
    K4_RECORD,
    METHOD_STEP_RECORDS,
    PROFILE_RECORD,
    RESULTS,
    ROOT,
    Case,
    k4_cases,
    method_step_cases,
    profile_parts,
    profile_prompt,
)
from .step_model_report import render_record

__all__ = [
    "GEN_SHARES",
    "GPU_RECORD",
    "K4_PROFILE",
    "K4_RECORD",
    "KEEPS",
    "LENGTHS",
    "METHOD_STEP_RECORDS",
    "MIN_TOKENS",
    "MODES",
    "PROFILE_RECORD",
    "RESULTS",
    "ROOT",
    "TOLERANCE",
    "Case",
    "GpuRates",
    "Parts",
    "Shape",
    "check_rows",
    "check_table",
    "gpu_parts",
    "gpu_ratio",
    "gpu_tables",
    "h200_rates",
    "k4_cases",
    "main",
    "method_step_cases",
    "needed_share",
    "profile_parts",
    "profile_prompt",
    "render_record",
    "sensitivity",
    "smollm2_shape",
    "step_times",
    "summary",
    "target_shape",
    "transfer",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.step_model", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("what", choices=("check", "gpu-table", "record"))
    ap.add_argument(
        "--decoder-share",
        type=float,
        default=0.5,
        help="the decoder's rate on the GPU, a share of the GEMM ceiling (assumed)",
    )
    ap.add_argument("--out", help="record: the Markdown file to write")
    ap.add_argument(
        "--strict",
        action="store_true",
        help="check: exit 1 when a row held to the tolerance misses it",
    )
    args = ap.parse_args(argv)
    if args.what == "record" and not args.out:
        ap.error("--out: expected a Markdown file for the record")
    try:
        rates = h200_rates(args.decoder_share)
    except ValueError as err:
        ap.error(f"--decoder-share: {err}")
    if args.what == "check":
        rows = check_rows()
        print(check_table(rows))
        print("\n" + summary(rows))
        bad = any(r["held"] and abs(r["error"]) > TOLERANCE for r in rows)
        return 1 if bad and args.strict else 0
    if args.what == "gpu-table":
        print(gpu_tables(rates))
        return 0
    Path(args.out).write_text(render_record(rates))
    print(f"[step_model] wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
