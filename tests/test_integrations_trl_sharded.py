"""MRTPOGRPOTrainer on sharded engines (issue 39): FSDP2 (Accelerate's ``fully_shard``, reshard
after forward or not), FSDP1 (FULL_SHARD, one unit per decoder layer), DeepSpeed ZeRO-3
(every parameter partitioned; where DeepSpeed is installed), two gloo processes on the CPU,
two steps, rank 1's rows naming no span (so only rank 0 replays), half the prompts naming
none, or rank 1's completions all EOS alone. On such an engine every layer's forward is a
collective: the replay must run the same forwards on every rank
(mrtpo/integrations/engine.py), so a hang here is a failure (a deadline). Both ranks end
with the same full weights, within 1e-6 of the DDP run's (fp32).

Accelerate 1.15 selects FSDP only in the GPU branch of ``AcceleratorState``, and DeepSpeed
only off its CPU switch: ``_cpu_fsdp_shim`` and ``_cpu_deepspeed_state`` are TEST-ONLY, they
route a multi-process CPU run into Accelerate's own FSDP code (``fsdp2_prepare_model`` /
FSDP1 wrapping) or DeepSpeed code, as a GPU run would be."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_integrations_trl_distributed import WORLD, _free_port, _join_group  # noqa: E402

# rank 1's rows name no span (only rank 0 replays); rank 1's completions are EOS alone;
# every second prompt names no span, on both ranks
CASES = ("rank1-no-spans", "rank1-eos-only", "half-no-spans")
DEADLINE_S = 480
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples", "accelerate")


def _cpu_fsdp_shim():
    """TEST-ONLY: a CPU run given an FSDP plugin becomes Accelerate's FSDP type (Accelerate
    1.15 sets it only where a GPU-type device exists); everything after that is
    Accelerate's own FSDP code."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState.__init__, "_mrtpo_cpu_fsdp", False):
        return
    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    init._mrtpo_cpu_fsdp = True
    AcceleratorState.__init__ = init

    # Accelerate hands FSDP1 its device as ``device_id`` ("cpu:0"), which FSDP1 compares
    # with the CPU's current device ("cpu")
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    fsdp1_init = FSDP1.__init__

    def fsdp1_cpu(self, module, *args, device_id=None, **kwargs):
        if isinstance(device_id, torch.device) and device_id.type == "cpu":
            device_id = torch.device("cpu")
        fsdp1_init(self, module, *args, device_id=device_id, **kwargs)

    FSDP1.__init__ = fsdp1_cpu


def engine_env(engine: str) -> dict:
    """The environment ``accelerate launch --config_file examples/accelerate/<engine>.yaml``
    gives each process (Accelerate's own launcher code), with the CPU's two differences:
    no mixed precision, no sync_module_states (Accelerate looks for a GPU for it; both
    ranks build the same model from one seed). "fsdp2-keep": fsdp2.yaml with
    fsdp_reshard_after_forward false."""
    if engine in ("ddp", "zero3"):  # ZeRO-3: the Trainer's ``deepspeed`` config (_config)
        return {}
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = os.path.join(EXAMPLES, f"{engine.split('-')[0]}.yaml")
    args = launch_command_parser().parse_args(["--config_file", path, "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = {k: v for k, v in prepare_multi_gpu_env(args).items()
           if k.startswith(("FSDP_", "ACCELERATE_USE_FSDP"))}  # fmt: skip
    env.update(FSDP_SYNC_MODULE_STATES="false")
    if engine == "fsdp2-keep":
        env.update(FSDP_RESHARD_AFTER_FORWARD="false")
    return env


# DeepSpeed ZeRO-3 as a user gives it to the Trainer (``--deepspeed ds_config.json``), every
# parameter partitioned: DeepSpeed's default keeps parameters under 1e5 elements whole on
# every rank (all of the tiny model's), which would test nothing
ZERO3_CONFIG = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}  # fmt: skip


