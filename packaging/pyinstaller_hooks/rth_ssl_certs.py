# PyInstaller runtime hook: give the frozen app's OpenSSL a CA bundle that exists on *this* machine.
#
# The bundled libssl looks for CA certificates where the build machine's OpenSSL keeps them (/usr/lib/ssl on
# Debian, a Homebrew prefix on macOS), which another distribution may not have. urllib (the demo model's
# download) would then fail certificate checks. When that folder/file is missing and the user set neither
# SSL_CERT_FILE nor SSL_CERT_DIR, point OpenSSL at the system's bundle, else at certifi's (bundled).
# httpx2 (Hub downloads) uses certifi by itself; Windows also reads its own certificate store.


def _pyi_rthook():
    import os
    import ssl

    if os.environ.get("SSL_CERT_FILE") or os.environ.get("SSL_CERT_DIR"):
        return
    paths = ssl.get_default_verify_paths()
    if (paths.cafile and os.path.isfile(paths.cafile)) or (paths.capath and os.path.isdir(paths.capath)
                                                           and os.listdir(paths.capath)):
        return
    for candidate in ("/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Arch, Gentoo
                      "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL
                      "/etc/ssl/ca-bundle.pem",  # openSUSE
                      "/etc/ssl/cert.pem"):  # macOS, Alpine
        if os.path.isfile(candidate):
            os.environ["SSL_CERT_FILE"] = candidate
            return
    try:
        import certifi

        os.environ["SSL_CERT_FILE"] = certifi.where()
    except Exception:
        pass


_pyi_rthook()
del _pyi_rthook
