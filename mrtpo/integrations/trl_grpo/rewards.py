"""TRL reward functions that name prompt spans: ``_SpanCapture`` (a user's reward function
that returns ``(score, spans)`` or a ``Verdict``, seen by TRL as one returning scores) and
``verifier_reward`` (a built-in verifier as a TRL reward function), with ``example_row`` (the
dataset row it reads).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping, Sequence, Set

import torch
from trl.trainer.utils import is_async_callable

from mrtpo.replay.spans import _is_array, score_and_spans
from mrtpo.verifiers import Example
from mrtpo.verifiers.base import check_fields

__all__ = ["EXAMPLE_COLUMNS", "example_row", "verifier_reward"]

# --------------------------------------------------------------------------- reward spans


class _SpanCapture:
    """A reward function that may return per sample a score, ``(score, spans)`` or an object
    with ``score`` and ``spans`` (a ``Verdict``), seen by TRL as one returning scores; the
    spans of its last call are kept in ``store[k]``.

    Its outputs may come as TRL takes them: a list, a tuple, a 1-D numpy array or tensor, or
    any other ordered sequence or iterator, with None for a missing score; anything else is
    a ValueError naming the reward function (and the sample). The user's object stays
    reachable: ``__wrapped__`` is it, ``__name__`` its name (TRL's, of a partial's function
    or of a callable's class), and any other attribute is read from it and written to it."""

    _OWN = frozenset({"fn", "k", "store", "__wrapped__", "__name__", "__qualname__", "__doc__"})

    def __init__(self, fn, k: int, store: dict):
        own = functools.partial(object.__setattr__, self)
        own("fn", fn)
        own("k", k)
        own("store", store)
        own("__wrapped__", fn)
        inner = fn
        while isinstance(inner, functools.partial):
            inner = inner.func
        own("__name__", getattr(inner, "__name__", type(inner).__name__))
        own("__qualname__", getattr(inner, "__qualname__", self.__name__))
        own("__doc__", getattr(inner, "__doc__", None))

    def __getattr__(self, name):  # only for names the wrapper itself lacks
        fn = self.__dict__.get("fn")
        if fn is None or (name.startswith("__") and name.endswith("__")):
            # special names stay the wrapper's own (copy, pickle: never the user's object)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(fn, name)

    def __setattr__(self, name, value):
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.fn, name, value)

    def __delattr__(self, name):
        if name in self._OWN:
            object.__delattr__(self, name)
        else:
            delattr(self.fn, name)

    def __repr__(self):
        return f"<MRTPO span capture of {self.fn!r}>"

    def _outputs(self, out) -> list:
        """One output per sample, as a list, from whatever TRL would take."""
        where = f"reward function {self.__name__!r}"
        if _is_array(out):
            if len(out.shape) != 1:
                raise ValueError(
                    f"{where}: expected a list with one output per sample, or a 1-D array; "
                    f"got {type(out).__name__} of shape {tuple(out.shape)}"
                )
            if hasattr(out, "detach"):
                out = out.detach().cpu()
            return out.tolist()
        if isinstance(out, (str, bytes, Mapping, Set)) or not isinstance(out, (Sequence, Iterator)):
            raise ValueError(
                f"{where}: expected a list with one output per sample (or a tuple, a 1-D "
                f"numpy array or tensor; None entries for missing scores), got "
                f"{type(out).__name__}"
            )
        return list(out)

    def _split(self, out):
        outs = self._outputs(out)
        pairs = [
            score_and_spans(v, where=f"reward function {self.__name__!r}, sample {i}")
            for i, v in enumerate(outs)
        ]
        self.store[self.k] = [sp for _, sp in pairs]
        return [None if sc is None else float(sc) for sc, _ in pairs]

    def __call__(self, *args, **kwargs):
        return self._split(self.fn(*args, **kwargs))


class _AsyncSpanCapture(_SpanCapture):
    async def __call__(self, *args, **kwargs):
        return self._split(await self.fn(*args, **kwargs))


def _wrap_reward_funcs(reward_funcs, store: dict):
    """TRL's ``reward_funcs`` (one or a list) with every plain callable span-capturing."""
    single = not isinstance(reward_funcs, (list, tuple))
    funcs = [reward_funcs] if single else list(reward_funcs)
    out = []
    for k, fn in enumerate(funcs):
        if isinstance(fn, (str, torch.nn.Module)) or not callable(fn):
            out.append(fn)  # a reward model: scores only
        else:
            cls = _AsyncSpanCapture if is_async_callable(fn) else _SpanCapture
            out.append(cls(fn, k, store))
    return out[0] if single else out


# --------------------------------------------------------------------------- verifiers

EXAMPLE_COLUMNS = ("prompt", "example_id", "fields", "reference")