def _config(output_dir: str, engine: str = "ddp"):
    """The two-process tests' step (test_integrations_trl_distributed), two steps, with
    SGD: the weights move by the gradients themselves (Adam's first steps move each weight
    by about the learning rate whatever its gradient's size, so a gradient off by a factor
    would pass, and one whose true value is 0 moves by its rounding's sign). ZeRO-3: the
    process state of ``_cpu_deepspeed_state``, used as it is."""
    zero3 = engine == "zero3"
    if zero3:
        _cpu_deepspeed_state()
    return trl.GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=6, num_generations=4,
        max_completion_length=6, max_steps=2, learning_rate=1e-2, beta=0.0, optim="sgd",
        mask_truncated_completions=True, temperature=1.3, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=not zero3, bf16=False, seed=0,
        deepspeed=dict(ZERO3_CONFIG) if zero3 else None,
        accelerator_config={"use_configured_state": True} if zero3 else None,
    )  # fmt: skip


def _cpu_deepspeed_state():
    """TEST-ONLY: Accelerate's process state for DeepSpeed on a CPU, as a GPU run gets it.
    Accelerate selects DeepSpeed only off its CPU switch, and Transformers then names no
    backend, so Accelerate counts one process; here the state is made first with gloo
    named (DeepSpeed's CPU accelerator names the device), and the Trainer uses it as it is
    (``use_configured_state``). Everything after that is Accelerate's own DeepSpeed code."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")


def _has_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def _deepspeed_on_gloo():
    """TEST-ONLY: DeepSpeed's CPU backend without its shared-memory all-reduce, which it
    compiles on first use (minutes, into the user's torch_extensions cache): its
    collectives then go to torch.distributed's gloo as they are. Call before DeepSpeed
    initializes its communication."""
    import importlib

    # (``import deepspeed.comm.torch as m`` would give torch: deepspeed.comm imports it)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def _head_partitioned(model) -> bool | None:
    """ZeRO-3: whether this rank holds only its partition of the LM head's weight now."""
    from mrtpo.integrations.engine import _inner, engine_sharding

    if engine_sharding(model) != "zero3":
        return None
    weight = _inner(model).get_output_embeddings().weight
    return weight.numel() == 0 and weight.ds_tensor.numel() < weight.ds_numel


def full_weights(model) -> dict:
    """Every parameter in full on this rank (a collective on a sharded engine)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    from mrtpo.integrations.engine import _inner, engine_sharding, zero3_full_copies

    if engine_sharding(model) == "zero3":  # one parameter at a time (zero3_full_copies)
        names, params = zip(*_inner(model).named_parameters())
        return dict(zip(names, zero3_full_copies(params)))
    if any(isinstance(m, FSDP1) for m in model.modules()):
        with FSDP1.summon_full_params(model, writeback=False):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                    for n, p in model.named_parameters()}  # fmt: skip
    out = {}
    for n, p in model.named_parameters():
        full = getattr(p, "full_tensor", None)
        out[n.replace("module.", "", 1) if n.startswith("module.") else n] = (
            (full() if full is not None else p).detach().clone()
        )
    return out


def _rank_main(rank: int, port: int, out: str, engines, cases=None):
    _join_group(rank, port)
    os.environ["DS_ACCELERATOR"] = "cpu"  # before DeepSpeed is imported
    cases = CASES if cases is None else cases
    if "zero3" in engines:
        _deepspeed_on_gloo()
    from accelerate.state import AcceleratorState
    from test_integrations_trl_replay import (
        PROMPTS,
        WORDS,
        ends_bye,
        length,
        quoted,
        says_word,
        tiny_model,
        user_text,
    )

    from mrtpo.integrations import trl_trainer
    from mrtpo.integrations.engine import engine_sharding
    from mrtpo.integrations.trl_grpo import trainer as trl_grpo_trainer

    if os.environ.get("MRTPO_TEST_UNSAFE_REPLAY"):  # the replay before issue 39 (to see it hang)
        import contextlib

        trl_grpo_trainer.sharded_replay = lambda *a, **k: contextlib.nullcontext()

    _cpu_fsdp_shim()

    case = {"name": None}

    def spanless(prompt) -> bool:
        """This row names no span: every row of rank 1 ("rank1-no-spans"), the rows of every
        second prompt on both ranks ("half-no-spans")."""
        if case["name"] == "rank1-no-spans":
            return rank == 1
        return case["name"] == "half-no-spans" and PROMPTS.index(user_text(prompt)) % 2 == 1

    def word_spans(prompt, **columns):
        return [] if spanless(prompt) else [quoted(user_text(prompt), 0)]

    def bye(prompts, completions, **kw):
        scores = ends_bye(prompts, completions, **kw)
        return [float(s[0] if isinstance(s, tuple) else s.score) if spanless(p) else s
                for p, s in zip(prompts, scores)]  # fmt: skip

    class Trainer(trl_trainer.MRTPOGRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            ids, logps = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            if rank == 1 and case["name"] == "rank1-eos-only":
                ids = [[self._tokenizer.eos_token_id] for _ in ids]  # empty completions
            return ids, logps

    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    ds = datasets.Dataset.from_dict({"prompt": prompts * 3, "topic": WORDS * 3})
    engine_keys = ("FSDP_", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED",
                   "ACCELERATE_DEEPSPEED", "ACCELERATE_USE_CPU")  # fmt: skip
    for name in cases:
        case["name"] = name
        for engine in engines:
            AcceleratorState._reset_state()
            for key in [k for k in os.environ if k.startswith(engine_keys)]:
                del os.environ[key]  # the previous run's engine
            os.environ.update(engine_env(engine))
            if engine != "zero3":
                os.environ["ACCELERATE_USE_CPU"] = "yes"
            torch.manual_seed(0)
            model, tok = tiny_model()
            initial = {n: p.detach().clone() for n, p in model.named_parameters()}
            config = _config(os.path.join(out, f"{name}-{engine}"), engine)
            t0 = time.perf_counter()
            trainer = Trainer(
                model=model, reward_funcs=[says_word, bye, length], args=config,
                train_dataset=ds, processing_class=tok, reward_spans=[word_spans, None, None],
            )  # fmt: skip
            trainer.train()
            seconds = time.perf_counter() - t0
            final = full_weights(trainer.model)
            logs = [h for h in trainer.state.log_history if "mrtpo/replay/pairs" in h]
            torch.save(dict(final=final, initial=initial, logs=logs, seconds=seconds,
                            engine=trainer.accelerator.distributed_type.value,
                            sharding=engine_sharding(trainer.model),
                            partitioned=_head_partitioned(trainer.model)),
                       os.path.join(out, f"{name}.{engine}.rank{rank}.pt"))  # fmt: skip
            if engine == "zero3":  # Transformers' global "ZeRO-3 is on" (its config's) off
                from transformers.integrations.deepspeed import unset_hf_deepspeed_config

                unset_hf_deepspeed_config()
    if cases == CASES:  # on the same gloo group (one spawn for every test of the file)
        _fully_shard_part(rank, out)
        if "zero3" in engines:
            _zero3_replay_part(rank, out)
    trainer.end_training()


def _engines() -> tuple:
    """DDP (the reference) and every sharded engine; ZeRO-3 where DeepSpeed is installed."""
    return ("ddp", "fsdp2", "fsdp2-keep", "fsdp1") + (("zero3",) if _has_deepspeed() else ())


def _run(tmp_path, engines, cases=CASES):
    ctx = mp.start_processes(_rank_main, args=(_free_port(), str(tmp_path), engines, cases),
                             nprocs=WORLD, join=False, start_method="spawn")  # fmt: skip
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                done = sorted(p.name for p in tmp_path.glob("*.pt"))
                pytest.fail(f"two-process sharded run hung after {DEADLINE_S} s; "
                            f"finished: {done}")  # fmt: skip
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return {(c, e): [torch.load(tmp_path / f"{c}.{e}.rank{r}.pt", weights_only=False)
                     for r in range(WORLD)] for c in cases for e in engines}  # fmt: skip


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """Both tests' runs in one two-process spawn (the imports take most of its time)."""
    path = tmp_path_factory.mktemp("sharded")
    engines = _engines()
    return path, engines, _run(path, engines)


@pytest.mark.slow
def test_sharded_engines_train_as_ddp_whatever_a_rank_holds(sharded_runs):
    _, engines, recs = sharded_runs
    for case in CASES:
        ref = recs[(case, "ddp")][0]["final"]
        for engine in engines:
            r0, r1 = recs[(case, engine)]
            kind = {"ddp": "MULTI_CPU", "zero3": "DEEPSPEED"}.get(engine, "FSDP")
            assert r0["engine"] == r1["engine"] == kind, engine
            sharding = {"ddp": None, "fsdp1": "fsdp1", "zero3": "zero3"}.get(engine, "fsdp2")
            assert r0["sharding"] == sharding, engine
            # ZeRO-3: the head really is partitioned (DeepSpeed keeps small parameters whole
            # unless told otherwise)
            assert r0["partitioned"] is r1["partitioned"] is (engine == "zero3" or None)
            assert r0["final"].keys() == ref.keys(), engine
            for key, val in ref.items():  # fp32: the same step as DDP's, on both ranks
                torch.testing.assert_close(r0["final"][key], r1["final"][key], rtol=0, atol=0,
                                           msg=lambda m, c=case, e=engine, k=key:
                                           f"{c} {e} {k}, rank 0 against rank 1: {m}")  # fmt: skip
                torch.testing.assert_close(r0["final"][key], val, rtol=0, atol=1e-6,
                                           msg=lambda m, c=case, e=engine, k=key:
                                           f"{c} {e} {k}: {m}")  # fmt: skip
            # the weights moved (SGD: by the gradients), so the check above says something
            moved = max((val - recs[(case, engine)][0]["initial"][key]).abs().max().item()
                        for key, val in r0["final"].items())  # fmt: skip
            assert moved > 1e-4, (case, engine, moved)
            # the replay ran in both steps (rank 0's rows at least) and logged the same
            # figures as DDP's
            assert len(r0["logs"]) == 2, (case, engine)
            for h, h_ref in zip(r0["logs"], recs[(case, "ddp")][0]["logs"]):
                assert h["mrtpo/replay/pairs"] == h_ref["mrtpo/replay/pairs"] > 0


# --------------------------------------------------------------------------- fully_shard
# The engine module alone on torch's own FSDP2 (``fully_shard`` per decoder layer and the
# root on a CPU mesh, no Accelerate, no TRL): rank 0 replays rows with spans, rank 1 none.
# The replay's relevance equals the unsharded model's; the training step after it gives
# the same weights as with no replay at all (FSDP2's recorded forward order, which drives
# the backward's prefetch, is as before the replay); the replay's peak parameter memory is
# the engine's own forward's plus at most one copy of the LM head.


def _param_bytes(model) -> int:
    """Bytes of the parameters FSDP2 holds unsharded now (every unit of ``model``)."""
    from mrtpo.integrations.engine import _fsdp2_states

    n = 0
    for _, groups in _fsdp2_states(model):
        for group in groups:
            for fp in group.fsdp_params:
                if fp.sharded_state.name == "UNSHARDED":
                    n += fp.unsharded_param.numel() * fp.unsharded_param.element_size()
    return n


def _fully_shard_part(rank: int, out: str):
    import copy

    import torch.distributed as dist
    from test_integrations_trl_replay import PROMPTS, quoted, tiny_model, user_text
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mrtpo.integrations.engine import _fsdp2_states, sharded_replay
    from mrtpo.replay.api import replay_relevance

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    base, tok = tiny_model()
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    spans = [[[quoted(user_text(p), 0)], [quoted(user_text(p), 1)]] for p in prompts]
    gen = torch.Generator().manual_seed(1)
    responses = [torch.randint(3, len(tok), (n,), generator=gen).tolist() for n in (5, 3, 6, 1)]
    batch = torch.randint(3, len(tok), (4, 12), generator=gen)
    results = {}
    for reshard in (True, False):
        for replay in (True, False):
            model = copy.deepcopy(base)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            peak = {"now": 0}

            def watch(module, args, peak=peak, model=model):
                peak["now"] = max(peak["now"], _param_bytes(model))

            hooks = [m.register_forward_pre_hook(watch) for m in model.modules()]
            model.eval()
            orders = [
                len(getattr(s._comm_ctx, "post_forward_order", ())) for s, _ in _fsdp2_states(model)
            ]
            rep, head_bytes, forwards = None, 0, 0
            with sharded_replay(model) as lm:
                head_bytes = lm.head_copy_bytes
                if replay and rank == 0:
                    rep = replay_relevance(lm, prompts, responses, spans, tokenizer=tok,
                                           temperature=1.0)  # fmt: skip
            forwards = lm.lockstep.forwards
            after = [
                len(getattr(s._comm_ctx, "post_forward_order", ())) for s, _ in _fsdp2_states(model)
            ]
            replay_peak, peak["now"] = peak["now"], 0
            model.train()
            logits = model(input_ids=batch).logits
            torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                              batch[:, 1:].flatten()).backward()  # fmt: skip
            opt.step()
            train_peak = peak["now"]
            for h in hooks:
                h.remove()
            final = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
            results[(reshard, replay)] = dict(
                final=final, orders=(orders, after), forwards=forwards,
                relevance=None if rep is None else rep.relevance, replay_peak=replay_peak,
                train_peak=train_peak, head_bytes=head_bytes,
                full_bytes=sum(p.numel() * p.element_size() for p in base.parameters()),
            )  # fmt: skip
    plain = replay_relevance(copy.deepcopy(base).eval(), prompts, responses, spans,
                             tokenizer=tok, temperature=1.0)  # fmt: skip
    head = base.get_output_embeddings()
    head_bytes = (head.weight.numel() + head.bias.numel()) * head.weight.element_size()
    torch.save(dict(results=results, plain=plain.relevance, head_bytes=head_bytes),
               os.path.join(out, f"r{rank}.pt"))  # fmt: skip
    dist.barrier()


