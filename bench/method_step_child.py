"""One measured case of ``python -m bench.method_step`` (bench/method_step.py has the stages,
the variants and the memory rules): the stage clock, the replay engine's calls wrapped so
that its time falls into stages, one method step cut into those stages, and ``child``, the
case as its fresh process runs it (a warm-up step, then the measured step).
"""

from __future__ import annotations

import contextlib
import gc
import resource
import time

from .method_step_batch import build_batch, build_model


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class StageClock:
    """Wall time and peak memory per stage; ``switch(stage)`` closes the current stage."""

    def __init__(self, device):
        import torch

        self.c = 0.0
        self.torch = torch
        self.cuda = device.type == "cuda"
        self.device = device
        self.ms: dict[str, float] = {}
        self.cpu_ms: dict[str, float] = {}
        self.peak: dict[str, int] = {}
        self.cur: str | None = None
        self.t = 0.0
        self.peak_method = "max_memory_allocated" if self.cuda else "VmHWM reset per stage"

    def _sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def _reset_peak(self):
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.peak_method = "ru_maxrss (VmHWM reset not allowed)"

    def _read_peak(self) -> int:
        if self.cuda:
            return int(self.torch.cuda.max_memory_allocated(self.device))
        kib = _status_kib("VmHWM") if self.peak_method.startswith("VmHWM") else None
        if kib is None:
            kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kib * 1024

    def current_bytes(self) -> int:
        if self.cuda:
            return int(self.torch.cuda.memory_allocated(self.device))
        return (_status_kib("VmRSS") or 0) * 1024

    def start(self, stage: str):
        self._sync()
        self._reset_peak()
        self.cur, self.t, self.c = stage, time.perf_counter(), time.process_time()

    def switch(self, stage: str | None):
        if self.cur is None or stage == self.cur:
            return
        self._sync()
        now, cpu = time.perf_counter(), time.process_time()
        self.ms[self.cur] = self.ms.get(self.cur, 0.0) + (now - self.t) * 1e3
        self.cpu_ms[self.cur] = self.cpu_ms.get(self.cur, 0.0) + (cpu - self.c) * 1e3
        self.peak[self.cur] = max(self.peak.get(self.cur, 0), self._read_peak())
        self._reset_peak()
        self.cur, self.t, self.c = stage, time.perf_counter(), time.process_time()

    def stop(self):
        self.switch(None)
        self.cur = None


class _Off:
    cur = None

    def switch(self, stage):
        pass


@contextlib.contextmanager
def engine_stages(clock, full_prompts, replaying: bool):
    """Wrap the replay engine's calls (in mrtpo.replay.engine; the prompts without spans are
    tokenized in mrtpo.replay.api) so that its time falls into stages: a forward of a
    with-information prompt and the old log-probs after it are ``info_forward``; from there
    to the JS, ``replay``; the JS and what follows it, ``js``."""
    import mrtpo.replay.api as rp
    import mrtpo.replay.engine as engine

    full = {tuple(p) for p in full_prompts}
    home = dict.fromkeys(("_rows_hidden", "linear_logprobs", "linear_js_distance"), engine)
    home["_stream_ids"] = rp
    saved = {n: getattr(mod, n) for n, mod in home.items()}
    after_lp = "replay" if replaying else "info_forward"

    def rows_hidden(model, prompts, *a, **kw):
        clock.switch("info_forward" if tuple(prompts[0]) in full else "replay")
        return saved["_rows_hidden"](model, prompts, *a, **kw)

    def logprobs(*a, **kw):
        out = saved["linear_logprobs"](*a, **kw)
        if clock.cur == "info_forward":
            clock.switch(after_lp)
        return out

    def js(*a, **kw):
        clock.switch("js")
        return saved["linear_js_distance"](*a, **kw)

    def stream_ids(*a, **kw):  # tokenizing the prompts without spans: replay work
        prev = clock.cur
        clock.switch("replay" if replaying else prev)
        out = saved["_stream_ids"](*a, **kw)
        clock.switch(prev)
        return out

    wrapped = dict(_rows_hidden=rows_hidden, linear_logprobs=logprobs, linear_js_distance=js,
                   _stream_ids=stream_ids)  # fmt: skip
    for n, f in wrapped.items():
        setattr(home[n], n, f)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(home[n], n, f)


def skip_method() -> str:
    """How ``mrtpo-half`` skips pairs here: the engine's replay_mask, or spans withheld."""
    import inspect

    import mrtpo.replay.api as rp

    has = "replay_mask" in inspect.signature(rp.contrastive_replay).parameters
    return "replay_mask" if has and hasattr(rp, "replay_mask_from_rewards") else "no spans"


