"""The harness reads what a press can do from one registry (issue 16): ``evaluation/registry.py``.

A grep of ``evaluation/`` (the harness; the analyses aside: paper 000's UOR study under ``evaluation/uor`` and the
studies of named presses under ``evaluation/studies``) finds
``isinstance`` on a press class, a press class name, or a press config name only in the registry, and the
uncompressed baseline ``no_press`` only where run directories are named.
"""

from __future__ import annotations

import re
from pathlib import Path

import kvpress
import pytest
from kvpress import (
    AdaKVPress,
    ComposedPress,
    KnormPress,
    ObservedAttentionPress,
    PrefillDecodingPress,
    PyramidKVPress,
    SnapKVPress,
)

from evaluation.registry import UNKNOWN, capabilities
from presses import EntroPrefillPress, PageEntroKVPress, ProbabilisticEvictionPress

ROOT = Path(__file__).resolve().parent.parent
ANALYSES = {"uor", "studies"}  # they study named presses; the harness runs any press
ANALYSES |= {"train_scorers"}  # trains KVzap's scorers on KVzip's scores (issue 64)
HARNESS = [p for p in sorted((ROOT / "evaluation").rglob("*.py")) if not ANALYSES & set(p.relative_to(ROOT).parts)]
PRESS_CLASSES = sorted(
    {name for name in dir(kvpress) if name.endswith("Press") and name != "BasePress"}
    | {"PageEntroKVPress", "ProbabilisticEvictionPress", "EntroPrefillPress", "ResearchPress", "KVzipPagePress"}
)
CONFIG_NAMES = sorted(p.stem for p in (ROOT / "configs" / "press").glob("*.yaml") if p.stem != "no_press")


def test_capabilities():
    assert capabilities(None).shares_prefill
    assert capabilities(KnormPress(0.5)).shares_prefill and not capabilities(KnormPress(0.5)).decode_state
    assert capabilities(ObservedAttentionPress(0.5)).needs_eager
    assert capabilities(ObservedAttentionPress(0.5)).shares_prefill  # on an eager capture (evaluation.replay)
    assert not capabilities(PyramidKVPress(0.5)).shares_prefill and capabilities(PyramidKVPress(0.5)).uneven_layers
    assert capabilities(AdaKVPress(PyramidKVPress(0.5))).uneven_layers
    assert not capabilities(SnapKVPress(0.5)).uneven_layers
    assert capabilities(PageEntroKVPress(0.5)).shares_prefill
    snis = capabilities(ProbabilisticEvictionPress(0.5))
    assert snis.shares_prefill and snis.decode_state
    entro = capabilities(EntroPrefillPress())
    assert entro.needs_question and entro.changes_prefill and not entro.shares_prefill
    assert capabilities(AdaKVPress(ObservedAttentionPress(0.5))).needs_eager
    assert not capabilities(AdaKVPress(SnapKVPress(0.5))).shares_prefill
    assert capabilities(ComposedPress([ProbabilisticEvictionPress(0.5), KnormPress(0.5)])).decode_state
    assert not capabilities(PrefillDecodingPress(prefilling_press=EntroPrefillPress())).shares_prefill

    class Mine(kvpress.BasePress):
        pass

    assert capabilities(Mine()) == UNKNOWN


@pytest.mark.parametrize("path", HARNESS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_harness_recognises_presses_only_through_the_registry(path):
    if path.name == "registry.py":
        return
    text = path.read_text()
    classes = [c for c in PRESS_CLASSES if re.search(rf"\b{c}\b", text)]
    names = [n for n in CONFIG_NAMES if re.search(rf"""["'`=\[,]{n}\b""", text)]
    press_isinstance = re.findall(r"isinstance\([^)]*Press\b", text)
    assert not classes and not names and not press_isinstance, (classes, names, press_isinstance)
    if "no_press" in text:
        assert path.name in ("harness.py", "fused.py", "report.py"), "no_press outside the run-directory naming"


# ------------------------------------------------------------------ kvpress 0.5.5's other presses (issue 29)
# config name -> (shares a prefill, needs eager attention, runs extra forward passes)
FRONTIER = {
    "chunkkv": (True, False, False),
    "entropy_gated_chunkkv": (True, False, False),
    "chunk": (True, False, False),
    "block_keydiff": (True, False, False),
    "keydiff": (True, False, False),
    "compactor": (True, False, False),
    "leverage": (True, False, False),
    "non_causal_attn": (True, False, False),
    "lagkv": (True, False, False),
    "cur": (True, False, False),
    "random": (True, False, False),
    "capkv": (True, False, False),
    "criticalkv": (True, False, False),
    "merging": (True, False, False),
    "think": (True, False, False),
    "critical_adakv": (False, False, False),
    "key_rerotation": (False, False, False),
    "kvgrad": (False, False, True),
    "qfilter": (True, False, False),
    "kvzap": (True, False, False),
    "kvzap_linear": (True, False, False),
    "kvzap_mlp": (True, False, False),
    "expected_attention_stats": (True, False, False),
    "dms": (False, False, False),
    "dms_linear": (False, False, False),
    "fastkvzip": (False, False, False),
    "duo_attention": (False, False, False),
    "lukv": (False, False, False),
}


def _press(name: str, ratio: float = 0.5, *overrides: str):
    from hydra.utils import instantiate

    from evaluation import harness

    return instantiate(harness.compose_config([f"press={name}", f"compression_ratio={ratio}", *overrides]).press)


@pytest.mark.parametrize("name", sorted(FRONTIER))
def test_capabilities_of_kvpress_presses(name):
    from evaluation.registry import sharing_problem

    caps = capabilities(_press(name))
    assert (caps.shares_prefill, caps.needs_eager, caps.extra_forwards) == FRONTIER[name]
    assert not caps.decode_state and not caps.needs_question and not caps.changes_prefill
    assert (sharing_problem(_press(name)) is None) == caps.shares_prefill


def test_wrappers_follow_their_scorer_and_say_why_they_cannot_share():
    from kvpress import (
        CAMPress,
        ChunkKVPress,
        CriticalKVPress,
        EntropyGatedChunkKVPress,
        KVComposePress,
        MergingPress,
        TOVAPress,
    )

    from evaluation.registry import sharing_problem

    assert capabilities(CriticalKVPress(ObservedAttentionPress(0.5))).needs_eager  # CriticalKV is itself a scorer
    assert capabilities(MergingPress(ObservedAttentionPress(0.5))).needs_eager
    assert not capabilities(ChunkKVPress(PyramidKVPress(0.5))).shares_prefill
    assert capabilities(EntropyGatedChunkKVPress(TOVAPress(0.5))).shares_prefill
    assert "per layer" in sharing_problem(ChunkKVPress(PyramidKVPress(0.5)))
    assert "per layer" in sharing_problem(ComposedPress([KnormPress(0.5), PyramidKVPress(0.5)]))
    assert "masks evicted keys per head" in sharing_problem(AdaKVPress(SnapKVPress(0.5)))
    assert "while decoding" in sharing_problem(CAMPress(KnormPress()))
    compose = KVComposePress(compression_ratio=0.5)
    assert capabilities(compose).extra_forwards and "second time" in sharing_problem(compose)
    assert "a backward pass" in sharing_problem(_press("kvgrad"))
    assert "changes the prefill" in sharing_problem(EntroPrefillPress())