def verifier_reward(verifier, *, spans: bool = True):
    """A TRL reward function from a built-in verifier (``mrtpo.verifiers``: the SQL,
    constraint, tool-call and BFCL verifiers of ``mrtpo.tasks.builtin.load_task(name).verifiers``,
    or any ``Verifier``: ``verifier(example, response) -> Verdict``).

    Each dataset row is the task's ``Example``: the ``prompt`` column is the example's
    prompt text, or a chat prompt whose last user message is that text; ``fields`` is
    the example's fields as a JSON string (or a dict); ``example_id`` and ``reference``
    are optional. ``example_row(example)`` builds such a row. The function returns per
    completion ``(score, spans)``: the verdict's score and the prompt spans the verifier
    checked, which ``MRTPOGRPOTrainer`` replays (offsets into the prompt text, i.e. its
    last user message on a chat prompt). With ``spans=False`` it returns the scores alone
    (for TRL's own ``GRPOTrainer``). Its ``__name__`` is the verifier's name (TRL logs
    ``rewards/<name>/mean``, MRTPO ``mrtpo/relevance/<name>``).

    A row whose ``fields`` lacks what the verifier reads (its ``fields_needed``: the
    built-in verifiers declare theirs), the column absent included, or holds it in another
    form is a ValueError naming the column, the key and the row: such a verifier would judge
    nothing real (pay 1 to any completion, or 0 to the gold answer). A completion's content
    given as a list of message parts is read as its text parts joined.
    """
    name = getattr(verifier, "name", None)
    if not callable(verifier) or not isinstance(name, str) or not name:
        raise ValueError(
            f"verifier: expected a verifier (a callable with a name, as in "
            f"mrtpo.tasks.builtin.load_task(...).verifiers), got {type(verifier).__name__}"
        )

    def reward(prompts, completions, fields=None, example_id=None, reference=None, **_):
        n = len(completions)
        for col, values in (
            ("fields", fields),
            ("example_id", example_id),
            ("reference", reference),
        ):
            if values is not None and len(values) != n:
                raise ValueError(
                    f"{col}: expected {n} values (one per completion), got {len(values)}"
                )
        out = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            text = _prompt_text(prompt, i)
            row = _fields_of(None if fields is None else fields[i], i)
            where = (
                f"fields: row {i}"
                if fields is not None
                else f"fields: row {i} (the dataset has no 'fields' column)"
            )
            check_fields(verifier, row, where=where)
            example = Example(
                id=str(example_id[i]) if example_id is not None else str(i),
                prompt=text,
                fields=row,
                reference=None if reference is None else reference[i],
            )
            verdict = verifier(example, _completion_text(completion, i))
            out.append(
                (float(verdict.score), list(verdict.spans)) if spans else float(verdict.score)
            )
        return out

    reward.__name__ = name
    reward.__qualname__ = name
    reward.verifier = verifier
    return reward


def example_row(example) -> dict:
    """The dataset row ``verifier_reward`` reads for a task's ``Example``: ``prompt`` (the
    prompt as one user message), ``example_id``, ``fields`` (JSON) and ``reference``."""
    return {
        "prompt": [{"role": "user", "content": example.prompt}],
        "example_id": example.id,
        "fields": json.dumps(example.fields),
        "reference": example.reference or "",
    }


def _prompt_text(prompt, i: int) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        for message in reversed(prompt):
            if isinstance(message, dict) and message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, str):
                    return content
    raise ValueError(
        f"prompt: sample {i} is neither a string nor a chat prompt with a user message of "
        "text content (a verifier's spans are offsets into that text)"
    )


def _completion_text(completion, i: int = 0) -> str:
    """A completion's text: a string, or the content of the last message of a chat message
    list; a content given as message parts (``[{"type": "text", "text": ...}, ...]`` or
    strings) is its text parts joined; a part of another type is an error naming the
    sample."""
    if isinstance(completion, str):
        return completion
    if not (
        isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict)
    ):
        raise ValueError(
            f"completions: sample {i}: expected a string or a chat message "
            f"list, got {type(completion).__name__}"
        )
    content = completion[-1].get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, (list, tuple)):
        raise ValueError(
            f"completions: sample {i}: the message content is "
            f"{type(content).__name__}, expected a string or a list of "
            "message parts"
        )
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif (
            isinstance(part, dict)
            and part.get("type", "text") == "text"
            and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(
                f"completions: sample {i}: content part {j} is {kind!r}, not text (a "
                "verifier judges the completion's text: give text parts)"
            )
    return "".join(texts)


def _fields_of(value, i: int) -> dict:
    if value is None:
        return {}
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise ValueError(f"fields: sample {i} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"fields: sample {i}: expected a dict (or its JSON), got {type(value).__name__}"
        )
    return value