def run_step(model, tok, prompter, batch, variant: str, clock, device, *, ckpt=False) -> dict:
    """One step on ``batch`` (rollout aside), as mrtpo train's ``train_step`` and
    ``_update`` run it with one micro-batch; stages into ``clock``. ``ckpt``: the policy's
    forward under ``mrtpo.model.loading.gradient_checkpointing`` (``--gradient-checkpointing``), its
    recompute then in ``backward``."""
    import torch

    import mrtpo.replay.api as rp
    from mrtpo.model.loading import gradient_checkpointing, lm_head
    from mrtpo.replay.relevance_modes import step_mode
    from mrtpo.replay.teacher_forcing import response_hidden, teacher_batch
    from mrtpo.training.config import TrainConfig
    from mrtpo.training.trainer import compute_advantages
    from mrtpo_kernels import linear_policy_loss

    cfg = TrainConfig()
    algo = "gdpo" if variant == "gdpo" else "mrtpo"
    k = batch["rewards"].shape[1]
    spans = batch["spans"]
    kw = {}
    lengths = torch.tensor([len(r) for r in batch["responses"]], dtype=torch.long)
    if variant == "mrtpo-half":
        how = skip_method()
        clock.switch("advantages")  # which pairs can move: GDPO's per-reward advantages
        has_info = torch.tensor([[len(s) > 0 for s in row] for row in spans], dtype=torch.bool)
        mask = (
            rp.replay_mask_from_rewards(batch["rewards"], batch["group_ids"], has_info=has_info)
            if how == "replay_mask"
            else None
        )
        if mask is None:  # withhold the spans of the pairs that cannot move
            from mrtpo_kernels import gdpo_advantages

            moves = gdpo_advantages(batch["rewards"], batch["group_ids"]).per_reward != 0
            spans = [[s if bool(moves[i, j]) else [] for j, s in enumerate(row)]
                     for i, row in enumerate(spans)]  # fmt: skip
        else:
            kw["replay_mask"] = mask
    clock.switch("info_forward")
    with engine_stages(clock, batch["prompt_ids"], replaying=algo == "mrtpo"):
        rep = rp.contrastive_replay(
            model, prompter, batch["texts"], batch["prompt_ids"], batch["responses"], spans,
            temperature=cfg.temperature, micro_batch=cfg.micro_batch * 2,
            replay=algo == "mrtpo", **kw,
        )  # fmt: skip
    clock.switch("advantages")
    has_info = torch.tensor([[len(s) > 0 for s in row] for row in batch["spans"]],
                            dtype=torch.bool)  # fmt: skip
    mode = step_mode(algo, cfg.relevance)
    relevance = mode.relevance(rep, k, lengths, oracle=None)
    adv, _ = compute_advantages(algo, batch["rewards"], batch["group_ids"], relevance, has_info,
                                lengths, cfg)  # fmt: skip
    clock.switch("policy_forward")
    tb = teacher_batch(batch["prompt_ids"], batch["responses"], tok.pad_token_id, device)
    with gradient_checkpointing(model, ckpt):
        hidden = response_hidden(model, tb)
    clock.switch("loss_forward")
    w, b = lm_head(model)
    loss, _ = linear_policy_loss(
        hidden, w, tb.labels, rep.old_logprobs.detach().float().to(device), adv.to(device),
        bias=b, temperature=cfg.temperature, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
    )  # fmt: skip
    clock.switch("backward")
    loss.backward()
    clock.switch("done")
    model.zero_grad(set_to_none=True)
    skipped = int(has_info.sum()) - int(rep.replayed) if algo == "mrtpo" else 0
    return dict(replayed=int(rep.replayed), skipped=skipped, loss=float(loss.detach()))


def child(spec: dict) -> dict:
    """Run one case in this process: warm-up step, then the measured step."""
    import torch

    from mrtpo.replay.prompting import ChatPrompter

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    device = torch.device(spec["device"])
    model, tok = build_model(spec["model"], spec["length"] + 256, spec["cache_dir"], str(device))
    prompter = ChatPrompter(tok)
    shape = dict(prompts=spec["prompts"], group=spec["group"], k=spec["K"], variant=spec["variant"],
                 seed=spec["seed"])  # fmt: skip
    warm = build_batch(tok, prompter, length=spec["warmup_length"], **shape)
    ckpt = bool(spec.get("gradient_checkpointing"))
    run_step(model, tok, prompter, warm, spec["variant"], _Off(), device, ckpt=ckpt)
    batch = build_batch(tok, prompter, length=spec["length"], **shape)
    del warm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    clock = StageClock(device)
    base = clock.current_bytes()
    t0, c0 = time.perf_counter(), time.process_time()
    clock.start("info_forward")
    got = run_step(model, tok, prompter, batch, spec["variant"], clock, device, ckpt=ckpt)
    clock.stop()
    step_ms = (time.perf_counter() - t0) * 1e3
    step_cpu_ms = (time.process_time() - c0) * 1e3
    w = model.get_output_embeddings().weight
    return dict(
        stages={s: {"ms": clock.ms[s], "cpu_ms": clock.cpu_ms[s], "peak": clock.peak[s]}
                for s in clock.ms if s != "done"},
        step_ms=step_ms, step_cpu_ms=step_cpu_ms, baseline=base, peak_method=clock.peak_method,
        skip=skip_method() if spec["variant"] == "mrtpo-half" else "",
        d=int(w.shape[1]), V=int(w.shape[0]), tokens=sum(len(r) for r in batch["responses"]),
        responses=len(batch["responses"]), dtype=str(w.dtype).removeprefix("torch."), **got,
    )  # fmt: skip
