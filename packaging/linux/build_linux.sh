#!/usr/bin/env bash
# Linux release build. Run from anywhere, in the Python environment the app is installed in (pip install -e .)
# with PyInstaller added (pip install pyinstaller). Produces
#   dist/zerotvm-chat/                                  the one-folder app (zerotvm-chat, zerotvm, _internal/)
#   dist/zerotvm-chat-<version>-linux-<arch>.tar.gz     that folder + zerotvm-chat.desktop + icons + install.sh
#                                                       + AppRun (the unpacked folder is an AppDir)
#   dist/Zero-TVM-<version>-<arch>.AppImage             only when appimagetool is on PATH
# The bundle takes glibc, libstdc++, X11/xcb core, fontconfig and D-Bus from the user's system: build on the
# oldest distribution you want to support.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}

"$PY" -c "import PyInstaller" 2>/dev/null || { echo "PyInstaller is missing: $PY -m pip install pyinstaller" >&2; exit 1; }
version=$("$PY" -c 'from engine import pyproject_version; print(pyproject_version("pyproject.toml"))')
arch=$(uname -m)
name="zerotvm-chat-$version-linux-$arch"

# A self-test may have left the previous bundle read-only; PyInstaller has to be able to replace it.
if [ -d dist/zerotvm-chat ]; then chmod -R u+w dist/zerotvm-chat; fi
"$PY" -m PyInstaller --noconfirm --clean --log-level WARN installer.spec

# Source-built Pythons (pyenv) ship libpython with its debug info (~16 MB of the bundle): strip only that file;
# stripping the wheels' patchelf-ed libraries can break them.
for lib in dist/zerotvm-chat/_internal/libpython3*.so*; do
    if [ -f "$lib" ] && [ ! -L "$lib" ] && command -v strip >/dev/null; then strip --strip-debug "$lib"; fi
done

stage="build/linux/$name"
rm -rf build/linux
mkdir -p "$stage"
cp -a dist/zerotvm-chat "$stage/zerotvm-chat"
cp packaging/linux/zerotvm-chat.desktop packaging/linux/install.sh packaging/linux/AppRun "$stage/"
chmod 755 "$stage/install.sh" "$stage/AppRun"
for size in 16 24 32 48 64 128 256 512; do
    mkdir -p "$stage/icons/hicolor/${size}x${size}/apps"
    cp "resources/icons/zerotvm-$size.png" "$stage/icons/hicolor/${size}x${size}/apps/zerotvm-chat.png"
done
mkdir -p "$stage/icons/hicolor/scalable/apps"
cp resources/icons/zerotvm.svg "$stage/icons/hicolor/scalable/apps/zerotvm-chat.svg"
cp resources/icons/zerotvm-256.png "$stage/zerotvm-chat.png"  # the AppDir icon, named after Icon=
ln -s zerotvm-chat.png "$stage/.DirIcon"

tar -C build/linux --owner=0 --group=0 --numeric-owner -czf "dist/$name.tar.gz" "$name"
echo "built dist/$name.tar.gz ($(du -h "dist/$name.tar.gz" | cut -f1); app folder $(du -sh dist/zerotvm-chat | cut -f1))"

if command -v appimagetool >/dev/null; then
    ARCH="$arch" appimagetool --no-appstream "$stage" "dist/Zero-TVM-$version-$arch.AppImage"
    echo "built dist/Zero-TVM-$version-$arch.AppImage"
fi
