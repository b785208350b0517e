"""Named models: `treadle pull` end to end with real pip (throwaway wheels of fake "model part"
packages, installed with --no-index into a --target directory, never into .venv), the sha256 check,
the "run treadle pull NAME" error of a model not pulled yet, and `treadle models`. Nothing here
downloads anything; the one slow test pulls the real models only when their packages are installed."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from app import cli
from decoding import ModelLoadError
from decoding.model import catalog
from decoding.model.catalog import KNOWN_MODELS, PackagedModel, Part, PullError, SplitModel, ZippedModel, pull
from decoding.model.registry import resolve_model_path
from tests.conftest_server import REPO, server_env

QWEN, GEMMA = "qwen2.5-coder-0.5b-instruct", "gemma-3-270m"


def write_wheel(directory: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal pure-Python wheel of distribution `name` holding `files` (paths from site-packages)."""
    stem = f"{name.replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    files = {**files,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: treadle-tests\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
              f"{len(data)}" for path, data in files.items()]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    wheel = directory / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


PARTS = [b"GGUF" + bytes(range(256)) * 40, os.urandom(3000), b"the end\n"]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wheels of three fake part packages (treadle-fake-part1..3, modules treadle_fake_part1..3 with
    data/partNN.bin) and one fake whole-file package (treadle-fake-whole, treadle_fake_whole/m.gguf)."""
    directory = tmp_path_factory.mktemp("wheels")
    for i, data in enumerate(PARTS, start=1):
        write_wheel(directory, f"treadle-fake-part{i}", "0.1.0",
                    {f"treadle_fake_part{i}/__init__.py": b"", f"treadle_fake_part{i}/data/part{i:02d}.bin": data})
    write_wheel(directory, "treadle-fake-whole", "2.0", {"treadle_fake_whole/__init__.py": b"",
                                                          "treadle_fake_whole/m.gguf": PARTS[0]})
    write_wheel(directory, "treadle-fake-zipped", "1.0", {"treadle_fake_zipped/__init__.py": b"",
                                                           "treadle_fake_zipped/model.zip": zipped(ZIPPED)})
    write_wheel(directory, "treadle-fake-escape", "1.0", {"treadle_fake_escape/__init__.py": b"",
                                                           "treadle_fake_escape/model.zip": zipped(ESCAPE)})
    return directory


ZIPPED = {"config.json": b'{"model_type": "bert"}', "1_Pooling/config.json": b"{}", "model.safetensors": b"x" * 999}
ESCAPE = {"config.json": b"{}", "../outside.txt": b"written outside the directory"}


def zipped(files: dict[str, bytes]) -> bytes:
    """A zip of `files`, the same bytes each time (fixed timestamps)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in files.items():
            archive.writestr(zipfile.ZipInfo(path, date_time=(2026, 1, 1, 0, 0, 0)), data)
    return buffer.getvalue()


def zipped_spec(module: str, files: dict[str, bytes], sha256: str | None = None) -> ZippedModel:
    data = zipped(files)
    return ZippedModel(module, f"{module.replace('_', '-')}==1.0", "model.zip", "Fake-Encoder", "bert", "F32",
                       size=len(data), sha256=sha256 or hashlib.sha256(data).hexdigest())


def split_spec(sha256: str | None = None) -> SplitModel:
    whole = b"".join(PARTS)
    return SplitModel(requirements=tuple(f"treadle-fake-part{i}==0.1.0" for i in range(1, 4)),
                      parts=tuple(Part(f"treadle_fake_part{i}", f"data/part{i:02d}.bin") for i in range(1, 4)),
                      filename="fake.gguf", architecture="llama", quantization="F32", size=len(whole),
                      sha256=sha256 or hashlib.sha256(whole).hexdigest())


def offline(wheels: Path) -> tuple[str, ...]:
    return ("--no-index", "--find-links", str(wheels), "--disable-pip-version-check", "--quiet")


def test_pull_installs_the_parts_with_pip_and_assembles_the_file_once(tmp_path, wheels):
    spec, site, models = split_spec(), tmp_path / "site", tmp_path / "models"
    assert catalog.missing_requirements(spec, site) == list(spec.requirements)
    seen: list[tuple[int, int]] = []
    path = pull(spec, models, site=site, pip_args=offline(wheels), progress=lambda *p: seen.append(p))
    assert path == models / "fake.gguf" and path.read_bytes() == b"".join(PARTS)
    assert sorted(p.name for p in models.iterdir()) == ["fake.gguf"]  # no temporary file left
    assert seen[-1] == (spec.size, spec.size) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert catalog.missing_requirements(spec, site) == []  # pip put the packages and their metadata there
    assert catalog.locate(spec, models) == path
    # Again: the file is verified and kept as it is; neither pip (which would fail) nor the parts are used.
    written = path.stat()
    assert pull(spec, models, site=site, pip=("false",)) == path
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    # A file that is not the expected one is assembled again, without pip: the packages are there.
    path.write_bytes(b"x" * spec.size)
    assert catalog.locate(spec, models) == path  # the size alone says nothing...
    assert pull(spec, models, site=site, pip=("false",)).read_bytes() == b"".join(PARTS)  # ...the sha256 does


def test_a_sha256_mismatch_is_refused_and_the_partial_file_removed(tmp_path, wheels):
    spec, models = split_spec(sha256="0" * 64), tmp_path / "models"
    with pytest.raises(PullError, match="fake.gguf assembled to .* refused"):
        pull(spec, models, site=tmp_path / "site", pip_args=offline(wheels))
    assert list(models.iterdir()) == []
    with pytest.raises(ModelLoadError, match="treadle pull fake"):
        catalog.resolve_known("fake", spec, models)


