"""Single random faults (bit flips, truncations, extensions, deletions, renames, swaps) in every cache file."""

from __future__ import annotations

from pathlib import Path

from .campaign import KINDS, corruption_campaign

CI_CASES = 200  # the long form runs 5000 and more


def test_corruption_campaign(work: Path) -> None:
    log: list[str] = []
    c = corruption_campaign(work, CI_CASES, seed=11, log=log.append)
    assert c["cases"] == CI_CASES
    assert c["crashes"] == 0, log
    assert c["full_missed"] == 0, log                     # --full detects every meaningful change
    assert c["full_detected"] + c["harmless"] == CI_CASES
    assert c["boot_detected_structural"] == c["structural"] > 0, log
    assert c["boot_said_verified_on_content"] == 0, c     # every flip here changes mtime: the boot check sees it
    seen = {k.removeprefix("kind_").replace("-size", "").replace("commit-missing", "delete") for k in c if k.startswith("kind_")}
    assert seen == set(KINDS), c
