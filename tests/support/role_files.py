"""The roles' YAML files as the role tests read them."""
from __future__ import annotations

import yaml

from tests.support.modules import REPO

SHARED = "modelswap_defaults"  # owns the modelswap_* variables and the role inputs other roles read


def load_yaml(path):
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def role_defaults(role: str) -> dict:
    """The role's public defaults: its own file's, and those of its inputs that other roles read
    too, which the shared owner defines (kubespray's rule)."""
    own = load_yaml(REPO / "roles" / role / "defaults" / "main.yml") or {}
    if role == SHARED:
        return own
    shared = load_yaml(REPO / "roles" / SHARED / "defaults" / "main.yml") or {}
    return {**{k: v for k, v in shared.items() if k.startswith(f"{role}_")}, **own}