@pytest.mark.slow
def test_fully_shard_replay_lockstep_forward_order_and_memory(sharded_runs):
    tmp_path, _, _ = sharded_runs
    recs = [torch.load(tmp_path / f"r{r}.pt", weights_only=False) for r in range(WORLD)]
    for reshard in (True, False):
        with_replay = [r["results"][(reshard, True)] for r in recs]
        without = [r["results"][(reshard, False)] for r in recs]
        # the relevance of rank 0's rows is the unsharded model's
        torch.testing.assert_close(with_replay[0]["relevance"], recs[0]["plain"],
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
        assert bool(with_replay[0]["relevance"].any())
        # rank 1 ran as many forwards (dummies) as rank 0, and nothing of them stays in
        # FSDP2's recorded forward order
        assert with_replay[0]["forwards"] == with_replay[1]["forwards"] > 0
        assert without[1]["forwards"] == 0
        for r in with_replay:
            assert r["orders"][0] == r["orders"][1]
        # the step after the replay: the same weights as with no replay, on both ranks
        for key, val in without[0]["final"].items():
            for r in with_replay + without[1:]:
                torch.testing.assert_close(r["final"][key], val, rtol=0, atol=0)
        # peak parameter memory of the replay: what FSDP2 holds unsharded (the root's unit
        # and one layer's at most), as in the engine's own training forward, plus at most
        # one copy of the LM head
        head = recs[0]["head_bytes"]
        for r in with_replay:
            assert 0 < r["replay_peak"] <= r["train_peak"], r
            assert r["replay_peak"] + r["head_bytes"] <= r["train_peak"] + head, r
            if reshard:
                assert r["replay_peak"] < r["full_bytes"]


# --------------------------------------------------------------------------- fast checks


def test_fused_head_runs_as_the_head_modules_forward():
    """ZeRO-3's path for the fused head (``_as_module_forward``): the hooks an engine put on
    the head module run around it (ZeRO-3 gathers and releases there), the gradient reaches
    the head's own parameters, and the module's forward is its own again after (also when
    it had one set on the instance)."""
    from mrtpo.integrations.trl_grpo.fused_head import _as_module_forward, _partitioned

    head = torch.nn.Linear(4, 3)
    seen = []
    head.register_forward_pre_hook(lambda m, args: seen.append(("pre", args[0].shape)))
    head.register_forward_hook(lambda m, args, out: seen.append(("post", type(out))))
    hidden = torch.randn(2, 4, requires_grad=True)

    def loss_of(h):
        return (h @ head.weight.t() + head.bias).square().sum(), h.sum().detach()

    loss, extra = _as_module_forward(head, loss_of, hidden)
    assert seen == [("pre", (2, 4)), ("post", tuple)]
    loss.backward()
    want = torch.autograd.grad(((hidden @ head.weight.t() + head.bias).square().sum()),
                               head.weight)[0]  # fmt: skip
    torch.testing.assert_close(head.weight.grad, want)
    assert "forward" not in head.__dict__ and head(hidden).shape == (2, 3)
    head.forward = own = lambda h: h
    _as_module_forward(head, loss_of, hidden)
    assert head.forward is own
    assert not _partitioned(head.weight)  # a plain parameter: the fused head runs directly


def test_zero3_full_copies_gather_one_parameter_at_a_time(monkeypatch):
    """DeepSpeed's gather of several parameters at once waits on its last all-gather only
    (ordered on a GPU stream, not on gloo: one rank read garbage rows in about one run of
    four here); zero3_full_copies opens one gather per parameter and copies inside it."""
    pytest.importorskip("deepspeed")
    import deepspeed

    from mrtpo.integrations.engine import zero3_full_copies

    seen = []

    class Gathered:
        def __init__(self, params, modifier_rank=None):
            self.params = params
            assert modifier_rank is None

        def __enter__(self):
            seen.append(list(self.params))
            for p in self.params:  # the gathered value, visible only inside the context
                p.data = torch.full(p.shape, float(len(seen)))

        def __exit__(self, *exc):
            for p in self.params:
                p.data = torch.zeros(p.shape)

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", Gathered)
    params = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(3))]
    copies = zero3_full_copies(params)
    assert [[id(p) for p in c] for c in seen] == [[id(params[0])], [id(params[1])]]
    assert [float(c.unique()) for c in copies] == [1.0, 2.0]  # copied while gathered
    assert not any(c.requires_grad for c in copies)


