"""The step model's inputs, read from the committed records (bench/results/): the
method-step CSVs, the replay profile of the K = 4 batch and the K = 4 training runs side by
side, each turned into ``Case`` rows of measured parts and ratios."""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from .step_model_parts import Parts, transfer

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
METHOD_STEP_RECORDS = (
    "method-step-2026-12-04",
    "method-step-2026-12-05",
    "method-step-2026-12-05-smollm2-4k",
    "method-step-2026-12-05-smollm2-16k",
)
K4_RECORD = "k4-step-time-2026-12-05.md"
PROFILE_RECORD = "replay-profile-2026-12-05.md"
GPU_RECORD = "gpu-2026-12-04-h200"


@dataclass(frozen=True)
class Case:
    """One measured row: its parts (u and j its own where it replays) and measured ratio."""

    source: str
    label: str
    model: str
    tokens: int  # response length
    variant: str
    parts: Parts
    measured: float | None  # MRTPO / GDPO, measured (None: the row is GDPO's)
    group: str  # rows of one record, model and checkpointing setting (donors come from here)
    run: str = ""  # the invocation (its start time): the other variant must share it


def method_step_cases(name: str) -> list[Case]:
    """Cases of one method-step record: per (invocation, model, length), GDPO's stages give
    G = 0 (the rollout aside), U, A and F; each MRTPO variant's give its pairs kept, u, j,
    its token advantages and its measured step / GDPO's (process CPU time, the records'
    own read). A case measured again in the same record counts by its latest rows only
    (``bench.method_step_report`` reads them so; the earlier rows stay in the CSV)."""
    path = RESULTS / name / "method_step.csv"
    with open(path, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["status"] == "ok"]
    cases = {}
    for r in rows:
        key = (r["date"], r["model"], int(r["N"]))
        cases.setdefault(key, {}).setdefault(r["provider"], {})[r["stage"]] = r
    latest = {}  # a case measured again replaces its earlier rows, as the report reads them
    for date, model, n_tok in cases:
        latest[model, n_tok] = max(date, latest.get((model, n_tok), date))
    out = []
    for (date, model, n_tok), arms in sorted(cases.items()):
        g = arms.get("gdpo")
        if date != latest[model, n_tok]:
            continue
        if not g or "step" not in g:
            continue
        ms = {s: float(row["cpu_ms_p50"]) for s, row in g.items()}
        first = g["step"]
        ckpt = "gradient checkpointing" in first["note"]
        resp = int(first["responses"])
        k = int(first["K"])
        gdpo_parts = dict(
            responses=resp,
            K=k,
            generation=0.0,
            update=ms["policy_forward"] + ms["loss_forward"] + ms["backward"],
            info_forward=ms["info_forward"],
            advantages_gdpo=ms["advantages"],
        )
        label = f"{model}, {n_tok} tokens" + (", checkpointing" if ckpt else "")
        group = f"{name}/{model}/{'checkpointing' if ckpt else 'plain'}"
        for variant in ("mrtpo", "mrtpo-half"):
            m = arms.get(variant)
            if not m or "step" not in m:
                continue
            mm = {s: float(row["cpu_ms_p50"]) for s, row in m.items()}
            kept = int(m["step"]["pairs"])
            parts = Parts(
                kept=kept,
                unit_per_pair=mm["replay"] / kept,
                js_per_side=mm["js"] / (resp + kept),
                advantages_mrtpo=mm["advantages"],
                **gdpo_parts,
            )
            out.append(
                Case(
                    name, label, model, n_tok, variant, parts, mm["step"] / ms["step"], group, date
                )
            )
    return out


def profile_parts(name: str = PROFILE_RECORD) -> dict[str, Parts]:
    """The replay profile of issue 25's K = 4 batch (SmolLM2, bf16 autocast): per section
    with a kept-pairs mask (``Mask `rewards```, and ``Run 2`` after the JS's blocked
    upcast), the new path's parts: F = with-information forward + old log-probs, u = unit
    forwards / pairs, j = JS / (responses + pairs)."""
    text = (RESULTS / name).read_text()
    head = re.search(r"(\d+) responses of (\d+) tokens, K = (\d+)", text)
    resp, k = int(head.group(1)), int(head.group(3))
    out = {}
    for sec in re.split(r"\n(?=## )", text)[1:]:
        title = sec.splitlines()[0].lstrip("# ").strip()
        cells = {}
        for line in sec.splitlines():
            m = re.match(r"\| ([A-Za-z -]+?)(?: \([^)]*\))? \| ([\d.]+) \| ([\d.]+) \|", line)
            if m:
                cells[m.group(1)] = float(m.group(3))  # the new path (reuse=True)
        pairs = re.search(r"(\d+) \(response, reward\) pairs replayed", sec)
        if "Run 2" in title:  # the same batch, mask `rewards`: 20 pairs
            pairs = re.search(
                r"(\d+) \(response, reward\) pairs replayed", text.split("## Mask `rewards`")[1]
            )
        if not cells or not pairs:
            continue
        kept = int(pairs.group(1))
        out[title] = Parts(
            responses=resp,
            K=k,
            kept=kept,
            generation=0.0,
            update=0.0,
            info_forward=cells["with-information forward"] + cells["old log-probs"],
            unit_per_pair=cells["unit forwards"] / kept,
            js_per_side=cells["fused JS"] / (resp + kept),
            head_pass=cells["old log-probs"],
        )
    return out


