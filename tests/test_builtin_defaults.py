"""What a built-in model sets by default: the training settings of its recorded runs where a
command line leaves a flag out (shown in ``--help``), and the per-user cache folder its
conversion and warm starts go to (never the current folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mrtpo.cli import build_parser, config_from_args
from mrtpo.model import builtin as builtin_models
from mrtpo.model import loading as model
from mrtpo.model import pretrained
from mrtpo.training.config import CompareConfig, TrainConfig

NAME = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[1]
RECORDED = {"lr": 2e-5, "prompts_per_step": 2, "group_size": 4, "micro_batch": 8}


def _parse(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


def _values(cfg) -> dict:
    return {k: getattr(cfg, k) for k in RECORDED}


def test_builtin_model_defaults_are_the_recorded_runs_settings():
    # every recorded real-model run (records/real*/command.sh) used these
    commands = sorted((ROOT / "records").glob("real*/command.sh"))
    assert len(commands) >= 3
    for path in commands:
        text = path.read_text()
        assert "--lr 2e-5" in text and "--micro-batch 8" in text, path
        assert "--prompts-per-step 2 --group-size 4" in text, path
    assert dict(builtin_models.model_defaults(NAME)) == RECORDED
    assert dict(builtin_models.model_defaults("/some/folder")) == {}
    assert dict(builtin_models.model_defaults(None)) == {}


def test_train_flags_left_out_take_the_models_defaults():
    assert _values(_parse("train", "--model", NAME)) == RECORDED
    # a flag that is given wins, even when it equals the generic default
    cfg = _parse("train", "--model", NAME, "--lr", "2e-4", "--group-size", "8")
    assert _values(cfg) == {**RECORDED, "lr": 2e-4, "group_size": 8}
    # no model, or a folder: the generic defaults
    generic = TrainConfig()
    assert _values(_parse("train")) == _values(generic)
    assert generic.lr == 2e-4 and generic.group_size == 8


def test_compare_runs_take_the_models_defaults():
    cfg = _parse("compare", "--model", NAME, "--micro-batch", "4", "--steps", "7")
    assert isinstance(cfg, CompareConfig) and cfg.steps == 7
    assert _values(cfg.train) == {**RECORDED, "micro_batch": 4}
    assert _values(cfg.run_config("mrtpo", 1)) == {**RECORDED, "micro_batch": 4}
    assert _values(_parse("compare").train) == _values(TrainConfig())


def test_code_built_configs_apply_them_on_request():
    cfg = TrainConfig(model=NAME, lr=1e-3)
    assert cfg.lr == 1e-3  # a config built in code is what it says
    assert _values(cfg.with_model_defaults(given={"lr"})) == {**RECORDED, "lr": 1e-3}
    assert _values(cfg.with_model_defaults()) == RECORDED
    assert TrainConfig().with_model_defaults() == TrainConfig()


def test_help_shows_the_models_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "AdamW learning rate (default: 0.0002; smollm2-135m-instruct: 2e-05)" in text
    assert "(default: 8; smollm2-135m-instruct: 4)" in text  # group size
    assert "(default: 16; smollm2-135m-instruct: 8)" in text  # micro batch
    assert "$MRTPO_CACHE, else $XDG_CACHE_HOME/mrtpo, else ~/.cache/mrtpo" in text


# --------------------------------------------------------------------------------------------
# The per-user cache folder


def test_user_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MRTPO_CACHE", str(tmp_path / "own"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert builtin_models.user_cache_dir() == str(tmp_path / "own")
    monkeypatch.setenv("MRTPO_CACHE", "")  # empty counts as unset
    assert builtin_models.user_cache_dir() == str(tmp_path / "xdg" / "mrtpo")
    monkeypatch.delenv("MRTPO_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert builtin_models.user_cache_dir() == str(tmp_path / "home" / ".cache" / "mrtpo")


def test_nothing_is_cached_in_the_current_folder_by_default(monkeypatch, tmp_path):
    cache, cwd = tmp_path / "cache", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("MRTPO_CACHE", str(cache))
    assert TrainConfig().cache_dir == str(cache)
    assert _parse("train").cache_dir == str(cache)
    assert _parse("compare").train.cache_dir == str(cache)
    assert _parse("train", "--cache-dir", "elsewhere").cache_dir == "elsewhere"
    assert pretrained.cached_folder(NAME) == cache / f"{NAME}-float32"

    seen = []

    def fake_builtin_folder(name, cache_dir=None, *, dtype="float32", log=None):
        seen.append(pretrained.cached_folder(name, cache_dir, dtype))
        raise ValueError("model: stop here")

    monkeypatch.setattr(pretrained, "builtin_folder", fake_builtin_folder)
    with pytest.raises(ValueError, match="stop here"):
        model.load_model(NAME)
    assert seen == [cache / f"{NAME}-float32"]
    assert not any(cwd.iterdir())


def test_a_cache_that_is_a_file_is_refused_naming_mrtpo_cache(monkeypatch, tmp_path, capsys):
    """Issue 41 item 6: MRTPO_CACHE pointing at a file ended in a bare FileExistsError that
    named neither the variable nor the cache. Every way in (a built-in model by name, the
    tiny model, the settings, the command line) says MRTPO_CACHE and the path."""
    from mrtpo.cli import main
    from mrtpo.tasks.builtin import load_task

    afile = tmp_path / "not-a-folder"
    afile.write_text("x")
    monkeypatch.setenv("MRTPO_CACHE", str(afile))
    pattern = rf"^MRTPO_CACHE: the model cache '{afile}' .*is a file, not a folder"
    with pytest.raises(ValueError, match=pattern):
        model.load_model(NAME)
    with pytest.raises(ValueError, match=pattern):
        model.default_model(load_task("constraints"))
    with pytest.raises(ValueError, match=rf"cache_dir: '{afile}' .*MRTPO_CACHE"):
        TrainConfig().validate()
    with pytest.raises(SystemExit) as exc:
        main(["train", "--out", str(tmp_path / "o"), "--steps", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "MRTPO_CACHE" in err and str(afile) in err and "Traceback" not in err
    assert afile.read_text() == "x" and not (tmp_path / "o").exists()
    # a cache folder given under a file: named with the file in the way
    with pytest.raises(ValueError, match=rf"^cache_dir: .*'{afile}' above it is a file"):
        pretrained.builtin_folder(NAME, afile / "sub")