def test_zero3_example_config_launches_stage_3():
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    for stage in (2, 3):
        path = os.path.join(EXAMPLES, f"zero{stage}.yaml")
        args = launch_command_parser().parse_args(["--config_file", path, "train.py"])
        args, defaults, _ = _validate_launch_command(args)
        assert args.use_deepspeed and not args.cpu
        # as accelerate's launch_command before its DeepSpeed launcher
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
        assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
        assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == str(stage)
        assert env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "none"


def test_replicated_models_replay_unwrapped():
    from test_integrations_trl_replay import tiny_model

    from mrtpo.integrations.engine import engine_sharding, sharded_replay

    model, _ = tiny_model()
    assert engine_sharding(model) is None
    with sharded_replay(model) as lm:  # no collective, the unwrapped model replays
        assert lm is None


@pytest.mark.parametrize("engine", ["fsdp2", "fsdp2-keep", "fsdp1"])
def test_example_configs_launch_the_engine_the_docs_name(engine):
    env = engine_env(engine)
    assert env["ACCELERATE_USE_FSDP"] == "true"
    assert env["FSDP_VERSION"] == engine[4]
    assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == ("false" if engine == "fsdp2-keep" else "true")
    if engine == "fsdp1":
        assert env["FSDP_SHARDING_STRATEGY"] == "FULL_SHARD"


