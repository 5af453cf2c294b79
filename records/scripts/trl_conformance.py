"""Run TRL's own GRPO trainer tests offline, with GRPOTrainer or with MRTPOGRPOTrainer in its
place (issue 40), and compare the two runs.

TRL's test file is not part of this repository: give the path of ``tests/test_grpo_trainer.py``
of a TRL checkout (``testing_utils.py`` and ``conftest.py`` of the same folder are used beside
it). Nothing is downloaded: the Hub models the tests name are rebuilt as tiny random models of
the same architecture with a local tokenizer (``--tokenizer``, a Hugging Face tokenizer folder,
e.g. the converted SmolLM2 of ``mrtpo.model.pretrained``), and
``load_dataset("trl-internal-testing/zen", ...)`` returns small local datasets of the same
configurations (plain and conversational prompts, train and test splits).

    # once per trainer (in chunks with -k if the machine is slow; each chunk writes its XML)
    python records/scripts/trl_conformance.py run PATH/test_grpo_trainer.py \\
        --trainer trl --work WORK --tokenizer TOKENIZER_FOLDER [-k EXPR] [--chunk NAME] \\
        [PYTEST ARGS]
    python records/scripts/trl_conformance.py run PATH/test_grpo_trainer.py \\
        --trainer mrtpo --work WORK --tokenizer TOKENIZER_FOLDER [-k EXPR] [--chunk NAME]
    # the table: counts per trainer and every test that passes with TRL's and not with ours
    python records/scripts/trl_conformance.py summary --work WORK

``--trainer mrtpo`` binds ``trl.GRPOTrainer`` / ``trl.GRPOConfig`` to ``MRTPOGRPOTrainer`` /
``MRTPOConfig`` before TRL's test module imports them, so every test builds ours. Tests that
need what this runner cannot stand in for are deselected, each with its reason
(``EXCLUDED``); tests that TRL marks to skip without an extra (vLLM, PEFT, liger, jmespath, a
GPU) skip by TRL's own markers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Names (classes or tests, as pytest's -k matches them) that are deselected, with the reason.
EXCLUDED = {
    "TestGRPOTrainerVLM": "vision-language models: need each model's image processor and the "
    "zen-image datasets, which have no offline stand-in here",
    "test_trust_remote_code": "loads modelling code from the Hub (trust_remote_code)",
}

# The Zen of Python's aphorisms as prompts (TRL's zen dataset is built from them): plain
# prompts are an aphorism's opening words; conversational prompts ask for its ending.
_ZEN = [
    ("Beautiful is better than", "ugly."),
    ("Explicit is better than", "implicit."),
    ("Simple is better than", "complex."),
    ("Complex is better than", "complicated."),
    ("Flat is better than", "nested."),
    ("Sparse is better than", "dense."),
    ("Readability", "counts."),
    ("Special cases aren't special enough to", "break the rules."),
    ("Although practicality beats", "purity."),
    ("Errors should never pass", "silently."),
    ("In the face of ambiguity, refuse the temptation to", "guess."),
    ("There should be one-- and preferably only one --obvious way to", "do it."),
    ("Now is better than", "never."),
    ("If the implementation is hard to explain, it's a", "bad idea."),
    ("If the implementation is easy to explain, it may be a", "good idea."),
    ("Namespaces are one honking great idea -- let's do", "more of those!"),
    ("Unless explicitly", "silenced."),
    ("Although never is often better than", "*right* now."),
    ("Although that way may not be obvious at first unless you're", "Dutch."),
]

# The tiny random stand-ins: (folder under trl-internal-testing, config class, model class,
# config overrides). Sizes are the smallest each family accepts; MoE and logit-transform
# families keep their defining settings (router aux loss, logit_scale, final softcap).
_DENSE = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=32, max_position_embeddings=512)  # fmt: skip
MODELS = [
    ("tiny-Qwen2ForCausalLM-2.5", "Qwen2Config", "Qwen2ForCausalLM", {}),
    (
        "tiny-Qwen2ForSequenceClassification-2.5",
        "Qwen2Config",
        "Qwen2ForSequenceClassification",
        dict(num_labels=1),
    ),
    ("tiny-Qwen3ForCausalLM", "Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=4)),
    (
        "tiny-Qwen3ForSequenceClassification",
        "Qwen3Config",
        "Qwen3ForSequenceClassification",
        dict(head_dim=4, num_labels=1),
    ),
    ("tiny-LlamaForCausalLM-3.2", "LlamaConfig", "LlamaForCausalLM", {}),
    (
        "tiny-LlamaForSequenceClassification-3.2",
        "LlamaConfig",
        "LlamaForSequenceClassification",
        dict(num_labels=1),
    ),
    ("tiny-MistralForCausalLM-0.2", "MistralConfig", "MistralForCausalLM", {}),
    (
        "tiny-Cohere2ForCausalLM",
        "Cohere2Config",
        "Cohere2ForCausalLM",
        dict(
            logit_scale=0.25, layer_types=["sliding_attention", "full_attention"], sliding_window=8
        ),
    ),
    (
        "tiny-Gemma2ForCausalLM",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=4,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
        ),
    ),
    (
        "tiny-Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    ),
    (
        "tiny-GptOssForCausalLM",
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    (
        "tiny-Glm4MoeForCausalLM",
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            head_dim=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
        ),
    ),
    (
        "tiny-NemotronHForCausalLM-nano",
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            head_dim=4,
            num_hidden_layers=4,
            layers_block_type=["mamba", "moe", "attention", "mlp"],
            mamba_num_heads=4,
            mamba_head_dim=8,
            ssm_state_size=8,
            n_groups=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16,
            n_group=1,
            topk_group=1,
            expand=2,
        ),
    ),
]


def build_models(folder: Path, tokenizer: Path) -> None:
    """The stand-in Hub models under ``folder/trl-internal-testing`` (each with the tokenizer),
    kept between runs: a folder that already has its config is reused."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    for name, config_cls, model_cls, overrides in MODELS:
        out = folder / "trl-internal-testing" / name
        if (out / "config.json").exists():
            continue
        kw = dict(_DENSE, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                  tie_word_embeddings=False)  # fmt: skip
        kw.update(overrides)
        config = getattr(transformers, config_cls)(**kw)
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config)
        model.save_pretrained(out)
        tok.save_pretrained(out)
        print(f"built {name} ({sum(p.numel() for p in model.parameters())} parameters)")


