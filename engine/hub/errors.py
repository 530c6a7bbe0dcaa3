"""Errors of the download half. Messages are plain words naming the repo, revision and file."""

from engine.errors import ZeroTVMError


class DownloadError(ZeroTVMError):
    """A download that cannot go on: network, disk space, access, integrity, or a folder that is not ours."""


class DownloadCancelled(ZeroTVMError):
    """The user cancelled; the partial files stay so the next download_model call resumes."""


class TokenError(ZeroTVMError):
    """The Hugging Face token cannot be read or stored (no keyring backend), or is malformed."""
