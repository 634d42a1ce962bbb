"""The AWS shared config and credentials files, read as the AWS CLI and SDKs read them (obstore reads
only the environment): `AWS_PROFILE` (else "default") picks a profile of `~/.aws/credentials`
(`$AWS_SHARED_CREDENTIALS_FILE`) and of `~/.aws/config` (`$AWS_CONFIG_FILE`, whose sections are
`[profile NAME]`, and `[default]`). The environment wins over the files, key by key, as in the SDKs.
"""

from __future__ import annotations

import configparser
import os
from pathlib import Path

from dsc.errors import StorageError

# obstore's S3 config key -> (environment variables, in order of precedence; key in the files)
SETTINGS = {
    "access_key_id": (("AWS_ACCESS_KEY_ID",), "aws_access_key_id"),
    "secret_access_key": (("AWS_SECRET_ACCESS_KEY",), "aws_secret_access_key"),
    "session_token": (("AWS_SESSION_TOKEN",), "aws_session_token"),
    "region": (("AWS_REGION", "AWS_DEFAULT_REGION"), "region"),
    "endpoint": (("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"), "endpoint_url"),
}


def _read(path: Path, section: str, what: str) -> dict[str, str]:
    """The keys of one section of an INI file; {} when the file or the section is not there."""
    parser = configparser.RawConfigParser()
    try:
        parser.read(path, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError) as e:
        raise StorageError(f"{path}: not a readable AWS {what} file ({str(e).splitlines()[0]})") from e
    return dict(parser.items(section)) if parser.has_section(section) else {}


def settings() -> dict[str, str]:
    """obstore's S3 config from the environment and the profile's files (the environment first)."""
    profile = os.environ.get("AWS_PROFILE") or "default"
    home = Path(os.path.expanduser("~")) / ".aws"
    credentials = _read(Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or home / "credentials"), profile,
                        "credentials")
    config_path = Path(os.environ.get("AWS_CONFIG_FILE") or home / "config")
    config = _read(config_path, profile if profile == "default" else f"profile {profile}", "config")
    if os.environ.get("AWS_PROFILE") and not credentials and not config:
        raise StorageError(f"AWS_PROFILE={profile}: no such profile in {config_path} or the credentials file")
    found = {}
    for key, (names, file_key) in SETTINGS.items():
        value = next((os.environ[n] for n in names if os.environ.get(n)), None)
        value = value or credentials.get(file_key) or config.get(file_key)
        if value:
            found[key] = value
    # The S3 client reads the environment too: an empty endpoint or region that nothing else replaces becomes a
    # broken URL (or a panic), and an empty AWS_ENDPOINT_URL_S3 panics whatever else is given.
    for key in ("endpoint", "region"):
        for name in SETTINGS[key][0]:
            empty = name in os.environ and not os.environ[name].strip()
            if empty and (key not in found or name == "AWS_ENDPOINT_URL_S3"):
                raise StorageError(f"{name} is set but empty: unset it, or give it a value")
    return found