# --------------------------------------------------------------------------- ZeRO-3
# The replay alone on a DeepSpeed ZeRO-3 engine made by ``deepspeed.initialize`` (no
# Accelerate, no TRL), every parameter partitioned: rank 0 replays, rank 1 has nothing to.
# Skipped where DeepSpeed is not installed (requirements-engines.txt). DeepSpeed's CPU
# accelerator talks gloo here.


def _zero3_replay_part(rank: int, out: str):
    """On the gloo group of ``_rank_main`` (one spawn for every test of this file)."""
    import copy

    import deepspeed
    from test_integrations_trl_replay import PROMPTS, quoted, tiny_model, user_text

    from mrtpo.integrations.engine import engine_sharding, sharded_replay
    from mrtpo.replay.api import replay_relevance

    _deepspeed_on_gloo()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    base, tok = tiny_model()
    model = copy.deepcopy(base)
    # DeepSpeed's prefetch and reuse caches off: each module's parameters are gathered for
    # its forward alone (by default the tiny model fits in them whole, replay or not)
    zero = dict(ZERO3_CONFIG["zero_optimization"], stage3_prefetch_bucket_size=0,
                stage3_max_reuse_distance=0)  # fmt: skip
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_allow_untested_optimizer": True}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=model.parameters())  # fmt: skip
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    spans = [[[quoted(user_text(p), 0)], [quoted(user_text(p), 1)]] for p in prompts]
    gen = torch.Generator().manual_seed(1)
    responses = [torch.randint(3, len(tok), (n,), generator=gen).tolist() for n in (5, 3, 6, 1)]
    # peak bytes of the parameters DeepSpeed holds gathered, seen before each module's forward
    peak = {"now": 0}

    def watch(module, args):
        peak["now"] = max(peak["now"], _zero3_gathered_bytes(engine.module))

    hooks = [m.register_forward_pre_hook(watch) for m in engine.module.modules()]
    engine.eval()
    rep = None
    with torch.no_grad(), sharded_replay(engine) as lm:
        if rank == 0:  # rank 1 has nothing to replay
            rep = replay_relevance(lm, prompts, responses, spans, tokenizer=tok,
                                   temperature=1.0)  # fmt: skip
    replay_peak, peak["now"] = peak["now"], 0
    engine.train()  # the engine's own training forward and backward, for comparison
    batch = torch.randint(3, len(tok), (1, 12), generator=gen)
    engine.backward(engine(input_ids=batch, labels=batch).loss)
    train_peak = peak["now"]
    for h in hooks:
        h.remove()
    plain = replay_relevance(base.eval(), prompts, responses, spans, tokenizer=tok,
                             temperature=1.0)  # fmt: skip
    torch.save(dict(sharding=engine_sharding(engine), forwards=lm.lockstep.forwards,
                    relevance=None if rep is None else rep.relevance, plain=plain.relevance,
                    replay_peak=replay_peak, train_peak=train_peak,
                    head_copy_bytes=lm.head_copy_bytes,
                    full_bytes=sum(p.numel() * p.element_size() for p in base.parameters()),
                    partitioned=_head_partitioned(engine)),
               os.path.join(out, f"zero3.rank{rank}.pt"))  # fmt: skip
    torch.distributed.barrier()


