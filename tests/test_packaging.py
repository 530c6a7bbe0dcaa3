"""Fast checks of the packaging files (no PyInstaller run): the spec parses, the version has one source, resources
are found from a source tree, the .desktop entry and icons are sound, and the Linux install script round-trips."""

from __future__ import annotations

import ast
import configparser
import importlib.util
import os
import plistlib
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import engine
from engine import pyproject_version
from engine.resources import resource_path, root, shader_path

ROOT = Path(__file__).resolve().parent.parent
PACKAGING = ROOT / "packaging"
ICONS = ROOT / "resources" / "icons"
SIZES = (16, 24, 32, 48, 64, 128, 256, 512)


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


# ---- spec and version ------------------------------------------------------------------------------

def test_spec_parses_and_names_what_it_bundles():
    text = (ROOT / "installer.spec").read_text(encoding="utf-8")
    tree = ast.parse(text, "installer.spec")
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"Analysis", "PYZ", "EXE", "COLLECT", "BUNDLE"} <= calls
    for needed in ('"shaders"', '"resources"', '"pyproject.toml"', "pyinstaller_hooks", '"zerotvm-chat"'):
        assert needed in text
    for script in ("entry_chat.py", "entry_cli.py"):
        assert script in text and (PACKAGING / script).is_file()
    excludes = next(n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "EXCLUDES" for t in n.targets))
    excluded = set(ast.literal_eval(excludes))
    assert {"torch", "transformers", "accelerate", "mlx", "mlx_lm", "pytest", "pytestqt", "tkinter"} <= excluded
    assert not {"tokenizers", "numpy", "wgpu", "jinja2", "keyring", "gguf", "huggingface_hub"} & excluded


def test_version_comes_from_pyproject():
    version = pyproject_version(ROOT / "pyproject.toml")
    assert version and version[0].isdigit()
    tomllib = pytest.importorskip("tomllib")
    assert version == tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert engine.__version__ == engine.get_version() == version


def test_version_falls_back_to_pyproject_when_not_installed(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    monkeypatch.setattr(engine, "_version", None)
    assert engine.get_version() == pyproject_version(ROOT / "pyproject.toml")
    monkeypatch.setattr(engine, "_version", None)
    monkeypatch.setattr(sys, "_MEIPASS", "/nonexistent-bundle", raising=False)  # a bundle without pyproject.toml
    assert engine.get_version() == "0+unknown"
    monkeypatch.setattr(engine, "_version", None)


def test_pyproject_version_reads_only_the_project_table(tmp_path):
    f = tmp_path / "pyproject.toml"
    f.write_text('[tool.other]\nversion = "9.9"\n\n[project]\nname = "x"\nversion = "1.2.3"\n\n[tool.x]\n'
                 'version = "7"\n')
    assert pyproject_version(f) == "1.2.3"
    f.write_text('[project]\nname = "x"\n\n[tool.x]\nversion = "7"\n')
    assert pyproject_version(f) is None
    assert pyproject_version(tmp_path / "missing.toml") is None


def test_version_flags(capsys):
    from app.main import parse_args
    from engine.cli import main as cli_main

    version = pyproject_version(ROOT / "pyproject.toml")
    with pytest.raises(SystemExit) as e:
        parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"zerotvm-chat {version}"
    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"zerotvm {version}"


# ---- resources -------------------------------------------------------------------------------------

def test_resources_found_from_source_tree_and_bundle(monkeypatch, tmp_path):
    assert root() == ROOT
    assert resource_path("models.json").is_file()
    for wgsl in (ROOT / "shaders").glob("*.wgsl"):
        assert shader_path(wgsl.stem) == wgsl
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path), raising=False)
    assert root() == tmp_path and resource_path("models.json") == tmp_path / "resources" / "models.json"


# ---- Linux desktop entry, icons, install script -----------------------------------------------------

DESKTOP_KEYS = {"Type", "Version", "Name", "GenericName", "Comment", "Exec", "TryExec", "Icon", "Terminal",
                "Categories", "Keywords", "StartupNotify", "StartupWMClass"}


