"""The thinking switch stated (issue 63 item 4): a chat template that reads ``enable_thinking`` (Qwen3's) gets
``model.enable_thinking`` (off by default) in every prompt the harness builds, through kvpress's pipeline
(``evaluation.run``) and its ``preprocess`` (``evaluation.fused``), and the run's ``config.yaml`` records it; a
template without the switch gets today's prompt, bit for bit, and refuses ``model.enable_thinking=true``; a committed
run, saved before the key existed, is still found finished.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from _tiny_models import make_tiny_family
from _tiny_tokenizer import CHATML_TEMPLATE, char_tokenizer_flavour
from kvpress import KVPressTextGenerationPipeline
from omegaconf import OmegaConf
from test_harness import composed

from evaluation import harness
from evaluation import run as entry
from evaluation.loop import evaluate
from evaluation.pipeline import TextGenerationPipeline, has_thinking_switch

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent
NAMES = {"press": "knorm", "dataset": "needle", "model": "smollm2-135m"}
SMALL = ["n_samples=1", "max_new_tokens=2", "dataset.context_length=200", "dataset.depths=[50]"]
EMPTY_THINK = "<think>\n\n</think>\n\n"

#: The generation prompt of Qwen3's chat template: an empty think block when the switch is off.
QWEN3_TEMPLATE = (
    r"{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    r"{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    r"{%- endif %}"
)


def _tokenizer(template: str | None):
    tok = char_tokenizer_flavour(bos=False, chat_template=False)
    tok.chat_template = template
    return tok


@pytest.fixture
def qwen3(monkeypatch):
    """A tiny random Qwen3 with a BOS-less character tokenizer holding Qwen3's switch, loaded for the default model
    config (whose name the run directories carry); every generation prompt its tokenizer renders is recorded."""
    model, tok = make_tiny_family("qwen3-4b", vocab=128, seed=1), _tokenizer(QWEN3_TEMPLATE)
    prompts = []
    render = tok.apply_chat_template

    def recorded(conversation, *args, **kwargs):
        text = render(conversation, *args, **kwargs)
        if kwargs.get("add_generation_prompt"):
            prompts.append(text)
        return text

    monkeypatch.setattr(tok, "apply_chat_template", recorded)
    monkeypatch.setattr(harness, "get_model", lambda *args, **kwargs: (model, tok))
    return prompts


def test_the_switch_is_found_in_the_template():
    assert has_thinking_switch(_tokenizer(QWEN3_TEMPLATE))
    assert not has_thinking_switch(_tokenizer(CHATML_TEMPLATE)) and not has_thinking_switch(_tokenizer(None))
    # a name in a comment or a string is not a switch the template reads
    assert not has_thinking_switch(_tokenizer(CHATML_TEMPLATE + "{# enable_thinking #}"))


@pytest.mark.parametrize("shared_prefill", [False, True], ids=["run", "fused"])
def test_every_prompt_states_the_switch(qwen3, tmp_path, shared_prefill):
    """Off by default: the prompt of each path (the pipeline's call, ``preprocess`` for the shared prefill) has the
    empty think block, as kvpress's default gave; ``model.enable_thinking=true`` has none; each run's config.yaml
    says which."""
    for thinking in (False, True):
        out = tmp_path / str(thinking)
        switch = ["model.enable_thinking=true"] if thinking else []
        cfg = composed("press=knorm", *SMALL, *switch, f"output_dir={out}")
        qwen3.clear()
        evaluate([(cfg, NAMES)], "test", shared_prefill=shared_prefill)
        assert qwen3 and all((EMPTY_THINK in p) is not thinking for p in qwen3), qwen3
        saved = OmegaConf.load(out / "needle/smollm2-135m/knorm/cr0.5/config.yaml")
        assert saved.model.enable_thinking is thinking


def test_a_template_without_the_switch_builds_todays_prompt():
    """``enable_thinking`` changes nothing for a template that does not read it: the harness's pipeline gives kvpress's
    own prompt ids (its ``preprocess`` before the harness stated the switch), with or without a template."""
    model = make_tiny_family("qwen3-4b", vocab=128, seed=1)
    for template in (CHATML_TEMPLATE, None):
        tok = _tokenizer(template)
        tok.bos_token = "<s>"  # kvpress's own preprocess prepends it without a template
        ours = TextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))
        kvpress = KVPressTextGenerationPipeline(model=model, tokenizer=copy.deepcopy(tok), device=torch.device("cpu"))
        args = ("A context of some words.", ["Which words?"], "Answer:", int(1e10))
        a, b = ours.preprocess(*args), kvpress.preprocess(*args)
        assert torch.equal(a["context_ids"], b["context_ids"])
        assert torch.equal(a["questions_ids"][0], b["questions_ids"][0])


def test_thinking_is_refused_for_a_template_without_the_switch(monkeypatch, tmp_path):
    model, tok = make_tiny_family("qwen3-4b", vocab=128, seed=1), _tokenizer(CHATML_TEMPLATE)
    monkeypatch.setattr(harness, "get_model", lambda *args, **kwargs: (model, tok))
    cfg = composed("press=knorm", *SMALL, "model.enable_thinking=true", f"output_dir={tmp_path}")
    with pytest.raises(
        ValueError, match=r"model.enable_thinking=true, but the chat template of model smollm2-135m has no"
    ):
        entry.run(cfg, NAMES)
    assert not (tmp_path / "needle").exists()  # before any run directory


def test_a_committed_run_saved_before_the_switch_is_still_finished():
    """A committed run's config.yaml predates ``model.enable_thinking``: it ran with kvpress's false, so today's
    default config finds it finished, and ``model.enable_thinking=true`` is another setting."""
    run_dir = ROOT / "results/needle/smollm2-135m/snapkv/cr0.5"
    assert "enable_thinking" not in (run_dir / "config.yaml").read_text()
    names = {"press": "snapkv", "dataset": "needle", "model": "smollm2-135m"}
    base = ["press=snapkv", "dataset=needle", "compression_ratio=0.5", f"output_dir={ROOT / 'results'}"]
    assert harness.check_existing_run(composed(*base), names) == harness.json.loads(
        (run_dir / "metrics.json").read_text()
    )
    with pytest.raises(ValueError, match=r"other settings \(model.enable_thinking: False -> True\)"):
        harness.check_existing_run(composed(*base, "model.enable_thinking=true"), names)
