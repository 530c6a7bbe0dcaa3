# Windows release build (PowerShell). Run in the Python environment the app is installed in (pip install -e .)
# with PyInstaller added (pip install pyinstaller); Inno Setup 6 (https://jrsoftware.org/isinfo.php) makes the
# installer. Produces
#   dist\zerotvm-chat\                                   the one-folder app (zerotvm-chat.exe, zerotvm.exe, _internal\)
#   dist\zerotvm-chat-<version>-windows-x64.zip          that folder, portable (unzip and run)
#   dist\zerotvm-chat-<version>-windows-x64-setup.exe    the per-user installer (packaging\windows\zerotvm.iss)
# zerotvm-chat.exe is a windowed program (no console); zerotvm.exe is the console CLI.
$ErrorActionPreference = "Stop"
$root = (Resolve-Path (Join-Path $PSScriptRoot "..\..")).Path
Set-Location $root
$py = if ($env:PYTHON) { $env:PYTHON } else { "python" }

& $py -c "import PyInstaller"
if ($LASTEXITCODE -ne 0) { throw "PyInstaller is missing: $py -m pip install pyinstaller" }
$version = (& $py -c "from engine import pyproject_version; print(pyproject_version('pyproject.toml'))").Trim()
if (-not $version) { throw "no version in pyproject.toml" }

& $py -m PyInstaller --noconfirm --clean --log-level WARN installer.spec
if ($LASTEXITCODE -ne 0) { throw "PyInstaller failed" }
$bundle = Join-Path $root "dist\zerotvm-chat"
& (Join-Path $bundle "zerotvm.exe") --version
if ($LASTEXITCODE -ne 0) { throw "the frozen CLI does not start" }

$zip = Join-Path $root "dist\zerotvm-chat-$version-windows-x64.zip"
if (Test-Path $zip) { Remove-Item $zip }
Compress-Archive -Path $bundle -DestinationPath $zip
Write-Host "built $zip"

$iscc = (Get-Command iscc.exe -ErrorAction SilentlyContinue).Source
if (-not $iscc) {
    foreach ($dir in @(${env:ProgramFiles(x86)}, $env:ProgramFiles, (Join-Path $env:LOCALAPPDATA "Programs"))) {
        $candidate = Join-Path $dir "Inno Setup 6\ISCC.exe"
        if ($dir -and (Test-Path $candidate)) { $iscc = $candidate; break }
    }
}
if (-not $iscc) {
    Write-Warning "Inno Setup 6 not found (winget install JRSoftware.InnoSetup); skipped the installer"
    exit 0
}
& $iscc "/DAppVersion=$version" "/DSourceDir=$bundle" "/DIconFile=$root\build\installer\zerotvm.ico" `
    "/DOutputDir=$root\dist" (Join-Path $root "packaging\windows\zerotvm.iss")
if ($LASTEXITCODE -ne 0) { throw "Inno Setup failed" }
Write-Host "built dist\zerotvm-chat-$version-windows-x64-setup.exe"
