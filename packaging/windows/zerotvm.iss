; Inno Setup 6 script for Zero-TVM Desktop: a per-user installer (no administrator rights needed).
; build_windows.ps1 compiles it after PyInstaller, passing the version from pyproject.toml:
;   iscc /DAppVersion=0.1.0 /DSourceDir=...\dist\zerotvm-chat /DIconFile=...\build\installer\zerotvm.ico
;        /DOutputDir=...\dist packaging\windows\zerotvm.iss
; It installs into %LOCALAPPDATA%\Programs\Zero-TVM, adds a Start-menu shortcut, optionally a desktop icon, and
; registers an uninstaller (Settings > Apps). Chats, settings and models live in %LOCALAPPDATA%\ZeroTVM and are
; kept on uninstall.

#ifndef AppVersion
  #error Pass the version: iscc /DAppVersion=X.Y.Z (build_windows.ps1 does)
#endif
#ifndef SourceDir
  #define SourceDir "..\..\dist\zerotvm-chat"
#endif
#ifndef IconFile
  #define IconFile "..\..\build\installer\zerotvm.ico"
#endif
#ifndef OutputDir
  #define OutputDir "..\..\dist"
#endif
#define AppName "Zero-TVM"
#define AppExe "zerotvm-chat.exe"

[Setup]
; AppId identifies the app across versions (upgrades replace, the uninstaller finds it): never change it.
AppId={{B9A3B1A4-197A-405B-B999-8D37D7C7F0AE}
AppName={#AppName}
AppVersion={#AppVersion}
AppVerName={#AppName} {#AppVersion}
AppPublisher=Zero-TVM
AppComments=Private LLM chat on your own GPU
VersionInfoVersion={#AppVersion}
PrivilegesRequired=lowest
DefaultDirName={autopf}\{#AppName}
DefaultGroupName={#AppName}
DisableProgramGroupPage=yes
UninstallDisplayName={#AppName} {#AppVersion}
UninstallDisplayIcon={app}\{#AppExe}
SetupIconFile={#IconFile}
OutputDir={#OutputDir}
OutputBaseFilename=zerotvm-chat-{#AppVersion}-windows-x64-setup
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
Compression=lzma2/max
SolidCompression=yes
WizardStyle=modern
CloseApplications=yes

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[InstallDelete]
; An upgrade starts from a clean program folder, so no library of the previous version lingers next to the new.
Type: filesandordirs; Name: "{app}\_internal"

[Files]
Source: "{#SourceDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{autoprograms}\{#AppName}"; Filename: "{app}\{#AppExe}"; Comment: "Private LLM chat on your own GPU"
Name: "{autodesktop}\{#AppName}"; Filename: "{app}\{#AppExe}"; Tasks: desktopicon

[Run]
Filename: "{app}\{#AppExe}"; Description: "{cm:LaunchProgram,{#AppName}}"; Flags: nowait postinstall skipifsilent
