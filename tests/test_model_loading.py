"""evaluation.models.load_model keeps a log quiet: no weight-loading bar, the hub's download bars as they were."""

from __future__ import annotations

import huggingface_hub.utils as hub_utils
from _tiny_models import save_tiny_checkpoint
from _tiny_tokenizer import char_tokenizer_flavour
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from evaluation.models import load_model, quiet_weight_loading


def test_loading_prints_no_weight_bar_and_leaves_the_bars_as_they_were(tmp_path, capfd):
    checkpoint = tmp_path / "ckpt"
    save_tiny_checkpoint("smollm2-135m", checkpoint, char_tokenizer_flavour(bos=True, chat_template=True))
    hf_logging.enable_progress_bar()  # as a fresh process has them (hub bars too)
    capfd.readouterr()
    AutoModelForCausalLM.from_pretrained(checkpoint)  # transformers alone prints the bar: the check below can fail
    assert "Loading weights" in capfd.readouterr().err
    model, _ = load_model("smollm2-135m", path=str(checkpoint))
    assert model.config.num_hidden_layers == 2
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled() and not hub_utils.are_progress_bars_disabled()


def test_download_bars_stay_on_while_the_loading_bar_is_off():
    hf_logging.enable_progress_bar()
    with quiet_weight_loading():
        assert not hf_logging.is_progress_bar_enabled()
        assert not hub_utils.are_progress_bars_disabled()  # a download keeps its bar and ETA
    assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # switched off by the user: it stays off
    try:
        with quiet_weight_loading():
            assert hub_utils.are_progress_bars_disabled()
        assert not hf_logging.is_progress_bar_enabled() and hub_utils.are_progress_bars_disabled()
    finally:
        hf_logging.enable_progress_bar()
