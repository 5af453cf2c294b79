"""The contrastive replay on a sharded training engine (FSDP1, FSDP2, DeepSpeed ZeRO-3): the
same sequence of collectives on every rank whatever its rows hold, and parameters read only
through the engine (docs/trl.md, "Sharded engines"; ../shared/ARCHITECTURE.md, "The
contrastive replay").

On such an engine every layer's forward is a collective (an all-gather of the layer's
shards), so a rank that replays more rows than another would run more collectives and the
ranks would wait on each other forever. ``sharded_replay`` gives the replay a model to run,
``EngineLM``, whose decoder forward is the wrapped module's own forward (the engine gathers
each unit and frees it after, as in training) with the LM head swapped for the identity,
and whose LM head is the head's weight and bias gathered once by the engine (FSDP1
``summon_full_params`` of the unit that holds the head, without its children, copied
out; FSDP2 ``unshard()`` of the unit that holds the head, not recursive, kept unsharded
through the replay; ZeRO-3 ``deepspeed.zero.GatheredParameters`` of the head's parameters,
copied out): never raw shards, never the whole model at once. Before each decoder forward
the ranks run one all-reduce of one int ("I have a forward"); a rank whose replay has ended
answers 0 and runs a one-token dummy forward while another still has one, so that every
rank runs the same forwards in the same order. On FSDP2 the forwards of the replay are then
struck from the order FSDP2 records for its backward prefetch, so the backward prefetches
as it would without a replay.

Replicated engines (DDP, DeepSpeed ZeRO-1/2, one process) need none of this: there the
replay runs the unwrapped module directly and no collective at all (``engine_sharding``
returns None).
"""

from __future__ import annotations

import contextlib
import inspect

import torch

__all__ = ["EngineLM", "engine_sharding", "sharded_replay"]


