"""The key that signs prepared plans (`maskc.prepare`), so that a call uses only plans made by
processes of the same user: a plan decides which kernel runs and which tiles it computes, so a
plan edited, corrupted, or made by someone else could make a result wrong without any error.

The key is `$MASKC_PLAN_KEY` (64 hex digits) where set, else the one in
`$XDG_CONFIG_HOME/maskc/plan-key` (default `~/.config/maskc/plan-key`), made on first use
with mode 0600; where that file cannot be made, a key for this process, which it puts in
`$MASKC_PLAN_KEY` so that DataLoader workers started afterwards share it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import tempfile
from functools import cache
from pathlib import Path

from maskc.errors import MaskcError

KEY_ENV = "MASKC_PLAN_KEY"
_KEY_BYTES = 32


def key_file() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "maskc" / "plan-key"


@cache
def plan_key() -> bytes:
    """This user's key (see the module docstring), read once per process."""
    value = os.environ.get(KEY_ENV)
    if value is not None:
        return _parse(value, f"${KEY_ENV}")
    path = key_file()
    try:
        return _parse(path.read_text(), str(path))
    except FileNotFoundError:
        pass
    except OSError:
        return _process_key()
    try:
        return _create(path)
    except OSError:
        return _process_key()


def key_id(key: bytes) -> bytes:
    """8 bytes that name a key without revealing it: which key signed a plan."""
    return hashlib.sha256(b"maskc plan key id\0" + key).digest()[:8]


def signature(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of `parts`, each length-prefixed (no two splits collide), cut to 16 bytes.
    SHA-256 rather than BLAKE2: CPUs hash it in hardware, 2 GB/s here, and a 1M-token plan is
    6 MB."""
    mac = hmac.new(key, digestmod="sha256")
    for part in parts:
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.digest()[:16]


def _parse(text: str, where: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != _KEY_BYTES:
        raise MaskcError(f"the plan key in {where} must be {2 * _KEY_BYTES} hex digits; delete or fix it")
    return key


def _create(path: Path) -> bytes:
    """A new key in `path`, written whole before it appears there (a link, which fails if another
    process made the file first: then that key is read)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".plan-key.")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(_KEY_BYTES) + "\n")
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass
    finally:
        os.unlink(temporary)
    return _parse(path.read_text(), str(path))


def _process_key() -> bytes:
    """A key for this process (and the processes it starts), where no key file can be used."""
    os.environ[KEY_ENV] = secrets.token_hex(_KEY_BYTES)
    return _parse(os.environ[KEY_ENV], f"${KEY_ENV}")
