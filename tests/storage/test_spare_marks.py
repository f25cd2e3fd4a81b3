"""A flush recycles only the chunk files retired before it began (`SpareFiles.mark`): a commit
made while its sync ran may not be durable yet, so its superseded blocks wait for the next
flush. Without the mark, a flush running behind the next step's writes would hand out blocks
a power loss could still need."""

from __future__ import annotations

import os

from tierzero.storage.nvme.spares import SpareFiles


def test_recycle_up_to_a_mark_keeps_later_retirements(tmp_path) -> None:
    spares = SpareFiles(str(tmp_path), chunk_bytes=4096)
    spares.open()
    old, later = tmp_path / "g1", tmp_path / "g2"
    for gen in (old, later):
        gen.mkdir()
        (gen / "0").write_bytes(b"x" * 4096)
    spares.retire([str(old / "0")], str(old))
    mark = spares.mark()  # a flush begins here
    spares.retire([str(later / "0")], str(later))  # a commit during its sync
    spares.recycle(mark)
    assert not old.exists() and (later / "0").exists()  # only the earlier one became a spare
    assert os.path.exists(spares.take())  # an idle spare: allocated blocks to write over
    spares.recycle()
    assert not later.exists()
    spares.close()
