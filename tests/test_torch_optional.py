"""routepack imports without torch; routepack.torch says what is missing."""

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_routepack_imports_without_torch():
    r = _run(
        "import sys; sys.modules['torch'] = None; import routepack; "
        "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules if sys.modules[m]); print('ok')"
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_routepack_torch_names_the_missing_dependency():
    r = _run(
        "import sys; sys.modules['torch'] = None\ntry:\n import routepack.torch\nexcept ImportError as e:\n print(e)"
    )
    assert "routepack.torch needs PyTorch" in r.stdout, r.stdout + r.stderr
