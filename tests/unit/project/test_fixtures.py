"""The project's own input cases (tests/fixtures/cases) are byte-identical copies of ../shared/cases."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.shared


def test_input_cases_match_shared_cases_byte_for_byte(input_cases, shared_dir):
    shared = shared_dir / "cases" / "chats"
    if not shared.is_dir():
        pytest.skip(f"needs ../shared/cases/chats ({shared}): the project's own fixtures cover the cases")
    ours = {p.name: p.read_bytes() for p in sorted((input_cases / "chats").iterdir()) if p.is_file()}
    theirs = {p.name: p.read_bytes() for p in sorted(shared.iterdir()) if p.is_file()}
    assert sorted(ours) == sorted(theirs), "tests/fixtures/cases/chats and ../shared/cases/chats hold different files"
    differ = [name for name in ours if ours[name] != theirs[name]]
    assert not differ, f"differ from ../shared/cases/chats: {differ} (re-copy with cp, not a text rewrite)"
