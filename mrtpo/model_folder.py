"""A saved Hugging Face causal LM's folder: writing one (``save_model``; ``publish_folder``
swaps a finished one into place) and checking that one holds a model the trainer can load,
before any model is built: one line naming what is wrong (an empty folder, an invalid
``config.json``, missing or truncated weights or shards, a tokenizer that does not load or
has neither a pad nor an end-of-sequence token). Used for ``--model`` and for a checkpoint's
``model/``. Imports nothing of the project (a leaf shared by ``mrtpo.model`` and
``mrtpo.pretrained``)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
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
    JSON ``marker`` file, and swap it into place (a kill leaves no finished-looking half).
    Call it under ``build_lock(folder)`` where another process may build the same folder."""
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    save(tmp)
    (tmp / marker).write_text(json.dumps(info, indent=1))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


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
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"),
                  default=0)  # fmt: skip
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
