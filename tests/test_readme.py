"""Every ```python block of README.md and of docs/*.md runs as written, on the default model, each in a process of its
own (as a reader copies one block). A block that talks to `sfi-gguf serve` at 127.0.0.1:8000 gets a server this test
starts on a free port (its address put in place of that one)."""
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model

REPO = Path(__file__).resolve().parent.parent
SERVER = "http://127.0.0.1:8000"  # where the docs' client blocks find `sfi-gguf serve --port 8000`
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def python_blocks(path: Path) -> list[tuple[str, str]]:
    """(path:line, code) of each ```python block of a Markdown file."""
    text = path.read_text()
    return [(f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S)]


BLOCKS = [block for path in DOCS for block in python_blocks(path)]


def test_the_readme_has_python_blocks():
    assert len(python_blocks(REPO / "README.md")) >= 6


@pytest.fixture(scope="module")
def server():
    from sfi_gguf import SFILlama
    from sfi_gguf.serve.server import SFIServer

    llm = SFILlama(n_ctx=2048, n_threads=1)
    srv = SFIServer(llm, "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv.url.removesuffix("/v1")
    srv.shutdown()
    srv.server_close()
    llm.close()


@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[where for where, _ in BLOCKS])
def test_readme_python_block_runs(code, request):
    if SERVER in code:
        code = code.replace(SERVER, request.getfixturevalue("server"))
    # one CPU thread, as the other tests run llama.cpp: threads that spin-wait for a core held by another process
    # (CI's 2 cores) make every step many times slower
    code = "import os\nos.cpu_count = lambda: 1\n" + code
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Exception ignored" not in result.stderr, result.stderr[-3000:]  # (a clean exit too)
