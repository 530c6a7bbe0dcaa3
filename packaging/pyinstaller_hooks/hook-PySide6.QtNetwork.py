# PyInstaller's own PySide6.QtNetwork hook, minus the Qt plugins and translations the app does not use
# (the lists are in _qt_select.py). installer.spec puts this folder in hookspath, which overrides the built-in hook.
import importlib.util
import os

_here = os.path.dirname(__file__)
_spec = importlib.util.spec_from_file_location("_zerotvm_qt_select", os.path.join(_here, "_qt_select.py"))
_select = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_select)

hiddenimports, binaries, datas = _select.collect(__file__)