def engine_sharding(model) -> str | None:
    """How ``model`` (a wrapped training model: DDP, FSDP, DeepSpeed engine, or a plain
    module) holds its parameters: "fsdp1", "fsdp2", "zero3", or None (replicated)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:  # pragma: no cover - torch without distributed
        FSDP1 = None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch before FSDP2's public API
        FSDPModule = None
    modules = list(model.modules()) if isinstance(model, torch.nn.Module) else []
    if FSDP1 is not None and any(isinstance(m, FSDP1) for m in modules):
        return "fsdp1"
    if FSDPModule is not None and any(isinstance(m, FSDPModule) for m in modules):
        return "fsdp2"
    if any(
        hasattr(p, "ds_id") and getattr(p, "ds_status", None) is not None
        for p in (model.parameters() if modules else ())
    ):
        return "zero3"
    return None


def _inner(model):
    """The module under DDP / FSDP1 / DeepSpeed wrappers (FSDP2 wraps in place)."""
    seen = 0
    while seen < 8:
        nxt = getattr(model, "module", None)
        if nxt is None:
            nxt = getattr(model, "_fsdp_wrapped_module", None)
        if not isinstance(nxt, torch.nn.Module):
            return model
        model, seen = nxt, seen + 1
    return model


def zero3_full_copies(params) -> list:
    """ZeRO-3: a full copy of each partitioned parameter, gathered one at a time (the same
    collectives on every rank). DeepSpeed's gather of several parameters at once launches one
    asynchronous all-gather each and waits on the last only, which orders them on a GPU
    stream but not on gloo, where the copies could read a gather still under way (seen as
    garbage rows on one rank, on the CPU); one parameter takes its synchronous path."""
    import deepspeed

    out = []
    for p in params:
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            out.append(p.detach().clone())
    return out


@contextlib.contextmanager
def _gathered_head(model, inner, sharding):
    """The LM head's full weight (V, d) and bias or None, gathered by the engine, without
    gradient: on FSDP2 its unit's unsharded tensors, held through the replay; on FSDP1 and
    ZeRO-3 a copy out of the gather. The same collectives on every rank."""
    head = inner.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"model: {type(inner).__name__} has no output embeddings (LM head)")
    params = [head.weight] + ([head.bias] if getattr(head, "bias", None) is not None else [])
    if sharding == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

        # the innermost FSDP unit that holds the head; its children stay sharded
        owners = [m for m in FSDP1.fsdp_modules(model) if any(x is head for x in m.modules())]
        owner = min(owners, key=lambda m: sum(1 for _ in m.modules())) if owners else model
        with FSDP1.summon_full_params(owner, recurse=False, writeback=False):
            full = [p.detach().clone() for p in _head_params(head)]
    elif sharding == "zero3":
        full = zero3_full_copies(_head_params(head))
    elif sharding == "fsdp2":
        with _fsdp2_head_unsharded(model, head) as copy_needed:
            full = [
                (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                for p in _head_params(head)
            ]
            if copy_needed:
                full = [
                    t.clone() if not hasattr(p, "full_tensor") else t
                    for t, p in zip(full, _head_params(head))
                ]
            yield full[0], (full[1] if len(full) > 1 else None), copy_needed
        return
    else:
        full = [p.detach() for p in params]
    yield full[0], (full[1] if len(full) > 1 else None), sharding in ("fsdp1", "zero3")


@contextlib.contextmanager
def _fsdp2_head_unsharded(model, head):
    """The FSDP2 unit that holds ``head`` unsharded by FSDP2 (``unshard()``, not recursive)
    and kept so through the replay's forwards (reshard after forward off for that unit
    only, restored after, then resharded if it was so set): the replay holds what the
    engine's own forward holds, that unit and one layer's. Yields whether the head must
    be copied instead (it is not FSDP2's: a DTensor of another kind)."""
    from torch.distributed.fsdp import FSDPModule

    owners = [
        m
        for m in model.modules()
        if isinstance(m, FSDPModule) and any(x is head for x in m.modules())
    ]
    if not owners:
        yield True
        return
    owner = min(owners, key=lambda m: sum(1 for _ in m.modules()))
    state = owner._get_fsdp_state()
    groups = _fsdp2_states(owner)[0][1]
    saved = [g.post_forward_mesh_info for g in groups]
    auto = getattr(state, "_auto_reshard_after_forward", None)
    reshards = any(info is not None for info in saved)
    if reshards:
        owner.set_reshard_after_forward(False, recurse=False)
    try:
        owner.unshard()
        yield False
    finally:
        if reshards:
            for g, info in zip(groups, saved):
                g.post_forward_mesh_info = info
            if auto is not None:
                state._auto_reshard_after_forward = auto
            owner.reshard()


def _head_params(head):
    bias = getattr(head, "bias", None)
    return [head.weight] + ([bias] if bias is not None else [])


class _Head:
    """What ``mrtpo.model.loading.lm_head`` reads: the gathered weight and bias."""

    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias


class _Lockstep:
    """One all-reduce of one int before each decoder forward of the replay: every rank runs
    the same forwards; ``drain`` runs dummy forwards until no rank has one left."""

    def __init__(self, device, group=None):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.on = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.device = device
        self.forwards = 0  # this rank's forwards, real and dummy

    def _any(self, mine: int) -> bool:
        if not self.on:
            return bool(mine)
        flag = torch.tensor([mine], dtype=torch.int64, device=self.device)
        self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def before_forward(self) -> None:
        self._any(1)
        self.forwards += 1

    def drain(self, dummy) -> int:
        n = 0
        while self._any(0):
            dummy()
            self.forwards += 1
            n += 1
        return n


class _Decoder:
    """``decoder(EngineLM)``: the wrapped model's own forward (LM head swapped for the
    identity: its "logits" are the last hidden states), one lockstep all-reduce before
    each call. Its ``forward`` names the key/value cache as the model does."""

    def __init__(self, run, cache_kw, lockstep):
        self._run, self._cache_kw, self._lockstep = run, cache_kw, lockstep
        self.forward = self._forward_cache if cache_kw == "cache" else self._forward_past

    def _forward_cache(
        self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None, cache=None
    ):
        return self._call(input_ids, attention_mask, position_ids, use_cache, cache)

    def _forward_past(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        use_cache=None,
        past_key_values=None,
    ):
        return self._call(input_ids, attention_mask, position_ids, use_cache, past_key_values)

    def __call__(self, **kwargs):
        return self.forward(**kwargs)

    def _call(self, input_ids, attention_mask, position_ids, use_cache, cache):
        self._lockstep.before_forward()
        kw = dict(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache)
        if attention_mask is not None:
            kw["attention_mask"] = attention_mask
        if cache is not None:
            kw[self._cache_kw] = cache
        out = self._run(**kw)
        res = _DecoderOutput(last_hidden_state=out["logits"])
        for key in ("cache", "past_key_values"):
            if key in out.keys():
                res[key] = out[key]
                break
        return res


class _DecoderOutput(dict):
    @property
    def last_hidden_state(self):
        return self["last_hidden_state"]


class EngineLM:
    """A causal LM for ``mrtpo.replay.api.replay_relevance`` on a sharded engine: its decoder is
    the wrapped model's own forward, in lockstep over the ranks, its LM head the gathered
    one (``sharded_replay`` makes it)."""

    base_model_prefix = "model"

    def __init__(self, decoder: _Decoder, weight, bias, config=None):
        self.model = decoder
        self._head = _Head(weight, bias)
        self.config = (
            config  # the model's (its logit scale / softcap: mrtpo.model.loading.logit_transform)
        )

    def get_output_embeddings(self):
        return self._head


def _cache_keyword(inner) -> str:
    params = inspect.signature(inner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _fsdp2_states(model):
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return []
    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                group = getattr(state, "_fsdp_param_group", None)
                groups = [] if group is None else [group]
            out.append((state, list(groups)))
    return out


@contextlib.contextmanager
def _fsdp2_forward_order_kept(model):
    """FSDP2 records each unit's forwards (also without gradient) for the backward's
    prefetch; the replay's are struck out after it, so the backward prefetches as if the
    replay had not run (and the same on every rank)."""
    saved_order, saved_groups = {}, []
    for state, groups in _fsdp2_states(model):
        ctx = getattr(state, "_comm_ctx", None)
        if ctx is not None:  # before FSDP2's lazy init the order does not exist yet: empty
            saved_order[id(ctx)] = (ctx, len(getattr(ctx, "post_forward_order", None) or ()))
        for g in groups:
            indices = getattr(g, "_post_forward_indices", None)
            if isinstance(indices, list):
                saved_groups.append((indices, len(indices)))
    try:
        yield
    finally:
        for ctx, n in saved_order.values():
            order = getattr(ctx, "post_forward_order", None)
            if isinstance(order, list):
                del order[n:]
        for indices, n in saved_groups:
            del indices[n:]


@contextlib.contextmanager
def sharded_replay(model, *, device=None, group=None):
    """Yields an ``EngineLM`` for the replay of this rank's rows on the wrapped ``model``
    (FSDP1, FSDP2 or a ZeRO-3 DeepSpeed engine), or None where the parameters are
    replicated (run the replay on the unwrapped module there). Every rank must enter,
    whether it replays or not; on a normal exit every rank runs dummy forwards until all
    have run as many decoder forwards. The model's train/eval mode is the caller's."""
    sharding = engine_sharding(model)
    if sharding is None:
        yield None
        return
    inner = _inner(model)
    head = inner.get_output_embeddings()
    cache_kw = _cache_keyword(inner)
    keep = "logits_to_keep" in inspect.signature(inner.forward).parameters
    if device is None:
        device = next(inner.parameters()).device
    lockstep = _Lockstep(device, group)

    def run(**kw):
        if keep:
            kw["logits_to_keep"] = 0  # every position's hidden state
        return model(**kw)

    def dummy():
        ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        run(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False)

    with contextlib.ExitStack() as stack:
        if sharding == "fsdp2":
            stack.enter_context(_fsdp2_forward_order_kept(model))
            states = _fsdp2_states(model)
            if states and getattr(states[0][0], "_is_root", True) is None:
                dummy()  # FSDP2's lazy init (which unit is the root) runs in a forward
        weight, bias, copied = stack.enter_context(_gathered_head(model, inner, sharding))
        inner.set_output_embeddings(torch.nn.Identity())
        stack.callback(inner.set_output_embeddings, head)
        lm = EngineLM(
            _Decoder(run, cache_kw, lockstep), weight, bias, getattr(inner, "config", None)
        )
        lm.config = getattr(inner, "config", None)  # its logit scale / softcap for the replay
        lm.sharding = sharding
        lm.lockstep = lockstep
        # bytes of the head held beside the engine's own parameters (a gathered copy)
        lm.head_copy_bytes = (
            sum(t.numel() * t.element_size() for t in (weight, bias) if t is not None)
            if copied
            else 0
        )
        yield lm
        lm.dummy_forwards = lockstep.drain(dummy)
