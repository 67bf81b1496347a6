"""The private FSDP2 / DTensor parts `parallel.dp.fsdp_internals` reaches for are all there.

A torch upgrade that moves one of them fails here, naming the attribute and the torch version,
rather than in a deferred reduce-scatter that silently does nothing on a pipeline mesh.
"""

from __future__ import annotations

from parallel.dp import fsdp_internals


def test_every_private_fsdp_attribute_we_use_exists() -> None:
    gone = fsdp_internals.missing()
    assert not gone, "\n".join(gone)


def test_missing_names_the_attribute_and_the_torch_version(monkeypatch) -> None:
    """The check can fail: with one attribute taken away it names it and the version."""
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    monkeypatch.delattr(_fsdp_param_group.FSDPParamGroup, "post_backward")
    (line,) = fsdp_internals.missing()
    assert "FSDPParamGroup.post_backward" in line and torch.__version__ in line, line
