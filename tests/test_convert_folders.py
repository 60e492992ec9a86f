"""A user's folder is never emptied (issue #26.1): conversion refuses a non-empty folder it
did not write, before any work, and replaces only its own earlier conversions."""
import json

import pytest

from turboquant import models
from turboquant.convert import check_out_dir, convert_gguf, written_here


@pytest.fixture
def users_folder(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "thesis.tex").write_text("years of work")
    return d


def test_convert_refuses_a_users_folder_and_leaves_it_as_it_was(users_folder):
    with pytest.raises(ValueError, match="not empty and is not a model folder turboquant wrote"):
        convert_gguf(models.model_gguf("smollm2-135m"), users_folder, progress=False)
    assert [p.name for p in users_folder.iterdir()] == ["thesis.tex"]
    assert (users_folder / "thesis.tex").read_text() == "years of work"


def test_load_with_a_users_folder_is_refused_too(users_folder):
    with pytest.raises(ValueError, match="nothing was changed"):
        models.load("smollm2-135m", folder=users_folder)
    assert (users_folder / "thesis.tex").read_text() == "years of work"


def test_a_file_is_not_a_model_folder(tmp_path):
    f = tmp_path / "model"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        check_out_dir(f)


def test_new_empty_and_own_folders_are_accepted(tmp_path):
    assert check_out_dir(tmp_path / "new") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    check_out_dir(tmp_path / "empty")
    own = tmp_path / "own"
    own.mkdir()
    (own / "source.json").write_text(json.dumps({"gguf": "x.gguf", "bytes": 3}))
    assert written_here(own)
    check_out_dir(own)
    (own / "source.json").write_text("[1, 2]")                      # not ours after all
    assert not written_here(own)
    with pytest.raises(ValueError):
        check_out_dir(own)


def test_the_installed_conversions_are_marked_as_ours():
    models.load("smollm2-135m")                                      # converted once per machine
    assert written_here(models.model_dir("smollm2-135m"))