# The conftest at the work folder's root: datasets, the trainer swap. It runs before TRL's
# tests/conftest.py and before the test module imports ``from trl import GRPOTrainer``.
_CONFTEST = """
import os

import datasets
import trl

_ZEN = json.loads(ZEN_JSON)


def _zen(config_name):
    if config_name == "standard_prompt_only":
        rows = {"prompt": [p for p, _ in _ZEN]}
    elif config_name == "conversational_prompt_only":
        rows = {"prompt": [[{"role": "user", "content": f"What comes after '{p}'?"}]
                           for p, _ in _ZEN]}
    else:
        raise ValueError(f"no offline stand-in for zen configuration {config_name!r}")
    full = datasets.Dataset.from_dict(rows)
    n = int(os.environ.get("MRTPO_CONFORMANCE_TRAIN_ROWS", "17"))  # TRL's zen has 17
    return datasets.DatasetDict(train=full.select(range(n)), test=full.select(range(17, 19)))


def load_dataset(path, name=None, split=None, streaming=False, **kwargs):
    if path != "trl-internal-testing/zen":
        raise ValueError(f"no offline stand-in for dataset {path!r}")
    dd = _zen(name)
    if streaming:
        dd = datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in dd.items()})
    return dd if split is None else dd[split]


datasets.load_dataset = load_dataset

# A test file of another TRL release than the installed one may import helpers the installed
# trl.import_utils lacks: give the missing availability checks (that is all they are).
import importlib.util

import trl.import_utils as _trl_import_utils

for _name, _module in (("is_joblib_available", "joblib"),):
    if not hasattr(_trl_import_utils, _name):
        setattr(_trl_import_utils, _name,
                lambda _m=_module: importlib.util.find_spec(_m) is not None)

if os.environ["MRTPO_CONFORMANCE_TRAINER"] == "mrtpo":
    from mrtpo.integrations.trl_trainer import MRTPOConfig, MRTPOGRPOTrainer

    trl.GRPOTrainer = MRTPOGRPOTrainer
    trl.GRPOConfig = MRTPOConfig
"""


def prepare(test_file: Path, work: Path, tokenizer: Path) -> None:
    test_file = test_file.resolve()
    src = test_file.parent
    for needed in ("testing_utils.py", "conftest.py"):
        if not (src / needed).exists():
            raise SystemExit(f"{needed} not found beside {test_file} (TRL's tests folder)")
    tests = work / "trl_tests"
    tests.mkdir(parents=True, exist_ok=True)
    (tests / "__init__.py").write_text("")
    for name in ("testing_utils.py", "conftest.py"):
        shutil.copyfile(src / name, tests / name)
    shutil.copyfile(test_file, tests / "test_grpo_trainer.py")
    (work / "conftest.py").write_text(
        "import json\nZEN_JSON = " + repr(json.dumps(_ZEN)) + "\n" + _CONFTEST
    )
    build_models(work, tokenizer)


