"""The installed package: a wheel built from this repository puts one top-level name in site-packages,
``lora_server``, with the repository's adapters/, kv_pool/, kernels/ and admin/ inside it. Installed into a fresh
venv beside a package that owns a top-level ``kernels`` (as Hugging Face's does), both import, each its own."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERIC = ("adapters", "admin", "kernels", "kv_pool")
IGNORED = (
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "results",
    ".*_cache",
    "__pycache__",
    ".peer",
    ".whl",
    ".devcarry",
)


def _wheel(source: Path, out: Path) -> Path:
    """Build ``source``'s wheel with this venv's setuptools (no network), return its path. setuptools builds in the
    source folder (build/, *.egg-info), so the repository is built from a copy."""
    if source == ROOT:
        source = out.parent / "lora-server"
        shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*IGNORED))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source), "-w", str(out)],
        check=True,
    )
    [wheel] = out.glob("*.whl")  # ``out`` starts empty
    return wheel


def _other_kernels_package(tmp: Path) -> Path:
    """A package that owns the top-level import name ``kernels``."""
    src = tmp / "other-kernels"
    (src / "kernels").mkdir(parents=True)
    (src / "kernels" / "__init__.py").write_text("OWNER = 'other-kernels'\n")
    (src / "pyproject.toml").write_text(
        textwrap.dedent(
            """\
            [build-system]
            requires = ["setuptools>=68"]
            build-backend = "setuptools.build_meta"
            [project]
            name = "other-kernels"
            version = "1.0"
            [tool.setuptools]
            packages = ["kernels"]
            """
        )
    )
    return src


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_name_beside_another_kernels(tmp_path):
    wheel = _wheel(ROOT, tmp_path / "dist")
    with zipfile.ZipFile(wheel) as z:
        tops = {name.split("/")[0] for name in z.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"lora_server"}
    other = _wheel(_other_kernels_package(tmp_path), tmp_path / "dist-other")

    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel), str(other)], check=True
    )
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    installed = {p.name for p in site.iterdir()}
    assert "lora_server" in installed and "kernels" in installed  # the other package's
    assert not (set(GENERIC) - {"kernels"}) & installed
    # lora_server's dependencies (torch, triton, ...) from this venv's site-packages, after the fresh one's own; a
    # path in a .pth file does not run that folder's .pth files, so this venv's editable install stays out
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = textwrap.dedent(
        f"""\
        import kernels, lora_server.kernels.ops, lora_server.kv_pool.tree, lora_server.admin, lora_server.adapters
        from pathlib import Path
        site = Path({str(site)!r})
        assert kernels.OWNER == "other-kernels", kernels.__file__
        for module in (lora_server.kernels.ops, lora_server.kv_pool.tree, lora_server.admin):
            assert Path(module.__file__).is_relative_to(site / "lora_server"), module.__file__
        assert sorted(lora_server.adapters.demo_adapters()) == ["emoji", "pirate", "upper"]
        print("ok")
        """
    )
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert done.stdout.strip() == "ok", done.stderr
