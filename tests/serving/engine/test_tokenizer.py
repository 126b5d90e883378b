"""IncrementalDetokenizer: UTF-8-safe streaming, byte fallback, stop strings never partly sent."""

from __future__ import annotations

import pytest

from serving.sampling_params import SamplingParams
from serving.engine.tokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def smol_tokenizer():
    from serving.checkpoint.default_model import default_model_path
    from serving.engine.tokenizer import load_tokenizer

    return load_tokenizer(str(default_model_path()))


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """A tiny Llama-2-style SentencePiece tokenizer: unknown chars become <0xNN> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzHEW,.!":
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def stream(tokenizer, text: str, prompt: str = "Say:", **params) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `text`'s ids one by one; returns the deltas sent (last one on finish)."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(**params))
    deltas = []
    for k, token_id in enumerate(ids):
        stop = det.append([token_id])
        finished = stop is not None or k == len(ids) - 1
        deltas.append(det.take_delta(finished))
        if finished:
            break
    return deltas, det


@pytest.mark.parametrize("text", ["你好，世界！今天天气很好。", "👍🏽 emoji 🎉 ok", "mixed 中文 and 😀 text\n  end"])
def test_utf8_streaming_never_sends_partial_chars(smol_tokenizer, text: str) -> None:
    deltas, det = stream(smol_tokenizer, " " + text)
    assert "".join(deltas) == det.output_text
    assert det.output_text == smol_tokenizer.decode(smol_tokenizer.encode(" " + text, add_special_tokens=False))
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens ended inside a character


def test_byte_fallback_streaming(byte_fallback_tokenizer) -> None:
    text = "Hello 你好 👍 world!"
    deltas, det = stream(byte_fallback_tokenizer, text, prompt="ab cd")
    assert "".join(deltas) == det.output_text
    # The first output token starts a word after the prompt: its space is kept.
    assert det.output_text == " " + text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[7:10] == ["", "", "你"]  # three byte tokens, one character


def test_stop_string_is_never_partly_sent(smol_tokenizer) -> None:
    text = "The ENgine is not the END of the story"
    deltas, det = stream(smol_tokenizer, text, stop=["END"])
    assert det.stop_str == "END"
    assert "".join(deltas) == det.output_text == "The ENgine is not the "
    sent = ""
    for d in deltas:  # every prefix sent is a prefix of the final text: nothing is retracted
        sent += d
        assert det.output_text.startswith(sent)


def test_include_stop_str_and_earliest_stop(smol_tokenizer) -> None:
    deltas, det = stream(smol_tokenizer, "alpha beta gamma delta", stop=["delta", "beta"], include_stop_str_in_output=True)
    assert det.stop_str == "beta"
    assert "".join(deltas) == det.output_text == "alpha beta"


def test_stop_string_inside_one_token_and_across_tokens(smol_tokenizer) -> None:
    deltas, det = stream(smol_tokenizer, "Hello world, goodbye", stop=["o w"])
    assert "".join(deltas) == det.output_text == "Hell"
    deltas, det = stream(smol_tokenizer, "one two three", stop=["tw"])
    assert "".join(deltas) == det.output_text == "one "


def test_hold_back_releases_text_at_finish(smol_tokenizer) -> None:
    deltas, det = stream(smol_tokenizer, "no stop here at all", stop=["XYZW"])
    assert det.stop_str is None
    assert "".join(deltas) == det.output_text == "no stop here at all"
    assert len(deltas[-1]) >= 3  # the held-back tail comes with the final delta


def test_incomplete_bytes_at_finish_are_flushed(smol_tokenizer) -> None:
    ids = smol_tokenizer.encode("你好", add_special_tokens=False)
    det = IncrementalDetokenizer(smol_tokenizer, [1], SamplingParams())
    det.append(ids[:1])
    assert det.take_delta(False) == ""
    tail = det.take_delta(True)
    assert det.output_text == tail == smol_tokenizer.decode(ids[:1])


def test_min_tokens_defers_stop_strings(smol_tokenizer) -> None:
    deltas, det = stream(smol_tokenizer, "a b a b a b", stop=[" b"], min_tokens=4)
    assert det.stop_str == " b"
    assert "".join(deltas) == det.output_text == "a b a"
