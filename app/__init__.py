"""Zero-TVM Desktop's PySide6 GUI: the only package that imports Qt (it arrives with the app issue)."""
