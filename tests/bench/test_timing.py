"""``card_tag``: the short machine name a result file carries."""

import pytest
import torch

from wide.bench.timing import card_tag


@pytest.mark.parametrize(
    "name, tag",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "nvidia-a100-sxm4-80gb"),
    ],
)
def test_card_tag_names_the_gpu(monkeypatch, name, tag):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert card_tag() == tag
    assert card_tag("cpu") == "cpu"


def test_card_tag_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert card_tag() == "cpu"
