"""The Hugging Face token, kept in the system keyring (service "zerotvm", user "huggingface-token").

The token is never printed, logged or put in an error message; download_model hands it to huggingface_hub,
which sends it only to the Hub endpoint (never to the CDN a file redirects to).
"""

from __future__ import annotations

from engine.hub.errors import TokenError

SERVICE = "zerotvm"
USER = "huggingface-token"
_NO_STORE = "cannot store the Hugging Face token: {why}; set the HF_TOKEN environment variable instead"


def _why(error: Exception) -> str:
    from keyring.errors import NoKeyringError

    if isinstance(error, NoKeyringError):  # its own text is a paragraph about backend packages
        return "this system has no keyring (password store) that Zero-TVM can use"
    # Backend messages name the backend ("No recommended backend was available..."), not the secret.
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"the system keyring is not available ({type(error).__name__}{': ' + text if text else ''})"


def get_token() -> str | None:
    """The stored token, or None when none is stored or there is no keyring backend (headless Linux)."""
    import keyring

    try:
        value = keyring.get_password(SERVICE, USER)
    except Exception:  # any backend failure just means "no stored token"; HF_TOKEN still works
        return None
    return (value.strip() or None) if value else None


def set_token(token: str) -> None:
    """Store `token` (surrounding whitespace stripped). Raises TokenError if it is empty or cannot be stored."""
    import keyring

    token = (token or "").strip()
    if not token:
        raise TokenError("the Hugging Face token is empty")
    if any(c.isspace() for c in token):
        raise TokenError("the Hugging Face token contains spaces or line breaks; paste just the token")
    try:
        keyring.set_password(SERVICE, USER, token)
    except Exception as e:  # NoKeyringError, a locked or absent Secret Service, D-Bus errors...
        raise TokenError(_NO_STORE.format(why=_why(e))) from None


def keyring_problem() -> str | None:
    """Why no token can be kept in the system keyring here (no backend, a locked or absent Secret Service...),
    or None when the keyring answers."""
    import keyring

    try:
        keyring.get_password(SERVICE, USER)
    except Exception as e:
        return _why(e)
    return None


def clear_token() -> bool:
    """Forget the stored token: True when one was removed, False when none was stored (or there is no keyring at
    all, so none can have been stored). Raises TokenError when the keyring holds one but cannot delete it."""
    import keyring
    from keyring.errors import NoKeyringError, PasswordDeleteError

    try:
        keyring.delete_password(SERVICE, USER)
    except (PasswordDeleteError, NoKeyringError):
        return False
    except Exception as e:
        raise TokenError(f"cannot remove the Hugging Face token: {_why(e)}") from None
    return True


def resolve_token(token: str | bool | None) -> str | bool:
    """What download_model passes to huggingface_hub: an explicit string as is; False = anonymous;
    None or True = the keyring token, else HF_TOKEN / huggingface_hub's own login, else anonymous."""
    if isinstance(token, str):
        return token.strip() or False
    if token is False:
        return False
    stored = get_token()
    if stored:
        return stored
    from huggingface_hub import get_token as hf_get_token

    return hf_get_token() or False
