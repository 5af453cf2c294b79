"""A saved Hugging Face causal LM's folder: writing one (``save_model``; ``publish_folder``
swaps a finished, flushed one into place; ``build_once`` builds a cached one once, under a
lock, and again where ``published_problem`` finds it broken) and checking that one holds a
model the trainer can load, before any model is built: one line naming what is wrong (an
empty folder, an invalid ``config.json``, missing or truncated weights or shards, a tokenizer
that does not load or has neither a pad nor an end-of-sequence token). Used for ``--model``
and for a checkpoint's ``model/``. Imports nothing of the project (a leaf shared by
``mrtpo.model.loading`` and ``mrtpo.model.pretrained``)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import warnings
from pathlib import Path

_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def quiet_transformers() -> None:
    """No transformers progress bars (loads and saves of whole folders)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def save_model(model, tokenizer, path: str | Path) -> Path:
    quiet_transformers()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@contextlib.contextmanager
def build_lock(folder: Path):
    """Hold an exclusive lock on ``folder``'s build (a ``<folder>.lock`` file beside it) for
    the ``with`` body: two processes that want the same cached folder build it once, the
    second waiting and then finding it done (check again inside the body)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def publish_folder(folder: Path, save, marker: str, info: dict) -> None:
    """Write a folder through ``save(tmp)`` into ``folder.tmp``, mark it complete with the
    JSON ``marker`` file (``info`` and, under ``"files"``, every file's size, which
    ``published_problem`` checks), flush it all to disk and swap it into place (a kill or a
    crash leaves no finished-looking half; a folder already there is moved aside first, so
    that the swap leaves no moment without a whole folder but the two renames' own).
    Call it under ``build_lock(folder)`` where another process may build the same folder."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    save(tmp)
    files = {
        p.relative_to(tmp).as_posix(): p.stat().st_size
        for p in sorted(tmp.rglob("*"))
        if p.is_file() and p != tmp / marker
    }
    (tmp / marker).write_text(json.dumps({**info, "files": files}, indent=1))
    _fsync_tree(tmp)  # the data on disk before the rename makes it look finished
    old = folder.with_name(folder.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    _fsync_dir(folder.parent)  # the rename itself
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` and every folder (their entries) to disk."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


def published_problem(folder, marker: str, accept=None) -> str | None:
    """None if ``folder`` holds a whole folder that ``publish_folder`` published with
    ``marker``, else what is wrong: no folder, no marker (an unfinished or foreign folder), a
    marker that is not JSON or that ``accept(info)`` refuses (``accept`` returns why, or
    None), a file missing or of another size than when it was written, safetensors weights
    cut short. Markers written before sizes were recorded (no ``"files"``) are checked for
    whole weights only. Reads the marker and the weights' headers, nothing more."""
    folder = Path(folder)
    mark = folder / marker
    if not folder.is_dir():
        return "not built yet" if not folder.exists() else "not a folder"
    if not mark.is_file():
        return f"it has no {marker} (an unfinished build)"
    try:
        info = json.loads(mark.read_text())
    except (OSError, ValueError) as err:
        return f"its {marker} is not valid JSON ({type(err).__name__})"
    if not isinstance(info, dict):
        return f"its {marker} is not a JSON object"
    why = accept(info) if accept is not None else None
    if why:
        return why
    files = info.get("files")
    if isinstance(files, dict):
        for rel, size in files.items():
            try:
                now = (folder / rel).stat().st_size
            except OSError:
                return f"{rel} is missing"
            if now != size:
                return f"{rel} has {now} bytes, {size} when it was written"
    for weights in sorted(folder.glob("*.safetensors")):
        why = _safetensors_problem(weights)
        if why:
            return why
    return None


def build_once(folder, marker: str, build, *, accept=None, log=None) -> Path:
    """The cached folder ``folder``, built where it is not whole (``published_problem``):
    ``build()`` does the work and returns ``(save, info)`` for ``publish_folder``. Under
    ``build_lock``: two processes that want the same folder build it once, and none sees it
    half-written. A folder that is there but broken (a file cut short, weights truncated, a
    marker ``accept`` refuses) is rebuilt, and ``log`` (else a warning) names it and why."""
    folder = Path(folder)
    if published_problem(folder, marker, accept) is None:
        return folder
    with build_lock(folder):
        problem = published_problem(folder, marker, accept)
        if problem is None:  # built by another process while this one waited
            return folder
        if folder.exists():
            msg = f"cache: rebuilding {str(folder)!r}: {problem}"
            if log is not None:
                log(msg)
            else:
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
        save, info = build()
        publish_folder(folder, save, marker, info)
        problem = published_problem(folder, marker, accept)
    if problem is not None:
        raise RuntimeError(f"cache: {str(folder)!r} was just built, but {problem}")
    return folder


def _safetensors_problem(path: Path) -> str | None:
    """None if ``path`` starts like a whole safetensors file (header length, JSON header,
    data as long as the header says), else what is wrong."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n <= 0 or n > 100_000_000:
                return f"{path.name} is not a safetensors file"
            header = json.loads(f.read(n))
        end = max(
            (int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0
        )
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
        return f"{path.name} is not a readable safetensors file ({type(err).__name__})"
    if path.stat().st_size < 8 + n + end:
        size = path.stat().st_size
        return f"{path.name} is truncated ({size} bytes, its header needs {8 + n + end})"
    return None


def check_model_folder(path) -> str | None:
    """None if ``path`` looks like a saved Hugging Face causal LM that the trainer can load
    (a folder with a JSON config.json naming its model_type, whole weights, a tokenizer
    with a pad or an end-of-sequence token), else one line saying what is wrong. Reads
    small files and loads the tokenizer; builds no model."""
    p = Path(path)
    where = repr(str(path))
    if not p.is_dir():
        return f"{where} is not a folder with a saved Hugging Face causal LM"
    if not (p / "config.json").is_file():
        what = "is empty" if not any(p.iterdir()) else "has no config.json"
        return (
            f"{where} {what}: expected a saved Hugging Face causal LM (config.json, weights, "
            "tokenizer)"
        )
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as err:
        return f"{where}: config.json is not valid JSON ({err})"
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        return f"{where}: config.json names no model_type (not a Hugging Face model config)"
    shards = []
    for weights in _WEIGHTS:
        index = p / (weights + ".index.json")
        if (p / weights).is_file():
            shards = [p / weights]
        elif index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                return f"{where}: {index.name} is not a valid weight index ({err})"
            missing = [n for n in names if not (p / n).is_file()]
            if not names:
                return f"{where}: {index.name} names no weight files"
            if missing:
                return f"{where}: {index.name} names {missing[0]}, which is missing"
            shards = [p / n for n in names]
        if shards:
            break
    if not shards:
        return f"{where} has no weights ({' or '.join(_WEIGHTS)}, or a sharded index of them)"
    for shard in shards:
        if shard.suffix == ".safetensors":
            msg = _safetensors_problem(shard)
            if msg:
                return f"{where}: {msg}"
        else:
            with open(shard, "rb") as f:
                magic = f.read(4)
            if magic[:2] != b"PK" and magic[:1] != b"\x80":  # torch's zip, or a bare pickle
                what = "is empty" if not magic else "is not a PyTorch weight file"
                return f"{where}: {shard.name} {what}"
    if not any((p / name).is_file() for name in _TOKENIZER_FILES):
        return f"{where} has no tokenizer ({', '.join(_TOKENIZER_FILES)})"
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            json.loads((p / name).read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as err:
            return f"{where}: {name} is not valid JSON ({err})"
    # the special tokens may come from the tokenizer class's defaults: ask the tokenizer
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(p)
    except Exception as err:  # noqa: BLE001 -- tokenizers raises bare Exceptions on bad files
        why = " ".join(str(err).split())[:200] or type(err).__name__
        return f"{where}: its tokenizer does not load ({why})"
    finally:
        hf_logging.set_verbosity(verbosity)
    if tok.pad_token_id is None and tok.eos_token_id is None:
        return (
            f"{where}: its tokenizer has neither a pad nor an eos token; the trainer pads with "
            "the pad token, else the eos token"
        )
    return None
