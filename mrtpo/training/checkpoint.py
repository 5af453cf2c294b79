"""A run folder that survives a kill at any instant: the checkpoint and the metrics history.

Layout of ``out/``: ``config.json``, ``metrics.jsonl`` (one JSON row per step),
``checkpoint/`` (``model/``, ``state.pt``, and ``meta.json`` written last: step, metrics rows
covered, config). A save writes ``checkpoint.tmp/``, fsyncs every file and folder, writes
``meta.json`` (the commit mark), then renames ``checkpoint`` to ``checkpoint.old``,
``checkpoint.tmp`` to ``checkpoint`` and removes ``checkpoint.old`` (its mark first), with
the parent folder fsynced after each rename. `RunDir.recover` repairs every state a kill can
leave and says what it found: of the folders with a readable mark, the one of the highest
step is the checkpoint (a marked ``.tmp`` newer than ``checkpoint`` is a save that was
killed after its commit: it is finished); unmarked folders are debris. A ``checkpoint``
without its mark is never made by a save: it is removed only when a complete state stands
beside it, else the resume is refused (nothing is cut).

Ownership: ``mrtpo-run.json`` marks a folder the trainer made; only such a folder (or one of
an older trainer, recognized by its ``config.json``) is resumed or overwritten, and a folder
that holds a file of a run's names without the mark is refused. ``mrtpo-run.lock`` is held
with ``flock`` for the whole run: one writer per folder.

The metrics history is never cut before the state that replaces it is durable: rows are
appended and fsynced before each save, the checkpoint records how many rows it covers, and
a resume cuts the file to that count only after the checkpoint has loaded (rows past it,
including a torn last line, belong to steps that will run again).

Tests inject kills with ``MRTPO_TEST_KILL_AT=POINT`` or ``POINT:STEP`` (one of
`KILL_POINTS`): the process sends itself SIGKILL there.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import torch

from mrtpo.model.folder import _fsync_dir, _fsync_tree  # one implementation for every publish

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
MARK = "mrtpo-run.json"  # the trainer made this folder
LOCK = "mrtpo-run.lock"  # flock-ed by the one process writing the folder
# the names a run writes in out/ (a folder holding any of them without MARK is not the trainer's)
RUN_FILES = (
    "config.json",
    "metrics.jsonl",
    "curves.png",
    "tokens.html",
    "checkpoint",
    "checkpoint.tmp",
    "checkpoint.old",
)
# the keys of a config.json an older trainer (before MARK) wrote
_RUN_CONFIG_KEYS = {"task", "algo", "seed", "steps", "prompts_per_step", "group_size"}


def kill_point(name: str, step: int) -> None:
    """SIGKILL this process if ``MRTPO_TEST_KILL_AT`` names this point (and step)."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    point, _, at = spec.partition(":")
    if point == name and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)


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
        self._lock_fd = None

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

    def _run_files(self) -> list[str]:
        return [name for name in RUN_FILES if (self.out / name).exists()]

    def _made_by_older_trainer(self) -> bool:
        try:
            saved = json.loads(self.config_path.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(saved, dict) and _RUN_CONFIG_KEYS <= saved.keys()

    def holds_run(self) -> bool:
        """True if ``out`` holds files of a run of the trainer (a folder with its mark, or an
        older trainer's config.json); a ValueError if it holds files of a run's names
        without being such a folder."""
        present = self._run_files()
        if not present:
            return False
        if (self.out / MARK).is_file() or self._made_by_older_trainer():
            return True
        raise ValueError(
            f"out: {str(self.out)!r} holds {', '.join(present)} but is not a folder the trainer "
            f"made (no {MARK}); it is neither resumed nor overwritten: choose another --out"
        )

    def mark(self) -> None:
        """Mark ``out`` as the trainer's (before any other file of the run is written)."""
        path = self.out / MARK
        if not path.is_file():
            write_atomic(path, json.dumps({"format": FORMAT, "made_by": "mrtpo train"}) + "\n")

    def lock(self) -> None:
        """Take the folder's lock for this process (held until `unlock` or exit), or a
        ValueError naming the process that holds it."""
        if self._lock_fd is not None:
            return
        path = self.out / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            who = f"process {holder}" if holder.isdigit() else "another process"
            raise ValueError(
                f"out: {str(self.out)!r} is in use: {who} holds its lock {LOCK} (one trainer "
                "per folder); wait for it to end or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def prepare(self, *, resume: bool, overwrite: bool, check_config=None, log=None):
        """Make ``out`` ready for a run and lock it: refuse a folder the trainer did not make
        and a run without ``resume`` or ``overwrite``; clear it (``overwrite``) or recover it
        (``resume``, each finding logged). Returns the committed checkpoint's meta when
        resuming from one, else None. ``check_config(saved)`` may refuse the saved config."""
        log = log or (lambda msg: None)
        self.create()
        self.holds_run()  # refuses a foreign folder before the lock file is written there
        self.lock()
        try:
            ours = self.holds_run()  # again, under the lock (a run that left no file: False)
            if not resume:
                if ours and not overwrite:
                    raise ValueError(
                        f"out: {str(self.out)!r} already holds a run; pass --resume to continue "
                        "it or --overwrite to replace it"
                    )
                if ours:
                    self.clear()
                self.mark()
                return None
            if not ours:
                log(f"resume: no run in {self.out}, starting from step 0")
                self.mark()
                return None
            saved = self.saved_config()
            if saved is not None and check_config is not None:
                check_config(saved)
            for note in self.recover():
                log(f"resume: {note}")
            self.mark()
            meta = self.meta()
            rows = self.metrics_rows()
            step = 0 if meta is None else int(meta["step"])
            if meta is None:
                log(f"resume: no complete checkpoint in {self.out}, starting from step 0")
            else:
                covers = meta.get("metrics_rows", step)
                log(f"resume: checkpoint/ of step {step}, covering {covers} metrics rows")
            if rows > step:
                log(f"resume: metrics.jsonl's {rows - step} rows past step {step} run again")
            return meta
        except BaseException:
            self.unlock()
            raise

    def metrics_rows(self) -> int:
        """Complete lines of metrics.jsonl."""
        try:
            return self.metrics_path.read_bytes().count(b"\n")
        except OSError:
            return 0

    def clear(self) -> None:
        """Remove a previous run's files (``--overwrite``)."""
        for p in (self.checkpoint, self.tmp, self.old):
            if p.exists():
                shutil.rmtree(p)
        for name in ("metrics.jsonl", "config.json", "curves.png", "tokens.html"):
            (self.out / name).unlink(missing_ok=True)
        _fsync_dir(self.out)

    def _mark_step(self, path: Path) -> int | None:
        """The step in ``path``'s commit mark, or None if it has no readable one."""
        try:
            meta = json.loads((path / META).read_text())
        except (OSError, ValueError):
            return None
        ok = isinstance(meta, dict) and meta.get("format") == FORMAT
        step = meta.get("step") if ok else None
        return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None

    def recover(self) -> list[str]:
        """Bring the folder back to one committed checkpoint (or none) after a kill: the
        marked folder of the highest step wins (ties: checkpoint, .tmp, .old), unmarked ones
        are removed. Returns what it found and did, one line each. A ``checkpoint`` without
        its mark and nothing complete beside it is refused (a ValueError), not discarded."""
        found = {p: self._mark_step(p) for p in (self.checkpoint, self.tmp, self.old) if p.exists()}
        if not found:
            return []
        complete = {p: s for p, s in found.items() if s is not None}
        order = (self.checkpoint, self.tmp, self.old)
        if self.checkpoint in found and not (self.checkpoint / META).exists() and not complete:
            rows = self.metrics_rows()
            raise ValueError(
                f"checkpoint: {self.checkpoint} has no {META} (its completion mark) and no "
                "complete checkpoint is beside it; resuming would start again at step 0 and "
                f"cut metrics.jsonl ({rows} rows): nothing was changed; remove that folder to "
                "start again, or choose another --out"
            )
        if self.checkpoint in found and (self.checkpoint / META).exists() and not complete:
            return []  # an unreadable mark: meta() names it
        notes = []
        best = max(complete, key=lambda p: (complete[p], -order.index(p))) if complete else None
        name = lambda p: p.name + "/"  # noqa: E731
        for p in order:
            if p not in found or p == best:
                continue
            if found[p] is None:
                why = "no completion mark" if not (p / META).exists() else "an unreadable mark"
                what = "a save that did not finish" if p == self.tmp else "incomplete"
                notes.append(f"removed {name(p)} ({why}: {what})")
            else:
                notes.append(f"removed {name(p)} (step {found[p]}), superseded by {name(best)}")
            self._remove(p)
        if best is not None and best != self.checkpoint:
            os.replace(best, self.checkpoint)
            _fsync_dir(self.out)
            notes.append(f"took {name(best)} (complete, step {complete[best]}) as checkpoint/")
        return notes

    def meta(self) -> dict | None:
        """The committed checkpoint's step, metrics rows and config, or None."""
        path = self.checkpoint / META
        if not path.exists():
            return None
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"checkpoint: {path} is unreadable ({err})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            got = meta.get("format") if isinstance(meta, dict) else meta
            raise ValueError(f"checkpoint: {path} has format {got!r}, not {FORMAT}")
        step, config = meta.get("step"), meta.get("config")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint: {path} has no valid step (got {step!r})")
        if not isinstance(config, dict):
            raise ValueError(f"checkpoint: {path} holds no run config")
        return meta

    def committed_step(self) -> int | None:
        """The step `recover` would resume from, read without changing anything."""
        steps = [self._mark_step(p) for p in (self.checkpoint, self.tmp, self.old) if p.exists()]
        steps = [s for s in steps if s is not None]
        return max(steps) if steps else None

    def saved_config(self) -> dict | None:
        """The config of the run in the folder: the checkpoint's, else config.json's."""
        meta = self.meta()
        if meta is not None:
            return meta["config"]
        if self.config_path.exists():
            try:
                saved = json.loads(self.config_path.read_text())
            except ValueError as err:
                raise ValueError(f"out: {self.config_path} is unreadable ({err})") from None
            if not isinstance(saved, dict):
                raise ValueError(f"out: {self.config_path} holds no run config")
            return saved
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

    def rewrite_metrics(self, rows: list[dict]) -> None:
        """Replace metrics.jsonl with ``rows`` (a kill leaves the old file or the new one,
        whole) and reopen it for appending."""
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
        write_atomic(self.metrics_path, "".join(json.dumps(row) + "\n" for row in rows))
        self._metrics_file = open(self.metrics_path, "a")

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
