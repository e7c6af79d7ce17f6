"""What importing atgrpo costs: the package's faces load no torch or transformers until a name
that needs them is used, so `import atgrpo.sandbox`, `import atgrpo.envs`, the config and the
CLI's help start in well under a second."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import atgrpo

HEAVY = ("torch", "transformers")


def _loaded(code: str) -> list[str]:
    """The heavy top-level packages loaded by ``code`` in a fresh interpreter."""
    listing = "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    probe = f"{code}\nimport json, sys\n{listing}"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return [m for m in json.loads(out.stdout.splitlines()[-1]) if m in HEAVY]


@pytest.mark.parametrize(
    "code",
    [
        "import atgrpo",
        "import atgrpo.sandbox",
        "import atgrpo.envs",
        "from atgrpo import load_config; load_config(None)",
    ],
)
def test_a_light_face_loads_no_torch(code: str) -> None:
    assert _loaded(code) == []


def test_every_public_name_resolves_and_is_listed_once() -> None:
    assert len(set(atgrpo.__all__)) == len(atgrpo.__all__)
    for name in atgrpo.__all__:
        assert getattr(atgrpo, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        atgrpo.nope  # noqa: B018


def test_the_cli_starts_light_and_names_its_expected_errors() -> None:
    from atgrpo import cli

    help_ = "from atgrpo.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"
    assert _loaded(help_) == []
    assert _loaded("from atgrpo.cli import main; main(['config', 'configs/tiny.yaml'])") == []
    for module, name in cli.EXPECTED_ERRORS.items():
        cls = getattr(__import__(module, fromlist=[name]), name)
        assert issubclass(cls, Exception), (module, name)
