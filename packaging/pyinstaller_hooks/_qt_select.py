"""Which Qt plugins and translations the frozen app keeps (used by the hook-PySide6.*.py files next to it).

PyInstaller's own PySide6 hooks collect every plugin of every type a collected Qt module is associated with
(all platforms, image formats, input contexts, TLS and network backends...). Some of those link big Qt
modules the app never uses (the virtual keyboard pulls QtQuick and QtQml). These hooks run PyInstaller's
collection, then keep only the plugins below, *before* PyInstaller analyses their library dependencies, so the
Qt libraries that only dropped plugins need never reach the bundle. The app uses QtCore, QtGui and QtWidgets
with the Fusion style, raster painting, no images from files, and Qt's strings in English only.
"""

from __future__ import annotations

import sys
from pathlib import PurePath

_LINUX = {
    "platforms": {"qxcb", "qwayland", "qoffscreen", "qminimal"},
    "platforminputcontexts": {"composeplatforminputcontextplugin", "ibusplatforminputcontextplugin"},  # dead keys, IMEs
    "platformthemes": {"qxdgdesktopportal"},  # portal file dialogs; qgtk3 would pull the system's GTK into the bundle
    "wayland-shell-integration": {"xdg-shell"},
    "wayland-decoration-client": {"bradient", "adwaita"},  # window decorations where the compositor draws none
    "iconengines": {"qsvgicon"},  # SVG icon themes in the (non-native) file dialog
}
_WINDOWS = {
    "platforms": {"qwindows", "qoffscreen", "qminimal"},
    "styles": {"qmodernwindowsstyle", "qwindowsvistastyle"},
    "iconengines": {"qsvgicon"},
}
_MACOS = {
    "platforms": {"qcocoa", "qoffscreen", "qminimal"},
    "platforms/darwin": None,  # None: keep every plugin of the type
    "styles": {"qmacstyle"},
    "iconengines": {"qsvgicon"},
}


def allowed_plugins(platform: str = sys.platform) -> dict:
    """Plugin type -> kept plugin names (file stem without 'lib'), or None for all; a type left out is dropped."""
    if platform.startswith("win"):
        return _WINDOWS
    if platform == "darwin":
        return _MACOS
    return _LINUX


def plugin_kept(src: str, dest: str, platform: str = sys.platform) -> bool:
    """Whether a collected binary stays: anything that is not a Qt plugin, and the plugins listed above."""
    parts = PurePath(dest).parts
    if "plugins" not in parts:
        return True
    kind = "/".join(parts[parts.index("plugins") + 1:])
    allow = allowed_plugins(platform)
    if kind not in allow:
        return False
    if allow[kind] is None:
        return True
    stem = PurePath(src).name.split(".")[0]
    stem = stem[3:] if stem.startswith("lib") else stem
    return stem in allow[kind]


def collect(hook_file: str):
    """PyInstaller's collection for the hook's Qt module, minus unused plugins and all Qt translations."""
    from PyInstaller.utils.hooks.qt import add_qt6_dependencies

    hiddenimports, binaries, datas = add_qt6_dependencies(hook_file)
    binaries = [(src, dest) for src, dest in binaries if plugin_kept(src, dest)]
    datas = [(src, dest) for src, dest in datas if "translations" not in PurePath(dest).parts]
    return hiddenimports, binaries, datas