def test_pull_of_a_whole_file_package_only_installs_it(tmp_path, wheels):
    spec = PackagedModel("treadle_fake_whole", "treadle-fake-whole==2.0", "m.gguf", "llama", "F32", len(PARTS[0]))
    site, models = tmp_path / "site", tmp_path / "models"
    path = pull(spec, models, site=site, pip_args=offline(wheels))
    assert path == site / "treadle_fake_whole" / "m.gguf" and path.read_bytes() == PARTS[0]
    assert not models.exists()


def test_pull_of_a_zipped_directory_checks_the_zip_and_extracts_it_whole_once(tmp_path, wheels):
    spec, site, models = zipped_spec("treadle_fake_zipped", ZIPPED), tmp_path / "site", tmp_path / "models"
    with pytest.raises(ModelLoadError, match="treadle pull fake"):
        catalog.resolve_known("fake", spec, models)
    path = pull(spec, models, site=site, pip_args=offline(wheels))
    assert path == models / "Fake-Encoder" and sorted(p.name for p in models.iterdir()) == ["Fake-Encoder"]
    assert {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()} == ZIPPED
    assert catalog.locate(spec, models) == path == catalog.resolve_known("fake", spec, models)
    made = path.stat().st_ino
    assert pull(spec, models, site=site, pip=("false",)) == path and path.stat().st_ino == made  # kept as it is


def test_a_zip_that_is_not_the_expected_one_or_leaves_its_directory_is_refused(tmp_path, wheels):
    site, models = tmp_path / "site", tmp_path / "models"
    with pytest.raises(PullError, match="not the expected archive"):
        pull(zipped_spec("treadle_fake_zipped", ZIPPED, sha256="0" * 64), models, site=site,
             pip_args=offline(wheels))
    with pytest.raises(PullError, match="unsafe path '../outside.txt'"):
        pull(zipped_spec("treadle_fake_escape", ESCAPE), models, site=site, pip_args=offline(wheels))
    assert list(models.iterdir()) == [] and not (tmp_path / "outside.txt").exists()


def test_a_failing_pip_is_an_error_that_says_so(tmp_path):
    with pytest.raises(PullError, match="pip install failed with status 1"):
        pull(split_spec(), tmp_path / "models", site=tmp_path / "site", pip=("false",))
    assert not (tmp_path / "models").exists()


def test_pull_of_an_unknown_name_prints_one_line_and_exits_2(capsys):
    assert cli.main(["pull", "no-such-model"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("treadle: error: unknown model 'no-such-model'") and QWEN in captured.err


def test_a_known_model_not_pulled_yet_says_to_run_treadle_pull(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_MODELS_DIR", str(tmp_path))
    for name in (QWEN, GEMMA):
        with pytest.raises(ModelLoadError, match=f"not pulled yet: run `treadle pull {name}`") as error:
            resolve_model_path(name)
        assert str(tmp_path) in str(error.value) and "\n" not in str(error.value)
    (tmp_path / KNOWN_MODELS[GEMMA].filename).write_bytes(b"GGUF cut short")
    with pytest.raises(ModelLoadError, match=f"is 14 bytes, not 253,113,024: run `treadle pull {GEMMA}`"):
        resolve_model_path(GEMMA)


def test_serve_of_a_model_not_pulled_yet_prints_one_line_and_exits_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--model", QWEN], cwd=REPO,
                            env={**server_env(), "TREADLE_MODELS_DIR": str(tmp_path)},
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and f"run `treadle pull {QWEN}`" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def test_models_lists_every_name_and_whether_its_file_is_here(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TREADLE_MODELS_DIR", str(tmp_path))
    gemma = tmp_path / KNOWN_MODELS[GEMMA].filename
    with gemma.open("wb") as f:  # sparse, of the right size: `models` checks only the size
        f.truncate(KNOWN_MODELS[GEMMA].size)
    assert cli.main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[1:] if line and not line.startswith("models directory")}
    assert lines[0].split() == ["NAME", "ARCH", "QUANT", "SIZE", "FILE"]
    assert set(rows) == set(KNOWN_MODELS)
    assert rows[GEMMA].split()[1:5] == ["gemma3", "Q4_K_M", "253.1", "MB"] and rows[GEMMA].endswith(str(gemma))
    assert rows[QWEN].split()[1:5] == ["qwen2", "Q4_K_M", "491.4", "MB"]
    assert rows[QWEN].endswith(f"not pulled: treadle pull {QWEN}")
    assert "(default)" in rows["smollm2-135m-instruct"]
    assert lines[-1] == f"models directory (TREADLE_MODELS_DIR): {tmp_path}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [QWEN, GEMMA])
def test_the_real_names_resolve_after_pull(name, tmp_path, monkeypatch):
    spec = KNOWN_MODELS[name]
    if catalog.missing_requirements(spec):
        pytest.skip(f"the packages of {name} are not installed (treadle pull {name} would download them)")
    monkeypatch.setenv("TREADLE_MODELS_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError, match="not pulled yet"):
        resolve_model_path(name)
    path = pull(spec, pip=("false",))  # installed already: pip is not run
    assert path == tmp_path / spec.filename and path.stat().st_size == spec.size
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
    assert resolve_model_path(name) == (path, name)