def _desktop(path: Path) -> dict:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # keys are case-sensitive
    parser.read_string(path.read_text(encoding="utf-8"))
    assert parser.sections() == ["Desktop Entry"]
    return dict(parser["Desktop Entry"])


def test_desktop_entry_is_valid():
    entry = _desktop(PACKAGING / "linux" / "zerotvm-chat.desktop")
    assert set(entry) <= DESKTOP_KEYS
    assert entry["Type"] == "Application" and entry["Terminal"] == "false" and entry["Name"]
    assert entry["Exec"].split()[0] == "zerotvm-chat" == entry["TryExec"]
    assert 'zerotvm-chat = "app.main:main"' in (ROOT / "pyproject.toml").read_text()
    assert entry["Icon"] == "zerotvm-chat"
    for key in ("Categories", "Keywords"):
        assert entry[key].endswith(";")
    assert entry["StartupNotify"] in ("true", "false")
    tool = shutil.which("desktop-file-validate")
    if tool:
        out = subprocess.run([tool, str(PACKAGING / "linux" / "zerotvm-chat.desktop")], capture_output=True, text=True)
        assert "error" not in out.stdout.lower(), out.stdout


def test_icons_exist_and_are_small(tmp_path):
    svg = ET.parse(ICONS / "zerotvm.svg").getroot()
    assert svg.tag.endswith("svg") and svg.get("viewBox") == "0 0 512 512"
    for size in SIZES:
        png = ICONS / f"zerotvm-{size}.png"
        assert _png_size(png) == (size, size)
        assert png.stat().st_size < 64 * 1024
    make_icons = _load(PACKAGING / "make_icons.py", "make_icons_under_test")
    ico = make_icons.write_ico(tmp_path / "z.ico").read_bytes()
    assert struct.unpack("<HHH", ico[:6]) == (0, 1, len(make_icons.ICO_SIZES))
    icns = make_icons.write_icns(tmp_path / "z.icns").read_bytes()
    assert icns[:4] == b"icns" and struct.unpack(">I", icns[4:8])[0] == len(icns)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX shell script")
def test_linux_install_script_round_trip(tmp_path):
    stage = tmp_path / "stage"
    app = stage / "zerotvm-chat"
    app.mkdir(parents=True)
    for prog in ("zerotvm-chat", "zerotvm"):
        (app / prog).write_text(f"#!/bin/sh\necho {prog} 9.9.9\n")
        (app / prog).chmod(0o755)
    shutil.copy(PACKAGING / "linux" / "install.sh", stage)
    shutil.copy(PACKAGING / "linux" / "zerotvm-chat.desktop", stage)
    for size in SIZES:
        (stage / f"icons/hicolor/{size}x{size}/apps").mkdir(parents=True)
        shutil.copy(ICONS / f"zerotvm-{size}.png", stage / f"icons/hicolor/{size}x{size}/apps/zerotvm-chat.png")
    (stage / "icons/hicolor/scalable/apps").mkdir(parents=True)
    shutil.copy(ICONS / "zerotvm.svg", stage / "icons/hicolor/scalable/apps/zerotvm-chat.svg")
    prefix = tmp_path / "prefix"
    env = {**os.environ, "PREFIX": str(prefix), "HOME": str(tmp_path / "home")}
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "zerotvm").write_text("#!/bin/sh\n# someone else's\n")  # must survive install and uninstall

    out = subprocess.run(["sh", str(stage / "install.sh")], env=env, capture_output=True, text=True, check=True)
    assert "9.9.9 installed" in out.stdout
    lib = prefix / "lib" / "zerotvm-chat"
    assert (prefix / "bin" / "zerotvm-chat").resolve() == (lib / "zerotvm-chat").resolve()
    assert not (prefix / "bin" / "zerotvm").is_symlink() and "not from this installer" in out.stderr
    entry = _desktop(prefix / "share" / "applications" / "zerotvm-chat.desktop")
    assert entry["Exec"] == f'"{lib}/zerotvm-chat"' and entry["TryExec"] == f"{lib}/zerotvm-chat"
    assert (prefix / "share/icons/hicolor/48x48/apps/zerotvm-chat.png").is_file()
    assert (prefix / "share/icons/hicolor/scalable/apps/zerotvm-chat.svg").is_file()

    subprocess.run(["sh", str(lib / "uninstall.sh")], env=env, capture_output=True, text=True, check=True)
    assert not lib.exists() and not (prefix / "bin" / "zerotvm-chat").exists()
    assert not (prefix / "share/applications/zerotvm-chat.desktop").exists()
    assert not (prefix / "share/icons/hicolor/48x48/apps/zerotvm-chat.png").exists()
    assert (prefix / "bin" / "zerotvm").read_text().endswith("someone else's\n")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_shell_scripts_parse():
    for script in ("build.sh", "linux/build_linux.sh", "macos/build_dmg.sh"):
        subprocess.run(["bash", "-n", str(PACKAGING / script)], check=True)
    for script in ("linux/install.sh", "linux/AppRun"):
        subprocess.run(["sh", "-n", str(PACKAGING / script)], check=True)
    assert os.access(PACKAGING / "linux" / "AppRun", os.X_OK) and os.access(PACKAGING / "build.sh", os.X_OK)


