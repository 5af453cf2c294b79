"""A run folder that survives a kill at any instant: the checkpoint and the metrics history.

Layout of ``out/``: ``config.json``, ``metrics.jsonl`` (one JSON row per step),
``checkpoint/`` (``model/``, ``state.pt``, and ``meta.json`` written last: step, metrics rows
covered, config). A save writes ``checkpoint.tmp/``, fsyncs every file and folder, writes
``meta.json`` (the commit mark), then renames ``checkpoint`` to ``checkpoint.old``,
``checkpoint.tmp`` to ``checkpoint`` and removes ``checkpoint.old`` (its mark first), with
the parent folder fsynced after each rename. `RunDir.recover` repairs every state a kill can
leave: a ``checkpoint`` wins; without one, a marked ``.tmp`` is the newest complete state,
then a marked ``.old``; everything else is debris.

The metrics history is never cut before the state that replaces it is durable: rows are
appended and fsynced before each save, the checkpoint records how many rows it covers, and
a resume cuts the file to that count only after the checkpoint has loaded (rows past it,
including a torn last line, belong to steps that will run again).

Tests inject kills with ``MRTPO_TEST_KILL_AT=POINT`` or ``POINT:STEP`` (one of
`KILL_POINTS`): the process sends itself SIGKILL there.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import torch

KILL_ENV = "MRTPO_TEST_KILL_AT"
KILL_POINTS = (
    "metrics_torn",  # half of a metrics row written
    "before_save",  # the step's metrics row written, no save started
    "tmp_model",  # checkpoint.tmp/model written
    "tmp_state",  # checkpoint.tmp/state.pt written, not yet marked complete
    "tmp_complete",  # checkpoint.tmp marked complete and fsynced
    "old_renamed",  # checkpoint -> checkpoint.old
    "new_renamed",  # checkpoint.tmp -> checkpoint, checkpoint.old still there
    "old_partly_removed",  # checkpoint.old's mark and some files removed
    "saved",  # save finished
)
META = "meta.json"
FORMAT = 1


def kill_point(name: str, step: int) -> None:
    """SIGKILL this process if ``MRTPO_TEST_KILL_AT`` names this point (and step)."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    point, _, at = spec.partition(":")
    if point == name and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_file(Path(dirpath) / name)
        _fsync_dir(Path(dirpath))


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a kill leaves the old or the new file whole."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# --------------------------------------------------------------------------------------------
# Random state (only types that torch.load(weights_only=True) accepts)


def rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------------------------
# The run folder