def _zero3_gathered_bytes(module) -> int:
    """Bytes of ``module``'s parameters that DeepSpeed ZeRO-3 holds gathered (in full) now."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return sum(p.ds_numel * p.element_size() for p in module.parameters()
               if p.ds_status == ZeroParamStatus.AVAILABLE)  # fmt: skip


@pytest.mark.slow
def test_replay_on_a_zero3_engine(request):
    if not _has_deepspeed():
        pytest.skip("DeepSpeed is not installed (requirements-engines.txt)")
    # run in the file's one spawn (a hang there fails its deadline)
    tmp_path, _, _ = request.getfixturevalue("sharded_runs")
    r0, r1 = (torch.load(tmp_path / f"zero3.rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["sharding"] == r1["sharding"] == "zero3"
    assert r0["partitioned"] and r1["partitioned"]
    assert r0["forwards"] == r1["forwards"] > 0
    torch.testing.assert_close(r0["relevance"], r0["plain"], rtol=1e-5, atol=1e-6)
    assert bool(r0["relevance"].any())
    # peak parameter memory of the replay: no more gathered than in the engine's own
    # training forward, plus the head's copy; never the whole model
    for r in (r0, r1):
        assert 0 < r["replay_peak"] <= r["train_peak"], r
        assert r["replay_peak"] < r["full_bytes"], r
        assert 0 < r["head_copy_bytes"] < r["full_bytes"] // 2, r
