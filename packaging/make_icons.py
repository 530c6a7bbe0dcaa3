"""The app icon: resources/icons/zerotvm.svg rendered to PNGs, and packed into .ico (Windows) and .icns (macOS).

    python packaging/make_icons.py                 # re-render resources/icons/zerotvm-<N>.png (needs PySide6)
    python packaging/make_icons.py --ico OUT.ico   # pack the PNGs into a Windows icon (stdlib only)
    python packaging/make_icons.py --icns OUT.icns # pack the PNGs into a macOS icon (stdlib only)

.ico and .icns both store PNG data as is (Windows Vista+, macOS 10.7+), so no Pillow or iconutil is needed.
The PNGs are committed; the .ico/.icns are build outputs (installer.spec writes them into build/).
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ICON_DIR = ROOT / "resources" / "icons"
SVG = ICON_DIR / "zerotvm.svg"
SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
ICO_SIZES = (16, 24, 32, 48, 64, 128, 256)
# icns chunk types whose payload may be PNG data, with the pixel size each holds.
ICNS_TYPES = ((b"icp4", 16), (b"icp5", 32), (b"icp6", 64), (b"ic07", 128), (b"ic08", 256), (b"ic09", 512),
              (b"ic11", 32), (b"ic12", 64), (b"ic13", 256), (b"ic14", 512))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_path(size: int, folder: Path = ICON_DIR) -> Path:
    return folder / f"zerotvm-{size}.png"


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if data[:8] != PNG_MAGIC or data[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    return struct.unpack(">II", data[16:24])


def render_pngs(svg: Path = SVG, folder: Path = ICON_DIR, sizes=SIZES) -> list[Path]:
    """Draw the SVG at every size with Qt's SVG renderer (antialiased, transparent background)."""
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    _app = QGuiApplication.instance() or QGuiApplication(["make_icons", "-platform", "offscreen"])  # noqa: F841
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"{svg}: not a valid SVG for QSvgRenderer")
    out = []
    for size in sizes:
        image = QImage(size, size, QImage.Format.Format_ARGB32)
        image.fill(Qt.GlobalColor.transparent)
        painter = QPainter(image)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform)
        renderer.render(painter)
        painter.end()
        path = png_path(size, folder)
        if not image.save(str(path), "PNG"):
            raise SystemExit(f"could not write {path}")
        out.append(path)
    return out


def _pngs(folder: Path, sizes) -> list[tuple[int, bytes]]:
    found = []
    for size in sizes:
        data = png_path(size, folder).read_bytes()
        if png_size(data) != (size, size):
            raise ValueError(f"{png_path(size, folder)} is {png_size(data)}, expected {size}x{size}")
        found.append((size, data))
    return found


def write_ico(out: Path, folder: Path = ICON_DIR, sizes=ICO_SIZES) -> Path:
    """A Windows .ico whose entries are the PNG files (ICONDIR, ICONDIRENTRY per size, then the PNG bytes)."""
    images = _pngs(folder, sizes)
    header = struct.pack("<HHH", 0, 1, len(images))
    offset = 6 + 16 * len(images)
    entries, blobs = b"", b""
    for size, data in images:
        dim = 0 if size >= 256 else size  # 0 means 256 in an ICONDIRENTRY
        entries += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(data), offset + len(blobs))
        blobs += data
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(header + entries + blobs)
    return out


def write_icns(out: Path, folder: Path = ICON_DIR) -> Path:
    """A macOS .icns: 'icns' + total length, then one (type, length, PNG bytes) chunk per size."""
    available = {size: png_path(size, folder).read_bytes() for size in SIZES if png_path(size, folder).exists()}
    chunks = b""
    for kind, size in ICNS_TYPES:
        if size in available:
            data = available[size]
            chunks += kind + struct.pack(">I", 8 + len(data)) + data
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(b"icns" + struct.pack(">I", 8 + len(chunks)) + chunks)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ico", type=Path, help="write a Windows .ico from the PNGs")
    p.add_argument("--icns", type=Path, help="write a macOS .icns from the PNGs")
    args = p.parse_args(argv)
    if not args.ico and not args.icns:
        for path in render_pngs():
            print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")
    if args.ico:
        print(f"wrote {write_ico(args.ico)}")
    if args.icns:
        print(f"wrote {write_icns(args.icns)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
