#!/bin/sh
# Install Zero-TVM for this user, no root needed:
#   the app          ~/.local/lib/zerotvm-chat/           (this archive's zerotvm-chat/ folder)
#   launchers        ~/.local/bin/zerotvm-chat, ~/.local/bin/zerotvm   (symlinks)
#   desktop entry    ~/.local/share/applications/zerotvm-chat.desktop
#   icons            ~/.local/share/icons/hicolor/*/apps/zerotvm-chat.{png,svg}
# `./install.sh --uninstall` (or ~/.local/lib/zerotvm-chat/uninstall.sh) removes exactly these. Chats, settings and
# models live in ~/.local/share/ZeroTVM and are never touched. PREFIX=/some/dir installs there instead of ~/.local.
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
if [ -n "${PREFIX:-}" ]; then
    DATA=$PREFIX/share
else
    PREFIX=$HOME/.local
    DATA=${XDG_DATA_HOME:-$HOME/.local/share}
fi
LIB=$PREFIX/lib/zerotvm-chat
BIN=$PREFIX/bin
APPS=$DATA/applications
ICONS=$DATA/icons/hicolor
SIZES="16 24 32 48 64 128 256 512"

refresh() {
    command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database -q "$APPS" 2>/dev/null || true
    command -v gtk-update-icon-cache >/dev/null 2>&1 && gtk-update-icon-cache -q -t "$ICONS" 2>/dev/null || true
    return 0
}

# A launcher is ours when it is a symlink into $LIB; anything else (say a `pip install --user` script) is left be.
ours() {
    [ -L "$1" ] && case "$(readlink "$1")" in "$LIB"/*) return 0 ;; esac
    return 1
}

uninstall() {
    for prog in zerotvm-chat zerotvm; do
        if ours "$BIN/$prog"; then rm -f "$BIN/$prog"; fi
    done
    rm -f "$APPS/zerotvm-chat.desktop" "$ICONS/scalable/apps/zerotvm-chat.svg"
    for size in $SIZES; do rm -f "$ICONS/${size}x${size}/apps/zerotvm-chat.png"; done
    rm -rf "$LIB"
    refresh
    echo "Zero-TVM removed. Your chats, settings and models are still in ${XDG_DATA_HOME:-$HOME/.local/share}/ZeroTVM."
}

case "$(basename "$0") ${1:-}" in
    "uninstall.sh "* | *" --uninstall") uninstall; exit 0 ;;
    *" -h" | *" --help") sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *" ") ;;
    *) echo "usage: $0 [--uninstall]" >&2; exit 2 ;;
esac

[ -x "$HERE/zerotvm-chat/zerotvm-chat" ] || { echo "no zerotvm-chat/ app folder next to $0" >&2; exit 1; }

# The app: copied beside the old one, then swapped in, so a failed copy never leaves half an install.
mkdir -p "$PREFIX/lib" "$BIN" "$APPS"
rm -rf "$LIB.new" "$LIB.old"
cp -R "$HERE/zerotvm-chat" "$LIB.new"
cp "$HERE/install.sh" "$LIB.new/uninstall.sh"
chmod +x "$LIB.new/uninstall.sh"
if [ -e "$LIB" ]; then mv "$LIB" "$LIB.old"; fi
mv "$LIB.new" "$LIB"
rm -rf "$LIB.old"

for prog in zerotvm-chat zerotvm; do
    if [ -e "$BIN/$prog" ] || [ -L "$BIN/$prog" ]; then
        if ! ours "$BIN/$prog"; then
            echo "note: $BIN/$prog exists and is not from this installer; left as it is" >&2
            continue
        fi
    fi
    ln -sfn "$LIB/$prog" "$BIN/$prog"
done

# The desktop entry runs the installed program by its full path (~/.local/bin need not be on PATH).
sed -e "s|^Exec=.*|Exec=\"$LIB/zerotvm-chat\"|" -e "s|^TryExec=.*|TryExec=$LIB/zerotvm-chat|" \
    "$HERE/zerotvm-chat.desktop" > "$APPS/zerotvm-chat.desktop"
chmod 644 "$APPS/zerotvm-chat.desktop"

for size in $SIZES; do
    mkdir -p "$ICONS/${size}x${size}/apps"
    cp "$HERE/icons/hicolor/${size}x${size}/apps/zerotvm-chat.png" "$ICONS/${size}x${size}/apps/"
done
mkdir -p "$ICONS/scalable/apps"
cp "$HERE/icons/hicolor/scalable/apps/zerotvm-chat.svg" "$ICONS/scalable/apps/"
refresh

echo "Zero-TVM $("$LIB/zerotvm-chat" --version 2>/dev/null | awk '{print $2}') installed in $LIB"
echo "Start it from the application menu, or run: $BIN/zerotvm-chat"
case ":$PATH:" in *":$BIN:"*) ;; *) echo "($BIN is not on your PATH; add it to run zerotvm-chat and zerotvm by name)" ;; esac
