"""GRPO with MRTPO credit assignment in TRL: MRTPOGRPOTrainer with a contrastive replay.

Two rewards: "says the quoted word" (its verifier checks the quoted word in the prompt: that
span is removed in the replay) and a length reward (no span: spread uniformly, as in GDPO).

    python examples/trl_grpo_mrtpo.py                 # tiny model built in code, CPU
    python examples/trl_grpo_mrtpo.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 50 \\
        --batch 16 --generations 8 --max-completion 64 --out runs/trl_mrtpo

Needs trl (pinned in requirements.txt). A --model path or hub name is loaded with
transformers; without it a tiny Qwen2 and tokenizer are built from this file's prompts.
"""

from __future__ import annotations

import argparse
import re

import torch

WORDS = ["blue", "gold", "owls", "rain", "cat", "tree", "salt", "moon"]
PROMPTS = [f'Write a short line that says the word "{w}".' for w in WORDS]


def quoted_span(prompt: str) -> tuple[int, int]:
    m = re.search(r'"([^"]+)"', prompt)
    return (m.start(1), m.end(1))


def reward_says_word(prompts, completions, **kwargs):
    return [float(p[slice(*quoted_span(p))] in c) for p, c in zip(prompts, completions)]


def reward_length(completions, **kwargs):
    return [min(len(c), 40) / 40.0 for c in completions]


def make_relevance_fn(tokenizer, temperature: float):
    """relevance_fn for MRTPOGRPOTrainer: JS relevance of each reward's prompt spans.

    TRL tokenizes plain-string prompts as they are, so the prompt without reward k's span is
    the text with the span cut out, tokenized the same way. Masked (truncated) completions
    are empty responses: no replay, relevance 0.
    """
    from mrtpo.integrations.common import padded_from_packed
    from mrtpo.model import lm_head
    from mrtpo.replay import forward_shared_prompts
    from mrtpo_kernels import linear_js_distance

    def relevance_fn(trainer, inputs, output):
        model = trainer.accelerator.unwrap_model(trainer.model)
        device = output["completion_ids"].device
        mask = output["completion_mask"]
        prompts = [x["prompt"] for x in inputs]
        prompt_ids = [
            ids[m.bool()].tolist() for ids, m in zip(output["prompt_ids"], output["prompt_mask"])
        ]
        responses = [ids[m.bool()].tolist() for ids, m in zip(output["completion_ids"], mask)]
        k, b = len(trainer.reward_funcs), len(prompts)
        has_info = torch.zeros(b, k, dtype=torch.bool)
        has_info[:, 0] = True  # reward 0 checks the quoted word; reward 1 names no span
        pad = tokenizer.pad_token_id
        was_training = model.training
        model.eval()
        with torch.no_grad():
            hp = forward_shared_prompts(model, prompt_ids, responses, pad, micro_batch=32,
                                        device=device)  # fmt: skip
            hq = hp.unsqueeze(0).repeat(k, 1, 1)
            without = []
            for p in prompts:
                s, e = quoted_span(p)
                without.append(tokenizer(p[:s] + p[e:], add_special_tokens=False)["input_ids"])
            hq[0] = forward_shared_prompts(model, without, responses, pad, micro_batch=32,
                                           device=device)  # fmt: skip
            weight, bias = lm_head(model)
            if hp.shape[0] == 0:  # every completion masked as truncated
                rel = hp.new_zeros((k, 0), dtype=torch.float32)
            else:
                rel = linear_js_distance(hp, hq, weight, bias=bias, temperature=temperature)
        model.train(was_training)
        return padded_from_packed(rel, mask), has_info.to(device)

    return relevance_fn


def tiny_model():
    from mrtpo.model import TinyConfig, build_tiny_model, build_tokenizer

    tok = build_tokenizer(PROMPTS * 8 + [" ".join(WORDS)] * 8)
    cfg = TinyConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                     num_kv_heads=1, max_positions=128)  # fmt: skip
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model path or name (default: tiny)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="per-device train batch size")
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--max-completion", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default="runs/trl_grpo_mrtpo")
    args = ap.parse_args(argv)

    import datasets
    import trl

    from mrtpo.integrations.trl import MRTPOGRPOTrainer

    torch.manual_seed(0)
    if args.model is None:
        model, tok = tiny_model()
        # TRL builds the reference model (beta > 0) from the policy's path: save it there
        path = f"{args.out}/tiny-policy"
        model.save_pretrained(path)
        model.config._name_or_path = path
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model)
        tok = AutoTokenizer.from_pretrained(args.model)
    config = trl.GRPOConfig(
        output_dir=args.out, per_device_train_batch_size=args.batch,
        num_generations=args.generations, max_completion_length=args.max_completion,
        max_steps=args.steps, learning_rate=args.lr, beta=args.beta,
        temperature=args.temperature, mask_truncated_completions=True, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=not torch.cuda.is_available(), seed=0,
    )  # fmt: skip
    trainer = MRTPOGRPOTrainer(
        model=model, reward_funcs=[reward_says_word, reward_length], args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS * 4}),
        processing_class=tok, mrtpo_alpha=args.alpha,
        relevance_fn=make_relevance_fn(tok, args.temperature),
    )  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for h in logs:
        print(f"step {h['step']}: loss {h['loss']:.4f} reward {h.get('reward', float('nan')):.3f}")
    return logs


if __name__ == "__main__":
    main()
