"""The local tier's config keys: defaults, one-line errors naming the key and the fix."""

from __future__ import annotations

import pytest

from trainer.checkpointing import check_startup
from trainer.config import ConfigError, load_config


def _load(*overrides: str):
    return load_config(None, list(overrides))


def test_local_tier_is_off_by_default_and_takes_the_interval_grammar(tmp_path):
    c = _load(f"--checkpoint.root={tmp_path}/ckpt").checkpoint
    assert c.local_root == "" and c.local_interval == "auto" and c.local_keep_last == 2
    assert c.local_copies == 1
    c = _load(f"--checkpoint.root={tmp_path}/ckpt", "--checkpoint.local_root=/dev/shm/x-{node}",
              "--checkpoint.local_interval=5", "--checkpoint.interval=20",
              "--checkpoint.local_copies=2").checkpoint
    assert (c.local_root, c.local_interval, c.interval) == ("/dev/shm/x-{node}", "5", "20")
    assert c.local_copies == 2


@pytest.mark.parametrize("overrides, message", [
    (["--checkpoint.local_root={root}"], r"checkpoint\.local_root: .* is checkpoint\.root"),
    (["--checkpoint.local_root={root}/local"], r"checkpoint\.local_root: .*overlaps it"),
    (["--checkpoint.local_interval=often"], r"checkpoint\.local_interval: invalid checkpoint "
                                            r"interval 'often'"),
    (["--checkpoint.local_keep_last=0"], r"checkpoint\.local_keep_last: must be >= 1"),
    (["--checkpoint.node_loss_mtbf_hours=2", "--checkpoint.mtbf_hours=24"],
     r"checkpoint\.node_loss_mtbf_hours: .* below mtbf_hours.*set it >= mtbf_hours"),
    (["--checkpoint.local_root=/dev/shm/x", "--checkpoint.local_copies=3"],
     r"checkpoint\.local_copies: must be 1 or 2, got 3; .*2 also copies them to the next "
     r"node"),
    (["--checkpoint.local_root=/dev/shm/x", "--checkpoint.local_copies=0"],
     r"checkpoint\.local_copies: must be 1 or 2, got 0"),
    (["--checkpoint.local_copies=2"],
     r"checkpoint\.local_copies: is 2 but local_root is empty; .*set "
     r"checkpoint\.local_root too"),
])
def test_bad_local_tier_values_are_one_line_errors(tmp_path, overrides, message):
    root = str(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=message) as e:
        _load(f"--checkpoint.root={root}", *(o.format(root=root) for o in overrides))
    assert "\n" not in str(e.value)


def test_local_root_needs_a_durable_root():
    with pytest.raises(ConfigError, match=r"checkpoint\.local_root: is set but root is empty; "
                                          r"the local tier sits under a durable one"):
        _load("--checkpoint.local_root=/dev/shm/x")


def test_a_local_root_that_cannot_be_created_is_refused_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = _load(f"--checkpoint.root={tmp_path}/ckpt", f"--checkpoint.local_root={blocker}/ckpt")
    with pytest.raises(ConfigError, match=r"checkpoint\.local_root: cannot use .*file/ckpt: "
                                          r".*file is a file; set --checkpoint\.local_root"):
        check_startup(cfg)
    check_startup(_load(f"--checkpoint.root={tmp_path}/ckpt",
                        f"--checkpoint.local_root={tmp_path}/local-{{node}}"))  # creatable
