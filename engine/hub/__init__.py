"""Model downloads from the Hugging Face Hub: `download.py` (download_model, is_installed, verify_installed,
remove_model), `token.py` (the token in the system keyring), `offline.py` (offline mode, no_network()).

Kept empty on purpose: importing engine.hub.offline from the load path must not pull in huggingface_hub.
"""