# ---- macOS, Windows, the Qt plugin selection, the bundle check ------------------------------------------

def test_macos_info_plist():
    with open(PACKAGING / "macos" / "Info.plist", "rb") as f:
        plist = plistlib.load(f)
    assert plist["CFBundleIdentifier"].count(".") >= 2 and plist["NSHighResolutionCapable"] is True
    assert plist["LSMinimumSystemVersion"] and {"CFBundleShortVersionString", "CFBundleVersion"} <= set(plist)


def test_inno_setup_script():
    text = (PACKAGING / "windows" / "zerotvm.iss").read_text(encoding="utf-8")
    for needed in ("PrivilegesRequired=lowest", "AppVersion={#AppVersion}", "{autoprograms}", "{autodesktop}",
                   "Tasks: desktopicon", "zerotvm-chat.exe", "AppId={{"):
        assert needed in text
    assert "/DAppVersion=$version" in (PACKAGING / "windows" / "build_windows.ps1").read_text(encoding="utf-8")


def test_qt_plugin_selection():
    select = _load(PACKAGING / "pyinstaller_hooks" / "_qt_select.py", "qt_select_under_test")
    kept = select.plugin_kept
    qt = "PySide6/Qt/plugins"
    assert kept("/x/libqxcb.so", f"{qt}/platforms", "linux")
    assert kept("/x/libqwayland.so", f"{qt}/platforms", "linux")
    assert kept("/x/libqoffscreen.so", f"{qt}/platforms", "linux")
    assert not kept("/x/libqvnc.so", f"{qt}/platforms", "linux")
    assert not kept("/x/libqtvirtualkeyboardplugin.so", f"{qt}/platforminputcontexts", "linux")  # pulls QtQuick
    assert not kept("/x/libqopensslbackend.so", f"{qt}/tls", "linux")
    assert not kept("/x/libqgtk3.so", f"{qt}/platformthemes", "linux")
    assert kept("/x/libQt6Core.so.6", "PySide6/Qt/lib", "linux")  # not a plugin
    assert kept("C:/x/qwindows.dll", "PySide6/plugins/platforms", "win32")
    assert not kept("C:/x/qxcb.dll", "PySide6/plugins/platforms", "win32")
    assert kept("/x/libqcocoa.dylib", f"{qt}/platforms", "darwin")
    assert kept("/x/libqmacstyle.dylib", f"{qt}/styles", "darwin")


def test_bundle_check_names():
    check = _load(PACKAGING / "check_bundle.py", "check_bundle_under_test")
    for bad, owner in (("torch", "torch"), ("torch-2.13.0.dist-info", "torch"), ("libtorch_cpu.so", "torch"),
                       ("pytest", "pytest"), ("_pytest", "_pytest"), ("transformers", "transformers"),
                       ("mlx_lm", "mlx_lm"), ("accelerate-1.0.dist-info", "accelerate")):
        assert check.forbidden_name(bad) == owner
    for good in ("numpy", "tokenizers", "libscipy_openblas64_-32a4b2a6.so", "torchlike", "wgpu", "PySide6"):
        assert check.forbidden_name(good) is None