class RunDir:
    """``out/`` of one training run: its checkpoint and metrics history."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.checkpoint = self.out / "checkpoint"
        self.tmp = self.out / "checkpoint.tmp"
        self.old = self.out / "checkpoint.old"
        self.metrics_path = self.out / "metrics.jsonl"
        self.config_path = self.out / "config.json"
        self._metrics_file = None

    # -- start-up -----------------------------------------------------------------------------
    def create(self) -> None:
        """Create ``out`` and prove it writable (ValueError naming ``out`` otherwise)."""
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            probe = self.out / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise ValueError(f"out: cannot write to {str(self.out)!r}: {err.strerror}") from None

    def holds_run(self) -> bool:
        return any(
            p.exists()
            for p in (self.metrics_path, self.config_path, self.checkpoint, self.tmp, self.old)
        )

    def clear(self) -> None:
        """Remove a previous run's files (``--overwrite``)."""
        for p in (self.checkpoint, self.tmp, self.old):
            if p.exists():
                shutil.rmtree(p)
        for name in ("metrics.jsonl", "config.json", "curves.png", "tokens.html"):
            (self.out / name).unlink(missing_ok=True)
        _fsync_dir(self.out)

    def recover(self) -> None:
        """Bring the folder back to one committed checkpoint (or none) after a kill."""
        if self.checkpoint.exists():
            self._remove(self.tmp)
            self._remove(self.old)
        elif (self.tmp / META).exists():
            os.replace(self.tmp, self.checkpoint)
            _fsync_dir(self.out)
            self._remove(self.old)
        elif (self.old / META).exists():
            os.replace(self.old, self.checkpoint)
            _fsync_dir(self.out)
            self._remove(self.tmp)
        else:
            self._remove(self.tmp)
            self._remove(self.old)

    def meta(self) -> dict | None:
        """The committed checkpoint's step, metrics rows and config, or None."""
        path = self.checkpoint / META
        if not path.exists():
            return None
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"checkpoint: {path} is unreadable ({err})") from None
        if meta.get("format") != FORMAT:
            raise ValueError(f"checkpoint: {path} has format {meta.get('format')}, not {FORMAT}")
        return meta

    def saved_config(self) -> dict | None:
        """The config of the run in the folder: the checkpoint's, else config.json's."""
        meta = self.meta()
        if meta is not None:
            return meta["config"]
        if self.config_path.exists():
            try:
                return json.loads(self.config_path.read_text())
            except ValueError as err:
                raise ValueError(f"out: {self.config_path} is unreadable ({err})") from None
        return None

    # -- checkpoints --------------------------------------------------------------------------
    def save(self, *, step: int, save_model, state: dict, config: dict) -> None:
        """Commit a checkpoint of ``step`` covering the first ``step`` metrics rows."""
        kill_point("before_save", step)
        self.sync_metrics()
        self._remove(self.tmp)
        self.tmp.mkdir()
        save_model(self.tmp / "model")
        kill_point("tmp_model", step)
        torch.save(state, self.tmp / "state.pt")
        kill_point("tmp_state", step)
        _fsync_tree(self.tmp)
        meta = {"format": FORMAT, "step": step, "metrics_rows": step, "config": config}
        with open(self.tmp / META, "w") as f:
            f.write(json.dumps(meta, indent=1))
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.tmp)
        _fsync_dir(self.out)
        kill_point("tmp_complete", step)
        if self.checkpoint.exists():
            os.replace(self.checkpoint, self.old)
            _fsync_dir(self.out)
            kill_point("old_renamed", step)
        os.replace(self.tmp, self.checkpoint)
        _fsync_dir(self.out)
        kill_point("new_renamed", step)
        self._remove(self.old, kill_step=step)
        kill_point("saved", step)

    def _remove(self, path: Path, *, kill_step: int | None = None) -> None:
        """Remove a checkpoint folder, its commit mark first, so that a partly removed
        folder is never taken for a complete one."""
        if not path.exists():
            return
        (path / META).unlink(missing_ok=True)
        _fsync_dir(path)
        if kill_step is not None:
            (path / "state.pt").unlink(missing_ok=True)
            kill_point("old_partly_removed", kill_step)
        shutil.rmtree(path)
        _fsync_dir(self.out)

    def load_state(self) -> dict:
        path = self.checkpoint / "state.pt"
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ValueError(f"checkpoint: cannot load {path} ({err})") from None

    # -- metrics history ----------------------------------------------------------------------
    def start_metrics(self, rows: int) -> list[dict]:
        """Keep the first ``rows`` rows of metrics.jsonl (the ones the loaded checkpoint
        covers), cut the rest (later steps, a torn last line) and open it for appending."""
        kept: list[dict] = []
        end = 0
        if rows > 0:
            data = self.metrics_path.read_bytes() if self.metrics_path.exists() else b""
            for i in range(rows):
                nl = data.find(b"\n", end)
                if nl < 0:
                    raise ValueError(
                        f"metrics: {self.metrics_path} holds {i} complete rows but the "
                        f"checkpoint covers {rows}; the history before the checkpoint is lost"
                    )
                try:
                    kept.append(json.loads(data[end:nl]))
                except ValueError as err:
                    raise ValueError(
                        f"metrics: {self.metrics_path} line {i + 1} is not valid JSON ({err})"
                    ) from None
                end = nl + 1
        with open(self.metrics_path, "ab") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.out)
        self._metrics_file = open(self.metrics_path, "a")
        return kept

    def append_metrics(self, row: dict) -> None:
        line = json.dumps(row) + "\n"
        f = self._metrics_file
        if os.environ.get(KILL_ENV, "").startswith("metrics_torn"):
            f.write(line[: len(line) // 2])
            f.flush()
            kill_point("metrics_torn", int(row["step"]))
            f.write(line[len(line) // 2 :])
        else:
            f.write(line)
        f.flush()

    def sync_metrics(self) -> None:
        if self._metrics_file is not None:
            self._metrics_file.flush()
            os.fsync(self._metrics_file.fileno())

    def close(self) -> None:
        if self._metrics_file is not None:
            self.sync_metrics()
            self._metrics_file.close()
            self._metrics_file = None
