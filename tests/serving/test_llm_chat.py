"""Offline `LLM.chat` (vLLM's API) against `apply_chat_template` + `generate`: identical tokens.

A tiny random Llama carrying SmolLM2's tokenizer and chat template (tests/support/model_fixtures.py);
one conversation and a batch of conversations, greedy and seeded sampling, the template options.
"""

from __future__ import annotations

import pytest

from serving.llm import LLM
from serving.sampling_params import SamplingParams

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CONVERSATIONS = [
    [SYSTEM, {"role": "user", "content": "Tell me something about large language models."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}],
    [SYSTEM, {"role": "user", "content": "请用中文简单介绍一下长城。"}],
]


@pytest.fixture(scope="module")
def llm(tiny_models):  # noqa: ANN001, ANN201
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # 2-core CI: one steady thread
    yield LLM(tiny_models("llama"), block_size=4, max_num_seqs=4, num_gpu_blocks_override=256)
    torch.set_num_threads(before)


def _template_ids(tok, conversation, **kw) -> list[int]:  # noqa: ANN001
    """What the seeds do by hand: apply_chat_template(tokenize=False), then the text's tokens."""
    messages = [{**m, "content": "".join(p["text"] for p in m["content"])} if isinstance(m["content"], list) else m
                for m in conversation]
    text = tok.apply_chat_template(messages, tokenize=False, **kw)
    return text, tok.encode(text, add_special_tokens=False)


def test_chat_matches_apply_chat_template_then_generate(llm) -> None:  # noqa: ANN001
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=12)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=12)
    # one conversation (the seed's Qwen2 example, through llm.chat instead of by hand)
    text, ids = _template_ids(tok, CONVERSATIONS[0], add_generation_prompt=True)
    [chat] = llm.chat(CONVERSATIONS[0], greedy, use_tqdm=False)
    [gen] = llm.generate([text], greedy, use_tqdm=False)  # seed 001 verbatim: generate([text], params)
    assert chat.prompt == text and chat.prompt_token_ids == ids == gen.prompt_token_ids
    assert chat.outputs[0].token_ids == gen.outputs[0].token_ids and len(gen.outputs[0].token_ids) == 12
    assert chat.outputs[0].text == gen.outputs[0].text
    # a batch of conversations, one params per conversation (greedy, sampled, greedy)
    params = [greedy, seeded, greedy]
    chats = llm.chat(CONVERSATIONS, params, use_tqdm=False)
    texts = [_template_ids(tok, c, add_generation_prompt=True)[0] for c in CONVERSATIONS]
    gens = llm.generate([{"prompt": t, "prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in texts],
                        params, use_tqdm=False)
    assert [c.prompt for c in chats] == texts
    assert [c.outputs[0].token_ids for c in chats] == [g.outputs[0].token_ids for g in gens]
    assert "Name a colour." in chats[1].prompt  # text parts joined


def test_chat_template_options(llm) -> None:  # noqa: ANN001
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=4)
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    [out] = llm.chat(conv, params, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
    assert out.prompt == tok.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert out.prompt.rstrip().endswith("Hello")
    [out] = llm.chat(conv[:1], params, chat_template="{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}",
                     use_tqdm=False)
    assert out.prompt == "<user>Hi"
    for kw, needle in [({"lora_request": object()}, "LoRA"), ({"mm_processor_kwargs": {"x": 1}}, "multi-modal"),
                       ({"continue_final_message": True}, "cannot both"),
                       ({"chat_template_content_format": "xml"}, "content_format")]:
        with pytest.raises(ValueError, match=needle):
            llm.chat(conv, params, use_tqdm=False, **kw)
    with pytest.raises(ValueError, match="only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], params, use_tqdm=False)