def deselect_args(test_file: Path) -> list[str]:
    """``-k`` expression excluding every EXCLUDED substring (matched against test names and
    parameters, as pytest's -k does)."""
    return ["-k", " and ".join(f"not {k}" for k in EXCLUDED)]


def run(args) -> int:
    work = Path(args.work).resolve()
    prepare(Path(args.test_file), work, Path(args.tokenizer))
    xml = work / "results" / args.trainer / f"{args.chunk}.xml"
    xml.parent.mkdir(parents=True, exist_ok=True)
    k = deselect_args(Path(args.test_file))[1]
    if args.k:
        k = f"({args.k}) and {k}"
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, MRTPO_CONFORMANCE_TRAINER=args.trainer, HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled",
               PYTHONPATH=path, MRTPO_CONFORMANCE_TRAIN_ROWS=str(args.train_rows))  # fmt: skip
    targets = ["trl_tests/test_grpo_trainer.py"]
    if args.nodes:  # exactly these tests (ids as pytest --collect-only -q prints them)
        lines = Path(args.nodes).read_text().split()
        targets = [t for t in lines if t.startswith("trl_tests/test_grpo_trainer.py::")]
        if not targets or len(targets) != len(lines):
            raise SystemExit(f"--nodes: expected test ids 'trl_tests/test_grpo_trainer.py::"
                             f"Class::test', one per line, in {args.nodes}")  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", *targets, "-k", k,
           "-p", "no:cacheprovider", "-o", "addopts=", "-q", f"--junitxml={xml}",
           "--rootdir", str(work), *args.pytest_args]  # fmt: skip
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=work, env=env)


def outcomes(folder: Path) -> dict[str, str]:
    """test id -> passed / failed / skipped / xfailed, over every chunk's XML (a later chunk's
    outcome wins where one test ran twice)."""
    seen: dict[str, str] = {}
    for xml in sorted(folder.glob("*.xml"), key=lambda p: p.stat().st_mtime):
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
            tags = {c.tag for c in case}
            skipped = case.find("skipped")
            if "failure" in tags or "error" in tags:
                seen[name] = "failed"
            elif skipped is not None:
                xf = skipped.get("type") == "pytest.xfail"
                seen[name] = "xfailed" if xf else "skipped"
            else:
                seen[name] = "passed"
    return seen


def summary(args) -> int:
    work = Path(args.work).resolve()
    runs = {t: outcomes(work / "results" / t) for t in ("trl", "mrtpo")}
    for trainer, seen in runs.items():
        counts = {o: sum(v == o for v in seen.values()) for o in
                  ("passed", "failed", "skipped", "xfailed")}  # fmt: skip
        print(f"{trainer}: {len(seen)} tests: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    trl, ours = runs["trl"], runs["mrtpo"]
    regressions = sorted(t for t, o in trl.items() if o == "passed" and ours.get(t) != "passed")
    print(f"pass with TRL's trainer and not with ours: {len(regressions)}")
    for t in regressions:
        print(f"  {t}: {ours.get(t, 'not run')}")
    only_trl_failed = sorted(t for t, o in trl.items() if o == "failed")
    print(f"fail with TRL's trainer: {len(only_trl_failed)}")
    for t in only_trl_failed:
        print(f"  {t} (ours: {ours.get(t, 'not run')})")
    return 1 if regressions else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run TRL's test file with one trainer")
    r.add_argument("test_file", help="TRL's tests/test_grpo_trainer.py")
    r.add_argument("--trainer", choices=("trl", "mrtpo"), required=True)
    r.add_argument("--work", required=True, help="work folder (stand-in models, results)")
    r.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder")
    r.add_argument("-k", default=None, help="pytest -k expression selecting a chunk")
    r.add_argument("--chunk", default="all", help="name of this chunk's result file")
    r.add_argument("--nodes", default=None, help="a file of test ids, one per line (as "
                   "pytest --collect-only -q prints them in WORK): run exactly those")  # fmt: skip
    r.add_argument("--train-rows", type=int, default=17, choices=range(1, 18),
                   metavar="1..17", help="rows of the zen train split (TRL's has 17; fewer "
                   "rows, fewer steps: every test trains num_train_epochs over it)")  # fmt: skip
    s = sub.add_parser("summary", help="compare the two trainers' results")
    s.add_argument("--work", required=True)
    args, rest = p.parse_known_args(argv)  # what is left goes to pytest (run only)
    if rest and args.cmd != "run":
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    args.pytest_args = [a for a in rest if a != "--"]
    return run(args) if args.cmd == "run" else summary(args)


if __name__ == "__main__":
    sys.exit(main())