def profile_prompt(name: str = PROFILE_RECORD) -> tuple[int, int]:
    """(prompt tokens, prompt tokens a replay unit runs past the shared prefix, median) of
    the K = 4 task's batch, from the replay profile."""
    text = (RESULTS / name).read_text()
    prompt = re.search(r"prompts of \[(\d+)(?:, \d+)*\] tokens", text)
    suffix = re.search(r"per \(response, reward\): median ([\d.]+)", text)
    return int(prompt.group(1)), round(float(suffix.group(1)))


# which replay profile measured the code each K = 4 run ran (runs 1-2: commit 8c90cb1,
# profiled just before them; runs 4 and 6: commit b888520, profile run 2; run 3's code, the
# bf16 JS head before the blocked upcast, has no profile; run 5 is GDPO beside GDPO)
K4_PROFILE = {
    1: "Mask `rewards`: 20 (response, reward) pairs replayed",
    2: "Mask `rewards`: 20 (response, reward) pairs replayed",
    4: "Run 2: after the JS head's blocked upcast (commit b888520), mask `rewards`, a "
    "quiet machine",
    6: "Run 2: after the JS head's blocked upcast (commit b888520), mask `rewards`, a "
    "quiet machine",
}

_K4_ROW = re.compile(
    r"^\| (\d+) \| ([\d.]+) \(([\d.]+) / ([\d.]+) / ([\d.]+)\) \| ([\d.]+) \(([\d.]+) / "
    r"([\d.]+) / ([\d.]+)\) \| (\d+) \| (\d+) \| ([\d.]+) \|$"
)


def k4_cases(name: str = K4_RECORD) -> list[Case]:
    """The K = 4 training runs side by side (SmolLM2, ``mrtpo train``): per run, from step
    2 on (as the record reads it), GDPO's summed rollout (G), replay phase (its old-log-prob
    forward, F) and update (U); MRTPO's summed pairs kept; u / f and j / f from the replay
    profile of that code (``K4_PROFILE``). Measured: MRTPO's summed step over GDPO's."""
    text = (RESULTS / name).read_text()
    profiles = profile_parts()
    tables = []  # one per run, in the record's order (the control's too: its rows say None)
    for line in text.splitlines():
        if line.startswith("| step | GDPO s"):
            tables.append([])
        m = _K4_ROW.match(line)
        if m and tables:
            tables[-1].append([float(x) for x in m.groups()])
    out = []
    for run, rows in enumerate(tables, 1):
        if run not in K4_PROFILE:
            continue
        prof = profiles[K4_PROFILE[run]]
        rows = [r for r in rows if r[0] >= 2]
        steps = len(rows)

        def total(i, rows=rows):  # ms, summed over the steps
            return sum(r[i] for r in rows) * 1e3

        kept = sum(r[9] for r in rows) / steps
        pairs = (rows[0][9] + rows[0][10]) / prof.responses
        if pairs != prof.K:
            raise ValueError(
                f"{name}: run {run} has {pairs:g} pairs per response, the profile K = {prof.K}"
            )
        parts = Parts(
            responses=prof.responses * steps,
            K=prof.K,
            kept=kept * steps,
            generation=total(2),
            update=total(4),
            info_forward=total(3),
            unit_per_pair=0.0,
            js_per_side=0.0,
            head_pass=0.0,
        )
        measured = total(5) / total(1)
        out.append(
            Case(
                name,
                f"K = 4 training, run {run} (steps 2-{int(rows[-1][0])})",
                "smollm2-135m-instruct",
                32,
                "mrtpo",
                transfer(parts, prof),
                measured,
                f"{name}/run{run}",
            )
        )
    return out
