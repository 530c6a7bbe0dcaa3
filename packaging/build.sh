#!/usr/bin/env bash
# Build the installable app for the OS this runs on; the README's "Build installers" section says what each makes.
#   Linux    packaging/linux/build_linux.sh      -> dist/zerotvm-chat-<version>-linux-<arch>.tar.gz
#   macOS    packaging/macos/build_dmg.sh        -> dist/Zero-TVM.app, dist/zerotvm-chat-<version>-macos-<arch>.dmg
#   Windows  packaging/windows/build_windows.ps1 -> dist/zerotvm-chat-<version>-windows-x64-setup.exe (+ .zip)
#            (from Git Bash / MSYS; or run the .ps1 in PowerShell directly)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
case "$(uname -s)" in
    Linux) exec bash "$here/linux/build_linux.sh" "$@" ;;
    Darwin) exec bash "$here/macos/build_dmg.sh" "$@" ;;
    MINGW* | MSYS* | CYGWIN*)
        exec powershell.exe -NoProfile -ExecutionPolicy Bypass -File "$(cygpath -w "$here/windows/build_windows.ps1")" "$@" ;;
    *) echo "packaging/build.sh: no build for $(uname -s)" >&2; exit 1 ;;
esac
