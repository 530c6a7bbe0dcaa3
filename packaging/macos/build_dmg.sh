#!/usr/bin/env bash
# macOS release build. Run in the Python environment the app is installed in (pip install -e .) with PyInstaller
# added (pip install pyinstaller). Produces
#   dist/Zero-TVM.app                                   the app (Info.plist values from packaging/macos/Info.plist)
#   dist/zerotvm-chat/                                  the same one-folder build, unwrapped
#   dist/zerotvm-chat-<version>-macos-<arch>.dmg        a compressed disk image: drag Zero-TVM to Applications
# PyInstaller signs the app ad hoc, which runs on this Mac; to ship it to others set CODESIGN_IDENTITY to a
# "Developer ID Application: ..." identity (then notarize the .dmg with `xcrun notarytool`). The arch is the
# build Python's (arm64 or x86_64).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}

"$PY" -c "import PyInstaller" 2>/dev/null || { echo "PyInstaller is missing: $PY -m pip install pyinstaller" >&2; exit 1; }
version=$("$PY" -c 'from engine import pyproject_version; print(pyproject_version("pyproject.toml"))')
arch=$("$PY" -c 'import platform; print(platform.machine())')

"$PY" -m PyInstaller --noconfirm --clean --log-level WARN installer.spec
app=dist/Zero-TVM.app
[ -d "$app" ] || { echo "PyInstaller made no $app" >&2; exit 1; }
if [ -n "${CODESIGN_IDENTITY:-}" ]; then
    codesign --force --deep --timestamp --sign "$CODESIGN_IDENTITY" "$app"
fi
"$app/Contents/MacOS/zerotvm-chat" --version

stage=build/dmg
rm -rf "$stage"
mkdir -p "$stage"
ditto "$app" "$stage/Zero-TVM.app"
ln -s /Applications "$stage/Applications"
dmg="dist/zerotvm-chat-$version-macos-$arch.dmg"
rm -f "$dmg"
hdiutil create -volname "Zero-TVM $version" -srcfolder "$stage" -fs HFS+ -format UDZO -ov "$dmg"
echo "built $dmg ($(du -h "$dmg" | cut -f1); app $(du -sh "$app" | cut -f1))"
